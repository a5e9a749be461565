import math
import os
import time

import mlx.core as mx
import numpy as np
import pytest
from helpers import packed_step

from mlxkv.attention.kernels import PagedAttentionKernels
from mlxkv.attention.lab.simulator import SimulatorError, metal_kernel


def run(source, n=64, threads=64, header=""):
    kernel = metal_kernel("probe", ["a"], ["out"], source, header=header)
    a = mx.arange(n, dtype=mx.float32)
    return kernel(
        inputs=[a], output_shapes=[(n,)], output_dtypes=[mx.float32], grid=(n, 1, 1), threadgroup=(threads, 1, 1)
    )[0]


def test_barrier_simd_and_threadgroup_memory_work():
    out = run("""
        uint i = thread_position_in_grid.x;
        threadgroup float tile[64];
        tile[thread_index_in_threadgroup] = a[i];
        threadgroup_barrier(mem_flags::mem_threadgroup);
        float neighbour = tile[(thread_index_in_threadgroup + 1) % 64];
        out[i] = simd_sum(a[i]) + neighbour;
    """)
    a = np.arange(64.0)
    expected = np.repeat([a[:32].sum(), a[32:].sum()], 32) + np.roll(a, -1)
    assert np.array(out).tolist() == expected.tolist()


def test_fast_functions_give_nan_outside_finite_inputs_and_precise_ones_do_not():
    # Metal defines fast:: for finite inputs only; the simulator returns the worst it could.
    source = """
        uint i = thread_position_in_grid.x;
        const float x[4] = {-INFINITY, INFINITY, NAN, -1.0f};
        out[i] = i < 4 ? metal::fast::exp2(x[i]) : metal::precise::exp2(x[i - 4]) + a[0];
    """
    out = run(source, n=8, threads=8)
    got = np.array(out).tolist()
    assert [math.isnan(v) for v in got[:3]] == [True, True, True]
    assert got[3] == 0.5
    assert got[4:6] == [0.0, math.inf] and math.isnan(got[6]) and got[7] == 0.5


def test_out_of_bounds_read_names_the_buffer():
    with pytest.raises(
        SimulatorError,
        match=r"out-of-bounds access to buffer 'a': element 64 of 64, by thread "
        r"\(63,0,0\) of threadgroup \(0,0,0\)",
    ):
        run("uint i = thread_position_in_grid.x;\nout[i] = a[i + 1];")


def test_missing_barrier_is_reported_as_a_race():
    with pytest.raises(SimulatorError, match="output 'out' depends on the order threads run in"):
        run("""
            threadgroup float tile[64];
            tile[thread_index_in_threadgroup] = a[thread_position_in_grid.x];
            out[thread_position_in_grid.x] = tile[63 - thread_index_in_threadgroup];
        """)


def test_barrier_in_a_divergent_branch_names_the_line():
    with pytest.raises(SimulatorError, match=r"barrier at body line 3 reached by 16 of 64 threads"):
        run("""uint t = thread_index_in_threadgroup;
            if (t < 16) {
                threadgroup_barrier(mem_flags::mem_threadgroup);
            }
            out[thread_position_in_grid.x] = a[thread_position_in_grid.x];
        """)


def test_simd_functions_at_different_places_in_one_simd_group_are_reported():
    with pytest.raises(
        SimulatorError,
        match=r"SIMD-group operation in divergent control flow: .* is at body "
        r"line 2 but .* is at body line 4",
    ):
        run("""if (thread_index_in_simdgroup < 5) {
                out[thread_position_in_grid.x] = simd_sum(a[thread_position_in_grid.x]);
            } else {
                out[thread_position_in_grid.x] = simd_max(a[thread_position_in_grid.x]);
            }
        """)


def test_lanes_that_returned_sit_out_simd_functions():
    out = run("""if (thread_index_in_simdgroup >= 5) { out[thread_position_in_grid.x] = 0; return; }
                 out[thread_position_in_grid.x] = simd_sum(a[thread_position_in_grid.x]);""")
    assert np.array(out)[:5].tolist() == [10.0] * 5


def test_compile_errors_point_into_the_body():
    with pytest.raises(SimulatorError, match=r"body:2"):
        run("uint i = thread_position_in_grid.x;\nout[i] = undefined_name;")


