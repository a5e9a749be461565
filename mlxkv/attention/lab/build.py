"""How the simulator builds a kernel: the signature-complete translation unit type-checked as Metal
(C++14, address spaces distinct, pedantic) with clang, built as C++20 against `metal/sim/runtime.h`
(its precompiled header cached per compiler and flags), the builds cached by content and trimmed
by age and size, and the build's IR read for private arrays left in memory."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ...errors import MlxkvError
from ..kernels import METAL_DIR

RUNTIME = METAL_DIR / "sim" / "runtime.h"
CACHE = Path(os.environ.get("MLXKV_SIM_CACHE", Path.home() / ".cache" / "mlxkv" / "sim"))
CACHE_LIMIT = 6 * 2**30  # bytes of built kernels kept: each checkout path and kernel change adds ~2 GB
UNUSED_FOR = 3600  # seconds a built kernel must have gone unused before it may be removed


class SimulatorError(MlxkvError):
    """A kernel that does not compile, or that the simulator caught misbehaving."""


METAL_DIALECT = "c++14"  # MSL 3.0-3.2, the versions MLX compiles for, are based on C++14
CHECK_FLAGS = [f"-std={METAL_DIALECT}", "-pedantic", "-Werror", "-DSIM_ADDRESS_SPACES"]
BUILD_FLAGS = ["-std=c++20", "-O0", "-w"]  # why: -O1 builds far slower and runs these small launches no faster
# Every load and store hooked; -O1 keeps locals in registers, off the hooks.
COUNT_FLAGS = ["-O1", "-DSIM_COUNT", "-fsanitize-coverage=func,trace-loads,trace-stores"]
ADDRESS_SPACES = {"1": "device", "2": "constant", "3": "threadgroup"}
NOT_VIABLE = re.compile(
    r"(header|body):(\d+):(\d+): note: candidate function(?: template)?(?: \[with [^\]]*\])? "
    r"not viable: cannot pass pointer to address space '(\w+)' as a pointer to address "
    r"space '(\w+)' in (\d+)\w* argument"
)


# C++14 that Metal's language leaves out, which clang accepts: (pattern, what it is).
NOT_IN_METAL = [
    (re.compile(r"(?<![\w\]\)\[\s])\s*\[[^\[\]]*\]\s*(\(|\{|mutable\b)"), "a lambda expression"),
    (re.compile(r"\b(virtual|goto|thread_local|try|throw|dynamic_cast|typeid|new|delete)\b"), "'{0}'"),
]
COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


def _outside_metal(sources: dict[str, str]) -> str | None:
    """The first C++ feature in `sources` that Metal's language does not have, and where."""
    for file, text in sources.items():
        for number, line in enumerate(COMMENTS.sub(lambda m: "\n" * m.group().count("\n"), text).splitlines(), 1):
            for pattern, what in NOT_IN_METAL:
                found = pattern.search(line)
                if found:
                    return f"{file}:{number}: {what.format(found.group(1))} is not part of Metal's language"
    return None


@dataclass(frozen=True)
class Compiler:
    """A clang++ of version 17 or newer, as the command that runs it."""

    command: tuple[str, ...]
    syntax_only: bool = True  # False: its driver writes an object file even to check a unit (zig's does)

    @property
    def name(self) -> str:
        return " ".join(self.command)

    def check_only(self, scratch: Path) -> list[str]:
        """The flags that type-check a unit without building it."""
        return ["-fsyntax-only"] if self.syntax_only else ["-c", "-o", str(scratch)]


ZIG = Compiler((sys.executable, "-m", "ziglang", "c++", "-Wno-unused-command-line-argument"), syntax_only=False)


def _clang_major(command: str) -> int:
    """The major version of the clang++ `command`, or 0 if it is not one."""
    try:
        out = subprocess.run([command, "--version"], capture_output=True, text=True, timeout=30).stdout
    except OSError:
        return 0
    found = re.search(r"clang version (\d+)", out)
    return int(found.group(1)) if found else 0


