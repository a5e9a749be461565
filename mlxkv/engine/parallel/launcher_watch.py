"""Ends a rank whose launcher is gone. `mlx.launch` starts each rank as its child (over ssh on another
machine, the ssh session's); when the launcher dies without ending them (killed, crashed), a rank
would go on alone: rank 0 serving, the others waiting on it. Polling the parent's process id works
on Linux and macOS alike (Linux's PR_SET_PDEATHSIG does not exist on macOS, and follows the thread
that started the child, which in `mlx.launch` is not the launcher's main one)."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)
POLL_S = 1.0  # how often the parent is checked: a rank outlives its launcher by about this much


class LauncherWatch:
    """Calls `end` once this process's parent is no longer the one it had when watched from
    (the launcher ended: the process was handed to another parent, usually init or launchd)."""

    def __init__(self, end: Callable[[int], None], parent: Callable[[], int] = os.getppid) -> None:
        self.end = end
        self.parent = parent
        self.launcher = parent()

    def check(self) -> bool:
        """Whether the launcher is gone (`end` was called with its process id)."""
        if self.parent() == self.launcher:
            return False
        self.end(self.launcher)
        return True

    def run(self, sleep: Callable[[float], None] = time.sleep) -> None:
        """Check every `POLL_S` seconds until the launcher is gone."""
        while not self.check():
            sleep(POLL_S)


@functools.cache
def watch_launcher() -> None:
    """End this process soon after its launcher (once per process: every engine shares the watch)."""
    watch = LauncherWatch(end_orphan)
    threading.Thread(target=watch.run, name="mlxkv-launcher-watch", daemon=True).start()


def end_orphan(launcher: int) -> None:
    """End the process at once: its group's other ranks are ending too, nobody reads its output, and
    a rank may be blocked in a collective that cannot be interrupted."""
    message = f"the launcher (process {launcher}) is gone; this rank of the tensor-parallel group ends"
    logger.error(message)
    with contextlib.suppress(OSError):  # the launcher held the other end of stderr
        print(f"error: {message}", file=sys.stderr, flush=True)
    os._exit(1)
