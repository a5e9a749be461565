"""Runs Metal kernel bodies on the CPU, behind the call signature of `mx.fast.metal_kernel`.

`metal_kernel(...)` returns a kernel that, when called like an MLX one, writes the function
signature MLX would write for that call (same substring rules), type-checks the unmodified body
as Metal's C++14 with distinct address spaces, builds it as C++20 against `metal/sim/runtime.h`
with clang++ 17 or newer (see `compiler`), and runs it in a child
process with threadgroup semantics: every thread of a group is live at once (a fiber),
barriers wait for the whole group at one call site, SIMD-group functions exchange values
among 32 lanes, threadgroup memory is shared by the group and starts as NaN. Buffers sit
against guard pages, so an out-of-bounds access is reported with the buffer's name. Each
call runs twice, threads and groups in forward and then reversed order, and results that
differ are reported as a race.

Inside `with cost_counters() as launches:` each launch is also counted (`Counters`): device
bytes and load/store instructions, SIMD-group reductions and shuffles, transcendental calls,
barriers, threadgroup memory and threads. Those are the inputs of a cost model, not a timing.
The counters also name every private array the kernel indexes with a value known only at run
time once fixed-count loops are unrolled (`dynamic_arrays`): such an array lives in memory on
the GPU, not in registers, and every access to it is a load or a store.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from .build import SimulatorError, compile_unit, dynamic_arrays, runtime_copy

MLX_TYPES = {
    mx.float32: "float",
    mx.float16: "float16_t",
    mx.bfloat16: "bfloat16_t",
    mx.int32: "int32_t",
    mx.uint32: "uint32_t",
    mx.int64: "int64_t",
    mx.uint8: "uint8_t",
    mx.int8: "int8_t",
    mx.int16: "int16_t",
    mx.uint16: "uint16_t",
    mx.bool_: "bool",
}

# MLX's attributes, in the order its signatures list them (read off MLX's own output).
ATTRIBUTES = {
    "dispatch_quadgroups_per_threadgroup": "uint",
    "dispatch_simdgroups_per_threadgroup": "uint",
    "dispatch_threads_per_threadgroup": "uint3",
    "grid_origin": "uint3",
    "grid_size": "uint3",
    "quadgroup_index_in_threadgroup": "uint",
    "quadgroups_per_threadgroup": "uint",
    "simdgroup_index_in_threadgroup": "uint",
    "simdgroups_per_threadgroup": "uint",
    "thread_execution_width": "uint",
    "thread_index_in_quadgroup": "uint",
    "thread_index_in_simdgroup": "uint",
    "thread_index_in_threadgroup": "uint",
    "thread_position_in_grid": "uint3",
    "thread_position_in_threadgroup": "uint3",
    "threadgroup_position_in_grid": "uint3",
    "threadgroups_per_grid": "uint3",
    "threads_per_grid": "uint3",
    "threads_per_simdgroup": "uint",
    "threads_per_threadgroup": "uint3",
}
# How the runtime provides each attribute it supports.
RUNTIME_ATTRIBUTES = {
    name: f"t.{name}"
    for name in (
        "simdgroup_index_in_threadgroup",
        "simdgroups_per_threadgroup",
        "thread_index_in_simdgroup",
        "thread_index_in_threadgroup",
        "thread_position_in_grid",
        "thread_position_in_threadgroup",
        "threadgroup_position_in_grid",
        "threadgroups_per_grid",
        "threads_per_grid",
        "threads_per_simdgroup",
        "threads_per_threadgroup",
    )
} | {"grid_size": "t.threads_per_grid", "thread_execution_width": "t.threads_per_simdgroup"}


@dataclass
class Counters:
    """What one launch did, counted by the simulator (see `metal/sim/runtime.h`).

    Device bytes count once per threadgroup (a model of a core's cache serving a threadgroup's
    repeated reads); loads and stores count instructions on device buffers, a vector load being
    one `vec<T, N>` copied out of device memory. SIMD-group operations and barriers count once
    per SIMD group or threadgroup; transcendental calls once per thread. `threadgroup_memory` and
    `threads` are per threadgroup. `dynamic_arrays` names the private arrays (as `name at
    file:line`) that stay in memory after inlining, full unrolling and scalar replacement, the
    passes Metal's compiler runs too (LLVM's -O2): an array is left there when an index is not a
    constant after unrolling, including `c ? a[i] : a[j]`, which C++ makes one access at a chosen
    address.
    """

    name: str
    read_bytes: int
    written_bytes: int
    loads: int
    load_bytes: int
    vector_loads: int
    vector_load_bytes: int
    stores: int
    store_bytes: int
    reductions: int
    shuffles: int
    transcendentals: int
    barriers: int
    threadgroups: int
    threadgroup_memory: int
    threads: int
    dynamic_arrays: tuple[str, ...] = ()


_counted: list[Counters] | None = None
_arrays = True  # whether counted launches name their private arrays in memory


@contextmanager
def cost_counters(arrays: bool = True) -> Iterator[list[Counters]]:
    """Count every simulated launch inside the block; yields the list they are appended to.
    `arrays=False` leaves `Counters.dynamic_arrays` empty and skips the optimised build that finds
    them: a third of a kernel's build time, which a cost model that does not read them need not pay."""
    global _counted, _arrays
    outer = _counted, _arrays
    _counted, _arrays = [], arrays
    try:
        yield _counted
    finally:
        _counted, _arrays = outer