def signature_lines(text: str, marker: str) -> list[list[str]]:
    """Each signature's parameter lines, from MLX's generated source or the simulator's print."""
    out = []
    for block in text.split(marker)[1:]:
        lines = []
        for line in block.splitlines()[1:]:
            line = line.strip()
            if not line or line.startswith(("{", "}")):
                break
            lines.append(line.rstrip(",").removesuffix(") {"))
            if line.endswith("{"):
                break
        out.append(lines)
    return out


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_mlx_generates_the_signature_the_simulator_compiled(capfd, tmp_path, dtype):
    cache, batch = packed_step("paged", 16, 2, 64, dtype, [3, 40], [1, 2])
    q = mx.zeros((batch.num_tokens, 8, 64), dtype)
    k, v = cache.kv(0)
    scale = 1 / math.sqrt(64)

    def launch_all(kernels, q, k, v):
        return [kernels(q, k, v, batch, scale, split=False), kernels(q, k, v, batch, scale, split=True)]

    launch_all(PagedAttentionKernels(metal_kernel, verbose=True), q, k, v)
    simulated = signature_lines(capfd.readouterr().out, "Simulated signature of")
    mlx_kernels = PagedAttentionKernels(verbose=True)
    mx.export_function(str(tmp_path / "traced.mlxfn"), lambda *a: launch_all(mlx_kernels, *a), q, k, v)
    generated = signature_lines(capfd.readouterr().out.replace("[[kernel]] void", "\nGenerated\n"), "\nGenerated\n")
    assert len(simulated) == len(generated) == 3
    assert [len(lines) for lines in simulated] == [18, 19, 8]
    assert simulated == generated


def run_helper(header, body, n):
    """`body` over an n-element input `a` (MLX passes it in `constant` below 8 elements)."""
    kernel = metal_kernel("probe", ["a"], ["out"], body, header=header)
    return kernel(
        inputs=[mx.arange(n, dtype=mx.int32)],
        output_shapes=[(4,)],
        output_dtypes=[mx.int32],
        grid=(4, 1, 1),
        threadgroup=(4, 1, 1),
    )[0]


DEVICE_HELPER = "int first(const device int* table, int i) { return table[i % 1]; }\n"
TEMPLATED_HELPER = "template <typename Table>\nint first(Table table, int i) { return table[i % 1]; }\n"
CALL = "out[thread_position_in_grid.x] = first(a, int(thread_position_in_grid.x));"


def test_a_constant_input_passed_to_a_device_parameter_fails_naming_the_parameter():
    assert np.array(run_helper(DEVICE_HELPER, CALL, 8)).tolist() == [0] * 4
    with pytest.raises(SimulatorError) as error:
        run_helper(DEVICE_HELPER, CALL, 1)
    assert (
        "argument 1 is a constant pointer, but parameter `const device int* table` (header line 1) takes a "
        "device one; Metal converts neither way"
    ) in str(error.value)
    assert (
        "MLX passes inputs of fewer than 8 elements in the constant address space, as it does a in this call: "
        "template the helper on the pointer type"
    ) in str(error.value)


@pytest.mark.parametrize("n", [1, 7, 8, 9])
def test_a_helper_templated_on_the_pointer_type_takes_either_space(n):
    assert np.array(run_helper(TEMPLATED_HELPER, CALL, n)).tolist() == [0] * 4


@pytest.mark.parametrize(
    "header, body, message",
    [
        (
            "",
            "device int* p = a;",
            "cannot initialize a variable of type 'device int *' with an lvalue of type 'device int32_t const *'",
        ),
        (
            "",
            "const constant int* p = a;",
            "cannot initialize a variable of type 'constant int const *' with an "
            "lvalue of type 'device int32_t const *'",
        ),
        (
            "",
            "threadgroup int t[4];\ndevice int* p = t;",
            "cannot initialize a variable of type 'device int *' with an lvalue of type 'threadgroup int[4]'",
        ),
        (
            "int get(threadgroup int* p) { return p[0]; }\n",
            "out[0] = get(out);",
            "argument 1 is a device pointer, but parameter `threadgroup int* p` (header line 1) takes a "
            "threadgroup one",
        ),
        (
            "int get(thread int* p) { return p[0]; }\n",
            "out[0] = get(out);",
            "argument 1 is a device pointer, but parameter `thread int* p` (header line 1) takes a thread one",
        ),
        (
            "int get(const device int* p) { return p[0]; }\n",
            "threadgroup int t[4];\nt[0] = 1;\nout[0] = get(t);",
            "no known conversion from 'threadgroup int[4]' to 'device int const *'",
        ),
    ],
)
def test_address_spaces_are_distinct_pointer_types(header, body, message):
    with pytest.raises(SimulatorError, match="does not compile as Metal") as error:
        run_helper(header, body, 8)
    assert message in str(error.value)


