"""`LauncherWatch`: a rank ends once its parent (the launcher) is gone, whatever the platform."""

import subprocess
import sys

from mlxkv.engine.parallel.launcher_watch import POLL_S, LauncherWatch


def test_the_watch_ends_the_rank_once_its_parent_is_another():
    parents = iter([100, 100, 100, 1])  # the launcher, twice more, then init: the launcher died
    ended, slept = [], []
    watch = LauncherWatch(ended.append, lambda: next(parents))
    watch.run(slept.append)
    assert ended == [100] and slept == [POLL_S, POLL_S]


def test_a_rank_whose_parent_stays_goes_on():
    ended = []
    watch = LauncherWatch(ended.append, lambda: 100)
    assert not watch.check() and not watch.check() and ended == []


def test_an_orphan_ends_at_once_with_a_line_that_names_the_launcher():
    code = "from mlxkv.engine.parallel.launcher_watch import end_orphan; end_orphan(4242); print('after')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == ""
    assert "error: the launcher (process 4242) is gone; this rank of the tensor-parallel group ends" in done.stderr