@lru_cache(maxsize=1)
def compiler() -> Compiler:
    """`MLXKV_SIM_CXX`, else the newest clang++-N on the PATH, else the clang the `ziglang` wheel bundles
    (the `test` extra installs it), else a plain clang++ of version 17 or newer."""
    chosen = os.environ.get("MLXKV_SIM_CXX")
    if chosen:
        return Compiler(tuple(shlex.split(chosen)))
    versioned = [f"clang++-{v}" for v in range(30, 16, -1) if shutil.which(f"clang++-{v}")]
    if versioned:
        return Compiler((versioned[0],))
    if importlib.util.find_spec("ziglang") is not None:
        return ZIG
    if shutil.which("clang++") and _clang_major("clang++") >= 17:
        return Compiler(("clang++",))
    raise SimulatorError(
        "the Metal simulator needs clang++ 17 or newer, which type-checks address spaces as "
        "Metal's compiler does: pip install ziglang (the test extra brings it), a clang++-17 "
        "or newer on the PATH, or MLXKV_SIM_CXX naming one"
    )


def _metal_words(text: str) -> str:
    """Compiler output with clang's numbered address spaces written as Metal's keywords
    (its generic space is Metal's `thread`)."""
    text = re.sub(r"__attribute__\(\(address_space\((\d)\)\)\) ?", lambda m: ADDRESS_SPACES[m.group(1)] + " ", text)
    text = text.replace("generic address space", "address space 'thread'")
    return re.sub(r"address space '(\d)'", lambda m: f"address space '{ADDRESS_SPACES[m.group(1)]}'", text)


def _parameter(source: str, line: int, column: int, index: int) -> str:
    """The text of parameter `index` (1-based) of the function declared at `line`:`column` of `source`."""
    text = "\n".join(source.splitlines()[line - 1 :])[column - 1 :]
    depth, params, start = 0, [], text.index("(") + 1
    for i in range(start - 1, len(text)):
        if text[i] in "(<[":
            depth += 1
        elif text[i] in ")>]":
            depth -= 1
        if depth == 0 or (depth == 1 and text[i] == ","):
            params.append(" ".join(text[start:i].split()))
            start = i + 1
        if depth == 0:
            break
    return params[index - 1] if index <= len(params) else "?"


def _explain(stderr: str, sources: dict[str, str], constant_inputs: list[str]) -> str:
    """Name the parameter behind each address-space mismatch, and why an input is `constant`."""
    notes = []
    for file, line, column, have, want, arg in NOT_VIABLE.findall(_metal_words(stderr)):
        param = _parameter(sources[file], int(line), int(column), int(arg))
        notes.append(
            f"argument {arg} is a {have} pointer, but parameter `{param}` "
            f"({file} line {line}) takes a {want} one; Metal converts neither way"
        )
    if notes and constant_inputs:
        notes.append(
            f"MLX passes inputs of fewer than 8 elements in the constant address space, as it does "
            f"{', '.join(constant_inputs)} in this call: template the helper on the pointer type"
        )
    return "".join(f"\n  {n}" for n in notes)


def runtime_copy() -> Path:
    """`runtime.h` as a file in the cache named by its content, which every build includes.

    Checkouts share the cache (CI's clone and a developer's tree both use ~/.cache), and clang
    refuses a precompiled header whose source moved or was touched since: a copy that only its
    content names is neither, wherever the checkout is and however often it is cloned."""
    text = RUNTIME.read_text()
    copy = CACHE / f"runtime-{hashlib.sha256(text.encode()).hexdigest()[:24]}.h"
    _write_once(copy, text)
    return copy


def _write_once(path: Path, text: str) -> None:
    """Create `path` holding `text` unless it exists, atomically: a file a precompiled header was
    built from must not be rewritten (its modification time would refuse the header), and
    processes that test in parallel may get here at once."""
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(text)
    with contextlib.suppress(FileExistsError):
        os.link(partial, path)
    partial.unlink()