@pytest.mark.parametrize(
    "body, message",
    [
        ("if constexpr (true) { out[0] = 1; }", "constexpr if is a C++17 extension"),
        (
            "struct P { int x; int y; };\nauto [x, y] = P{1, 2};\nout[0] = x + y;",
            "declarations are a C++17 extension",
        ),  # clang 17-19: decomposition, 22: structured binding
        ("if (int x = a[0]; x > 0) { out[0] = x; }", "'if' initialization statements are a C++17 extension"),
        ("int n = a[0];\nint v[n];\nv[0] = 1;\nout[0] = v[0];", "variable length arrays in C++ are a Clang extension"),
        (
            "auto twice = [](int x) { return 2 * x; };\nout[0] = twice(a[0]);",
            "body:1: a lambda expression is not part of Metal's language",
        ),
        ("int* p = new int(1);\nout[0] = *p;", "body:1: 'new' is not part of Metal's language"),
    ],
)
def test_code_newer_than_metals_cpp14_or_not_pedantic_is_rejected(body, message):
    with pytest.raises(SimulatorError, match="does not compile as Metal") as error:
        run_helper("", body, 8)
    assert message in str(error.value)


def test_checkouts_sharing_one_cache_build_kernels_wherever_and_whenever_cloned(tmp_path, monkeypatch):
    """CI clones afresh into the same path, or another, and shares ~/.cache with a developer's
    checkout: a runtime precompiled for one clone must not be included beside another's copy, nor
    refused because the clone's file is newer."""
    from mlxkv.attention.lab import build

    monkeypatch.setattr(build, "CACHE", tmp_path / "cache")
    for n, checkout in enumerate(("one", "two", "one")):
        runtime = tmp_path / checkout / "runtime.h"
        runtime.parent.mkdir(exist_ok=True)
        runtime.write_text(build.RUNTIME.read_text())  # a fresh clone: same text, new mtime
        monkeypatch.setattr(build, "RUNTIME", runtime)
        assert run(f"out[thread_position_in_grid.x] = a[thread_position_in_grid.x] + {n};").tolist() == list(
            range(n, 64 + n)
        )


def test_a_reinstalled_compiler_header_rebuilds_the_precompiled_runtime(tmp_path, monkeypatch):
    """A fresh virtual environment reinstalls the compiler, so every standard header it ships gets a
    new modification time under the same path, and clang refuses a precompiled header whose inputs
    changed: the cache must build a new one, and keep only that one."""
    from mlxkv.attention.lab import build

    monkeypatch.setattr(build, "CACHE", tmp_path / "cache")
    header = tmp_path / "include" / "standard.h"  # stands for a header of the compiler's
    header.parent.mkdir()
    header.write_text("#pragma once\nconstexpr int standard = 0;\n")  # clang checks a header when a unit uses it
    runtime = tmp_path / "runtime.h"
    runtime.write_text(build.RUNTIME.read_text() + f'\n#include "{header}"\n')
    monkeypatch.setattr(build, "RUNTIME", runtime)
    for n, hours in enumerate((0, 1, 2)):
        stamp = header.stat().st_mtime + 3600 * hours
        os.utime(header, (stamp, stamp))  # the same text, installed again later
        assert run(f"out[thread_position_in_grid.x] = a[thread_position_in_grid.x] + {n} + standard;").tolist() == list(
            range(n, 64 + n)
        )
    assert len(list((tmp_path / "cache").glob("runtime-*.pch"))) == 2  # one for checking, one for building


def test_cost_counters_count_what_a_launch_does():
    """Two threadgroups of 32 threads over 64 floats: each thread loads its float4 (a vector
    load) and its own float (a scalar one, from the same bytes), sums across the SIMD group,
    shuffles, takes one exp and meets one barrier."""
    from mlxkv.attention.lab.simulator import cost_counters

    kernel = metal_kernel(
        "probe",
        ["a"],
        ["out"],
        """
        threadgroup float shared[32];
        uint i = thread_position_in_grid.x;
        const float4 v = *(const device float4*)(a + 4 * (i / 4));
        float s = simd_sum(v[i % 4]) + a[i];
        shared[thread_index_in_threadgroup] = simd_shuffle_xor(s, 1);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        out[i] = metal::exp(shared[thread_index_in_threadgroup ^ 1]);""",
    )
    with cost_counters() as launches:
        kernel(
            inputs=[mx.arange(64, dtype=mx.float32) / 64],
            output_shapes=[(64,)],
            output_dtypes=[mx.float32],
            grid=(64, 1, 1),
            threadgroup=(32, 1, 1),
        )
    [c] = launches
    assert (c.read_bytes, c.written_bytes) == (256, 256)  # each byte once per threadgroup
    assert (c.loads, c.load_bytes, c.vector_loads, c.vector_load_bytes) == (128, 1280, 64, 1024)
    assert (c.stores, c.store_bytes) == (64, 256)
    assert (c.reductions, c.shuffles, c.transcendentals, c.barriers) == (2, 2, 64, 2)
    assert (c.threadgroups, c.threadgroup_memory, c.threads) == (2, 128, 32)


