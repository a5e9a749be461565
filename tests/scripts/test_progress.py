import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))

import progress
from harness import blas_in_use

SCRIPTS = Path(progress.__file__).parent
UP_FRONT = (
    "With its defaults this takes about 17 minutes on a 2-core x86-64 Linux CPU "
    "(MLX's CPU build, float16 matmuls, so the BLAS plays no part)."
)


def compare_layouts(checkpoint, tmp_path) -> list[str]:
    """A compare_layouts run long enough for the bar to show (it waits half a second)."""
    model = str(checkpoint("llama-fp32-d64"))
    small = ["--num-requests", "12", "--prompt-len", "20", "--output-len", "40", "--max-num-seqs", "4"]
    return [sys.executable, str(SCRIPTS / "compare_layouts.py"), "--model", model, "--out", str(tmp_path), *small]


def in_a_terminal(command: list[str]) -> str:
    """What `command` writes to a 40 x 150 terminal, stdout and stderr together, carriage returns
    as line breaks."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 150, 0, 0))
    proc = subprocess.Popen(command, stdout=follower, stderr=follower)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the other end closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    assert proc.wait(timeout=600) == 0
    os.close(leader)
    return b"".join(chunks).decode().replace("\r", "\n")


@pytest.mark.parametrize("seconds, said", [(40, "40 seconds"), (89, "89 seconds"), (1140, "19 minutes")])
def test_durations_read_as_a_person_says_them(seconds, said):
    assert progress.duration(seconds) == said


def test_the_up_front_line_names_the_machine_and_what_the_time_depends_on(capsys):
    progress.expect(1006, progress.FLOAT16)
    assert capsys.readouterr().out == UP_FRONT + "\n"
    progress.expect(300, progress.OPENBLAS)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (
        "With its defaults this takes about 5 minutes on a 2-core x86-64 Linux CPU "
        "(MLX's CPU build, OpenBLAS preloaded)."
    )
    reference = blas_in_use().startswith("the reference BLAS")
    assert lines[1:] == (
        [
            "This process uses the reference BLAS bundled with mlx[cpu]: expect several times longer "
            "(docs/benchmarks.md, Speed on Linux, says how to preload OpenBLAS)."
        ]
        if reference
        else []
    )


def test_no_bar_when_stdout_is_not_a_terminal(capsys):
    bar = progress.bar(10, "counting")
    bar.update(10)
    bar.close()
    assert bar.disable
    assert capsys.readouterr() == ("", "")


def test_compare_layouts_says_how_long_then_shows_what_it_runs_and_the_time_left(checkpoint, tmp_path):
    screen = in_a_terminal(compare_layouts(checkpoint, tmp_path))
    assert screen.splitlines()[0] == UP_FRONT
    described = re.findall(r"^(run \d/8: [^:]+):.*\| *\d+/\d+ \[\d\d:\d\d<\d\d:\d\d, +[\d.]+tok/s\]", screen, re.M)
    assert described[0].startswith("run 1/8: mlxkv paged (pages of 8)")
    assert "run 8/8: mlx-lm BatchGenerator" in described
    assert re.search(r"^paged_waste=", screen, re.M)


def test_piped_output_holds_the_results_alone(checkpoint, tmp_path):
    done = subprocess.run(compare_layouts(checkpoint, tmp_path), capture_output=True, text=True, check=True)
    assert done.stdout.startswith(UP_FRONT + "\n")
    assert done.stderr == ""