def _precompiled_runtime(cxx: Compiler, flags: list[str]) -> Path:
    """The runtime copy built once as a precompiled header for `flags`: parsing it and the
    standard headers it includes is most of the time a kernel takes to compile.

    Its name carries a fingerprint of every file clang read to build it, as clang's dependency file
    lists them: clang refuses a precompiled header whose inputs have changed, and a reinstalled
    compiler (CI's fresh virtual environment) ships the same headers with new modification times.
    A header built from older inputs is removed when its successor is built."""
    runtime = runtime_copy()
    digest = hashlib.sha256("\n".join([runtime.name, str(runtime.stat().st_mtime_ns), cxx.name, *flags]).encode())
    stem = f"{runtime.stem}-{digest.hexdigest()[:24]}"
    inputs = CACHE / f"{stem}.inputs"  # the files it was built from, a line each
    if inputs.exists():
        pch = CACHE / f"{stem}-{_fingerprint(inputs)}.pch"
        if pch.exists():
            return pch
    wrapper = CACHE / f"{stem}.h"  # included, so that the runtime stays a system header
    _write_once(wrapper, f'#include "{runtime}"\n')
    partial, dependencies = (CACHE / f"{stem}.{os.getpid()}.{suffix}" for suffix in ("tmp", "d"))
    built = subprocess.run(
        [*cxx.command, *flags, "-x", "c++-header", str(wrapper), "-o", str(partial), "-MD", "-MF", str(dependencies)],
        capture_output=True,
        text=True,
    )
    if built.returncode != 0:
        raise SimulatorError("the simulator's runtime does not compile:\n" + built.stderr[:3000])
    listed = CACHE / f"{stem}.{os.getpid()}.inputs"
    listed.write_text("\n".join(_dependencies(dependencies.read_text())))
    dependencies.unlink()
    listed.replace(inputs)
    pch = CACHE / f"{stem}-{_fingerprint(inputs)}.pch"
    partial.replace(pch)
    for older in CACHE.glob(f"{stem}-*.pch"):
        if older != pch:
            older.unlink(missing_ok=True)
    return pch


def _dependencies(makefile_rule: str) -> list[str]:
    """The prerequisites of the one rule in a dependency file as clang writes it (`target: a b \\`
    continued over lines, a space in a path escaped as `\\ `)."""
    prerequisites = re.split(r":\s", makefile_rule.replace("\\\n", " "), maxsplit=1)[1]
    return [word.replace("\\ ", " ") for word in re.split(r"(?<!\\)\s+", prerequisites.strip())]


def _fingerprint(inputs: Path) -> str:
    """A digest of the path, size and modification time of each file `inputs` lists (what clang
    checks before it accepts a precompiled header), a missing file included."""
    digest = hashlib.sha256()
    for name in inputs.read_text().splitlines():
        try:
            found = os.stat(name)
            digest.update(f"{name} {found.st_size} {found.st_mtime_ns}\n".encode())
        except FileNotFoundError:
            digest.update(f"{name} missing\n".encode())
    return digest.hexdigest()[:24]


def compile_unit(unit: str, sources: dict[str, str], constant_inputs: list[str], counting: bool = False) -> Path:
    """Type-check `unit` in Metal's dialect with its address spaces, then build it to run
    (with the cost counters when `counting`)."""
    cxx = compiler()
    outside = _outside_metal(sources)
    if outside:
        raise SimulatorError("kernel does not compile as Metal: " + outside)
    build_flags = BUILD_FLAGS + COUNT_FLAGS if counting else BUILD_FLAGS
    key = hashlib.sha256("\n".join([unit, cxx.name, *CHECK_FLAGS, *build_flags]).encode())  # the unit names the runtime
    binary = CACHE / key.hexdigest()[:24]
    _trim_cache()
    try:
        os.utime(binary)  # used now: the trim keeps it
        return binary
    except FileNotFoundError:
        pass
    CACHE.mkdir(parents=True, exist_ok=True)
    source = binary.with_suffix(f".{os.getpid()}.cpp")  # its own copy: processes may build one unit at once
    source.write_text(unit)
    try:
        _check_and_build(cxx, source, binary, build_flags, sources, constant_inputs)
    finally:
        source.unlink()
    return binary


@lru_cache(maxsize=1)
def _trim_cache() -> None:
    """Keep the built kernels under `CACHE_LIMIT` bytes, once a process: those unused for an hour go,
    least recently used first, until three quarters of the limit is left (every use touches a
    kernel, so one another process runs now is never removed). The precompiled runtimes and the
    small files stay."""
    kernels = list(_built_kernels())
    total, now = sum(found.st_size for _, found in kernels), time.time()
    for path, found in sorted(kernels, key=lambda kernel: kernel[1].st_mtime):
        if total <= CACHE_LIMIT * 3 // 4 or now - found.st_mtime < UNUSED_FOR:
            break
        path.unlink(missing_ok=True)
        total -= found.st_size


def _built_kernels() -> Iterator[tuple[Path, os.stat_result]]:
    """Each built kernel in the cache (a file without a suffix) and its status; one another process
    removes meanwhile is left out."""
    if CACHE.is_dir():
        for path in CACHE.iterdir():
            if not path.suffix:
                with contextlib.suppress(FileNotFoundError):
                    yield path, path.stat()