def launch_32(kernel) -> None:
    """One launch of `kernel` on 32 threads, its one input 0..31."""
    kernel(
        inputs=[mx.arange(32, dtype=mx.float32)],
        output_shapes=[(32,)],
        output_dtypes=[mx.float32],
        grid=(32, 1, 1),
        threadgroup=(32, 1, 1),
    )


@pytest.mark.parametrize(
    "pick, in_memory",
    [
        ("a[(i + thread_position_in_grid.x) % 8]", ["a at body:2"]),  # an index known at run time
        ("a[0]", []),
        ("(upper ? a[i + 4] : a[i])", ["a at body:2"]),  # one load at a chosen address
        ("(upper ? hi : lo)", []),  # two loads, then a choice of values
    ],
)
def test_cost_counters_name_private_arrays_indexed_at_run_time(pick, in_memory):
    """An array indexed by constants after unrolling stays in registers; one indexed at run time
    (or through `c ? a[i] : a[j]`) would live in memory on the GPU, and the counters name it."""
    from mlxkv.attention.lab.simulator import cost_counters

    kernel = metal_kernel(
        "probe",
        ["x"],
        ["out"],
        f"""
        float a[8];
        for (int i = 0; i < 8; i++) {{
          a[i] = x[(thread_position_in_grid.x + i) % 32] * x[i];
        }}
        const bool upper = (thread_position_in_grid.x & 1) != 0;
        float total = 0.0f;
        MLXKV_UNROLL
        for (int i = 0; i < 4; i++) {{
          const float lo = a[i];
          const float hi = a[i + 4];
          total += {pick};
        }}
        out[thread_position_in_grid.x] = total;""",
        header='#define MLXKV_UNROLL _Pragma("clang loop unroll(full)")',
    )
    with cost_counters() as launches:
        launch_32(kernel)
    assert list(launches[0].dynamic_arrays) == in_memory


def test_cost_counters_without_arrays_skip_the_optimised_build(monkeypatch):
    """A cost model that does not read `dynamic_arrays` need not pay for the build that finds them."""
    from mlxkv.attention.lab import simulator
    from mlxkv.attention.lab.simulator import cost_counters

    def never(unit: str) -> tuple[str, ...]:
        raise AssertionError("built optimised")

    monkeypatch.setattr(simulator, "dynamic_arrays", never)
    kernel = metal_kernel("probe", ["a"], ["out"], "out[thread_position_in_grid.x] = 2 * a[thread_position_in_grid.x];")
    with cost_counters(arrays=False) as launches:
        launch_32(kernel)
    assert launches[0].loads == 32 and launches[0].dynamic_arrays == ()


def test_metal_vectors_convert_and_index_as_metal_does():
    out = run(
        """
        const half4 h = half4(1.5f, 2.0f, -3.0f, 4.0f);
        const float4 f = float4(h);
        out[thread_position_in_grid.x] = f[thread_position_in_grid.x % 4] + as_type<float>(0x3f800000u);""",
        n=8,
        threads=8,
    )
    assert out.tolist() == [2.5, 3.0, -2.0, 5.0] * 2


def test_the_cache_drops_the_kernels_unused_longest_once_it_outgrows_its_limit(tmp_path, monkeypatch):
    """Four built kernels of 1 MB against a limit of 2.5 MB: those unused for over an hour go, oldest
    first, until three quarters of the limit is left; the one used just now and other files stay."""
    from mlxkv.attention.lab import build

    monkeypatch.setattr(build, "CACHE", tmp_path)
    monkeypatch.setattr(build, "CACHE_LIMIT", 2_500_000)
    now = time.time()
    for name, hours in (("a", 3), ("b", 2), ("c", 1.5), ("d", 0), ("runtime.pch", 5)):
        (tmp_path / name).write_bytes(bytes(1_000_000))
        os.utime(tmp_path / name, (now - 3600 * hours, now - 3600 * hours))
    build._trim_cache.__wrapped__()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "runtime.pch"]