THREADGROUP_DECL = re.compile(r"threadgroup\s+([A-Za-z_][\w:<>, ]*?)\s+([A-Za-z_]\w*)\s*((?:\[[^\]]+\])+)\s*;")


@dataclass(frozen=True)
class Param:
    """One parameter of the generated signature: its Metal text and its data."""

    metal: str
    data: np.ndarray | None  # None for thread attributes
    name: str
    output: bool = False

    @property
    def declaration(self) -> str:
        """The Metal text without its `[[attribute]]`: what the simulator compiles."""
        return self.metal.split(" [[", 1)[0]

    @property
    def type(self) -> str:
        return self.declaration.rsplit(" ", 1)[0]


def _host(array: mx.array) -> np.ndarray:
    """The array's bytes as numpy (bfloat16 as its uint16 bits), row-contiguous."""
    if array.dtype == mx.bfloat16:
        return np.ascontiguousarray(np.array(array.view(mx.uint16)))
    return np.ascontiguousarray(np.array(array))


def _template_text(template: Sequence[tuple[str, object]]) -> tuple[str, str]:
    """(`template <...>` line, `<args>`) for MLX-style template arguments."""
    decls, args = [], []
    for name, value in template:
        if isinstance(value, mx.Dtype):
            decls.append(f"typename {name}")
            args.append(MLX_TYPES[value])
        elif isinstance(value, bool):
            decls.append(f"bool {name}")
            args.append(str(int(value)))
        elif isinstance(value, int):
            decls.append(f"int {name}")
            args.append(str(value))
        else:
            raise SimulatorError(f"template argument {name}={value!r} must be a dtype, an int or a bool")
    return (f"template <{', '.join(decls)}>" if decls else ""), (f"<{', '.join(args)}>" if args else "")


