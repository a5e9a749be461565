"""The simulator's counts kept on disk beside its built kernels, so that a cost model's table is
counted once per kernel change: counting builds a kernel variant per shape and runs it over every
key (minutes for `mlxkv doctor`'s grid on a 2-core machine), reading the counts back takes
milliseconds. A count is keyed by everything that decides it: the kernel and runtime sources, the
launcher and simulator code, the compiler and its flags, and what was counted."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .. import kernels
from . import build, simulator
from .simulator import Counters

# What decides a count besides its arguments: every file under these (a folder's files in order).
SOURCES = (
    kernels.METAL_DIR,
    Path(kernels.__file__),
    Path(build.__file__),
    Path(simulator.__file__),
    Path(__file__).with_name("cost_model.py"),  # the inputs it counts on (it imports this module)
)


def source_digest() -> str:
    """A digest of the contents of `SOURCES`, the compiler and the flags a counted kernel is built with."""
    digest = hashlib.sha256()
    for root in SOURCES:
        for path in sorted(root.rglob("*")) if root.is_dir() else [root]:
            if path.is_file():
                digest.update(f"{path.relative_to(root)}\n".encode() + path.read_bytes())
    flags = [*build.CHECK_FLAGS, *build.BUILD_FLAGS, *build.COUNT_FLAGS]
    digest.update("\n".join([build.compiler().name, *flags]).encode())
    return digest.hexdigest()


def path_of(what: str) -> Path:
    """Where the counts of `what` (a description of the launch and its arguments) are kept."""
    key = hashlib.sha256(f"{source_digest()}\n{what}".encode()).hexdigest()[:24]
    return build.CACHE / f"{key}.counts"


def counted(what: str, count: Callable[[], Sequence[Counters]]) -> tuple[Counters, ...]:
    """The counts of `what`, read from the cache, else `count()`ed and kept there."""
    path = path_of(what)
    if path.exists():
        return tuple(_counters(fields) for fields in json.loads(path.read_text()))
    launches = tuple(count())
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")  # processes counting at once each write whole files
    partial.write_text(json.dumps([dataclasses.asdict(launch) for launch in launches]))
    partial.replace(path)
    return launches


def _counters(fields: dict[str, Any]) -> Counters:
    """A `Counters` as `counted` wrote it (JSON has lists, not tuples)."""
    return Counters(**{**fields, "dynamic_arrays": tuple(fields["dynamic_arrays"])})
