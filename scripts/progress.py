"""How long a script will take, and how far it has got.

Each script first prints how long its defaults took on the machine the project's figures come
from, then shows a progress bar (tqdm) that names the work in hand and estimates the time left.
The bar goes to stderr and only when stdout is a terminal, so output piped to a file or captured
by a test holds the results alone.
"""

from __future__ import annotations

import sys

from harness import blas_in_use
from tqdm import tqdm

MACHINE = "a 2-core x86-64 Linux CPU"


def duration(seconds: float) -> str:
    """`seconds` in the unit a person reads it in: "40 seconds", "19 minutes"."""
    if seconds < 90:
        return f"{seconds:.0f} seconds"
    return f"{seconds / 60:.0f} minutes"


OPENBLAS = "OpenBLAS preloaded"
FLOAT16 = "float16 matmuls, so the BLAS plays no part"


def expect(seconds: float, measured: str) -> None:
    """Say up front how long the defaults take on `MACHINE`, `measured` saying how (`OPENBLAS`,
    `FLOAT16` or another condition); warns when a BLAS-bound script runs on the reference BLAS."""
    print(
        f"With its defaults this takes about {duration(seconds)} on {MACHINE} (MLX's CPU build, {measured}).",
        flush=True,
    )
    if measured == OPENBLAS and blas_in_use().startswith("the reference BLAS"):
        print(
            "This process uses the reference BLAS bundled with mlx[cpu]: expect several times longer "
            "(docs/benchmarks.md, Speed on Linux, says how to preload OpenBLAS).",
            flush=True,
        )


def bar(total: float, what: str, unit: str = "step") -> tqdm:
    """A progress bar over `total` units of work, described by `what` (change it with
    `set_description` as the work moves on); a silent stand-in when stdout is not a terminal.
    The time left comes from the average rate since the start (`smoothing=0`): the scripts'
    rates swing from step to step, and a recent-rate estimate jumped by 2x with them."""
    return tqdm(
        total=total,
        desc=what,
        unit=unit,
        disable=not sys.stdout.isatty(),
        dynamic_ncols=True,
        leave=False,
        delay=0.5,
        smoothing=0,
    )


def say(line: str) -> None:
    """Print `line` above any progress bar, which is redrawn below it."""
    tqdm.write(line)
    sys.stdout.flush()