class SimKernel:
    """A kernel built by `metal_kernel`; call it as an `mx.fast.metal_kernel` kernel."""

    def __init__(
        self,
        name: str,
        input_names: Sequence[str],
        output_names: Sequence[str],
        source: str,
        header: str,
        atomic_outputs: bool,
    ) -> None:
        if atomic_outputs:
            raise SimulatorError("atomic outputs are not simulated")
        self.name, self.source, self.header = name, source, header
        self.input_names, self.output_names = list(input_names), list(output_names)

    def params(self, inputs: Sequence[mx.array], output_shapes, output_dtypes) -> list[Param]:
        """The signature MLX writes for this call, parameter by parameter."""
        params: list[Param] = []
        for name, array in zip(self.input_names, inputs):
            t, data = MLX_TYPES[array.dtype], _host(array)
            if array.ndim == 0:
                params.append(Param(f"const constant {t}& {name}", data, name))
                continue
            space = "constant" if array.size < 8 else "device"
            params.append(Param(f"const {space} {t}* {name}", data, name))
            if f"{name}_shape" in self.source:
                params.append(
                    Param(f"const constant int* {name}_shape", np.array(array.shape, np.int32), f"{name}_shape")
                )
            if f"{name}_strides" in self.source:
                strides = np.array(data.strides, np.int64) // data.itemsize
                params.append(Param(f"const constant int64_t* {name}_strides", strides, f"{name}_strides"))
            if f"{name}_ndim" in self.source:
                params.append(Param(f"const constant int& {name}_ndim", np.array(array.ndim, np.int32), f"{name}_ndim"))
        for name, shape, dtype in zip(self.output_names, output_shapes, output_dtypes):
            t = MLX_TYPES[dtype]
            empty = _host(mx.zeros(tuple(shape), dtype))
            params.append(Param(f"device {t}* {name}", empty, name, output=True))
        for attr, t in ATTRIBUTES.items():
            if attr in self.source:
                params.append(Param(f"{t} {attr} [[{attr}]]", None, attr))
        return params

    def signature(self, params: list[Param]) -> list[str]:
        """The parameter lines as MLX prints them (buffer indices included)."""
        lines, index = [], 0
        for p in params:
            if p.data is None:
                lines.append(p.metal)
            else:
                lines.append(f"{p.metal} [[buffer({index})]]")
                index += 1
        return lines

    def translation_unit(self, params: list[Param], template: Sequence[tuple[str, object]]) -> str:
        unsupported = [p.name for p in params if p.data is None and p.name not in RUNTIME_ATTRIBUTES]
        if unsupported:
            raise SimulatorError(f"the simulator does not provide the attributes {unsupported}")
        decl, args = _template_text(template)
        arrays = iter(range(10**6))

        def rewrite(text: str) -> str:
            return THREADGROUP_DECL.sub(
                lambda m: (
                    f"auto& {m.group(2)} = sim::tg_alloc<threadgroup {m.group(1)}{m.group(3)}>"
                    f'({next(arrays)}, "{m.group(2)}");'
                ),
                text,
            )

        buffers = [p for p in params if p.data is not None]
        casts = []
        for p in params:
            if p.data is None:
                casts.append(RUNTIME_ATTRIBUTES[p.name])
            elif p.type.endswith("&"):
                casts.append(f"*({p.type[:-1]}*)g_buf[{buffers.index(p)}]")
            else:
                casts.append(f"({p.type})g_buf[{buffers.index(p)}]")
        return "\n".join(
            [
                f'#include "{runtime_copy()}"',
                '#line 1 "header"',
                rewrite(self.header),
                '#line 1 "signature"',
                decl,
                f"void kernel_body({', '.join(p.declaration for p in params)}) {{",
                '#line 1 "body"',
                rewrite(self.source),
                "}",
                '#line 1 "launcher"',
                f"static void* g_buf[{max(1, len(buffers))}];",
                f"static void call(const sim::ThreadIds& t) {{ kernel_body{args}({', '.join(casts)}); }}",
                "int main(int argc, char** argv) { return sim::launch(argc, argv, g_buf, call); }",
                "",
            ]
        )

    def __call__(
        self,
        *,
        inputs: Sequence[mx.array],
        output_shapes,
        output_dtypes,
        grid,
        threadgroup,
        template: Sequence[tuple[str, object]] = (),
        init_value: float | None = None,
        verbose: bool = False,
        stream=None,
        check_races: bool = True,
    ) -> list[mx.array]:
        inputs = [x if isinstance(x, mx.array) else mx.array(x) for x in inputs]
        params = self.params(inputs, output_shapes, output_dtypes)
        unit = self.translation_unit(params, list(template))
        if verbose:
            print(f"Simulated signature of `{self.name}`:\n  " + ",\n  ".join(self.signature(params)))
        constant = [
            p.name
            for p in params
            if p.name in self.input_names and p.type.startswith("const constant") and p.type.endswith("*")
        ]
        counted = _counted
        counting = counted is not None
        binary = compile_unit(unit, {"header": self.header, "body": self.source}, constant, counting)
        forward, counters = _run(binary, params, grid, threadgroup, init_value, reverse=False, counting=counting)
        if counted is not None:
            counted.append(Counters(self.name, **counters, dynamic_arrays=dynamic_arrays(unit) if _arrays else ()))
        if check_races and not counting:  # a counted launch runs once
            backward, _ = _run(binary, params, grid, threadgroup, init_value, reverse=True)
            for name, a, b in zip(self.output_names, forward, backward):
                differ = np.flatnonzero(a.view(np.uint8) != b.view(np.uint8))
                if differ.size:
                    i = int(differ[0]) // a.itemsize
                    raise SimulatorError(
                        f"kernel '{self.name}': output '{name}' depends on the order threads run in "
                        f"(element {i}: {a.reshape(-1)[i]} forward, {b.reshape(-1)[i]} reversed); "
                        "a missing barrier or a race"
                    )
        return [_to_mx(a, dtype) for a, dtype in zip(forward, output_dtypes)]