# What a GPU compiler does to a kernel before it allocates registers: everything inlined (Metal
# inlines all calls), -O2's full unrolling of fixed-count loops and scalar replacement of arrays.
OPTIMISED_FLAGS = ["-std=c++20", "-O2", "-g", "-w", "-fno-discard-value-names", "-mllvm", "-inline-threshold=100000"]
DEBUG_RECORD = re.compile(r"(?:#dbg_\w+|llvm\.dbg\.\w+)\((.*)\)")
LOCAL_VARIABLE = re.compile(r'^(!\d+) = !DILocalVariable\(name: "(\w+)", (?!arg:).*?file: (!\d+), line: (\d+)')
KERNEL_FILE = re.compile(r'^(!\d+) = !DIFile\(filename: "(header|body)"')
ARRAY_ALLOCA = re.compile(r"^\s*(%[\w.]+) = alloca \[")


def dynamic_arrays(unit: str) -> tuple[str, ...]:
    """The kernel's private arrays (declared in its header or body) that optimised code keeps in
    memory: `unit` built to LLVM IR as a GPU compiler would optimise it, its surviving array
    allocations traced to their variables through the debug records."""
    key = hashlib.sha256("\n".join([unit, compiler().name, *OPTIMISED_FLAGS]).encode()).hexdigest()[:24]
    found = CACHE / f"{key}.arrays"
    if not found.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            source, ir = Path(tmp) / "unit.cpp", Path(tmp) / "unit.ll"
            source.write_text(unit)
            built = subprocess.run(
                [*compiler().command, *OPTIMISED_FLAGS, "-emit-llvm", "-S", "-o", str(ir), str(source)],
                capture_output=True,
                text=True,
            )
            if built.returncode != 0:
                raise SimulatorError("kernel does not compile optimised:\n" + "\n".join(built.stderr.splitlines()[:30]))
            _write_once(found, "\n".join(_arrays_in_memory(ir.read_text())))
    return tuple(line for line in found.read_text().splitlines() if line)


def _arrays_in_memory(ir: str) -> list[str]:
    """`name at file:line` for each array allocation left in `ir` whose variable the kernel's own
    files declare (the simulator's runtime has arrays of its own)."""
    lines = ir.splitlines()
    files = {m.group(1): m.group(2) for m in map(KERNEL_FILE.match, lines) if m}
    variables = {
        m.group(1): f"{m.group(2)} at {files[m.group(3)]}:{m.group(4)}"
        for m in map(LOCAL_VARIABLE.match, lines)
        if m and m.group(3) in files
    }
    allocas = {m.group(1) for m in map(ARRAY_ALLOCA.match, lines) if m}
    arrays = set()
    for record in (m.group(1) for line in lines if (m := DEBUG_RECORD.search(line))):
        pointers = set(re.findall(r"%[\w.]+", record)) & allocas
        names = [variables[v] for v in re.findall(r"!\d+", record) if v in variables]
        if pointers and names:
            arrays.add(names[0])
    return sorted(arrays)


def _check_and_build(
    cxx: Compiler,
    source: Path,
    binary: Path,
    build_flags: list[str],
    sources: dict[str, str],
    constant_inputs: list[str],
) -> None:
    """Type-check the unit in `source` as Metal, then build it into `binary`."""
    check_pch = _precompiled_runtime(cxx, CHECK_FLAGS)
    scratch = binary.with_suffix(f".{os.getpid()}.o")
    checked = subprocess.run(
        [*cxx.command, *CHECK_FLAGS, *cxx.check_only(scratch), "-include-pch", str(check_pch), str(source)],
        capture_output=True,
        text=True,
    )
    scratch.unlink(missing_ok=True)
    if checked.returncode != 0:
        raise SimulatorError(
            "kernel does not compile as Metal (address spaces, C++14, pedantic):\n"
            + _metal_words("\n".join(checked.stderr.splitlines()[:30]))
            + _explain(checked.stderr, sources, constant_inputs)
        )
    partial = binary.with_suffix(f".{os.getpid()}.tmp")
    built = subprocess.run(
        [
            *cxx.command,
            *build_flags,
            "-include-pch",
            str(_precompiled_runtime(cxx, build_flags)),
            "-o",
            str(partial),
            str(source),
        ],
        capture_output=True,
        text=True,
    )
    if built.returncode != 0:
        raise SimulatorError("kernel does not compile:\n" + "\n".join(built.stderr.splitlines()[:30]))
    partial.replace(binary)