def metal_kernel(
    name: str,
    input_names: Sequence[str],
    output_names: Sequence[str],
    source: str,
    header: str = "",
    ensure_row_contiguous: bool = True,
    atomic_outputs: bool = False,
) -> SimKernel:
    """Same arguments as `mx.fast.metal_kernel`; the kernel runs in the CPU simulator."""
    return SimKernel(name, input_names, output_names, source, header, atomic_outputs)


def _to_mx(array: np.ndarray, dtype: mx.Dtype) -> mx.array:
    return mx.array(array).view(mx.bfloat16) if dtype == mx.bfloat16 else mx.array(array)


def _run(
    binary: Path,
    params: list[Param],
    grid: Sequence[int],
    threadgroup: Sequence[int],
    init_value: float | None,
    reverse: bool,
    counting: bool = False,
) -> tuple[list[np.ndarray], dict[str, int]]:
    """Run the compiled kernel once; returns the outputs (numpy, host layout) and, when
    `counting`, the counters the run wrote."""
    buffers = [(p, p.data) for p in params if p.data is not None]
    with tempfile.TemporaryDirectory() as tmp:
        lines = [
            f"grid {' '.join(map(str, grid))}",
            f"threadgroup {' '.join(map(str, threadgroup))}",
            f"reverse {int(reverse)}",
        ]
        for i, (p, data) in enumerate(buffers):
            if p.output:
                data = (
                    np.full_like(data, init_value)
                    if init_value is not None
                    else np.frombuffer(b"\xff" * data.nbytes, dtype=data.dtype).reshape(data.shape)
                )
            path = Path(tmp) / f"b{i}"
            path.write_bytes(np.ascontiguousarray(data).tobytes())
            lines.append(f"buffer {p.name} {data.nbytes} {data.itemsize} {int(p.output)} {path}")
        manifest = Path(tmp) / "manifest"
        manifest.write_text("\n".join(lines) + "\n")
        counters = Path(tmp) / "counters"
        proc = subprocess.run(
            [str(binary), str(manifest), *([str(counters)] if counting else [])], capture_output=True, text=True
        )
        if proc.returncode != 0:
            raise SimulatorError(proc.stderr.strip() or f"kernel process exited with {proc.returncode}")
        counted = (
            {k: int(v) for k, v in (line.split() for line in counters.read_text().splitlines())} if counting else {}
        )
        return [
            np.frombuffer((Path(tmp) / f"b{i}").read_bytes(), dtype=data.dtype).reshape(data.shape)
            for i, (p, data) in enumerate(buffers)
            if p.output
        ], counted
