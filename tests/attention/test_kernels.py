"""Every kernel variant through the CPU simulator, against the reference attention."""

import math

import mlx.core as mx
import numpy as np
import pytest
from helpers import mutant_kernels, packed_step, uncompilable_kernels

from mlxkv import reference_attention
from mlxkv.attention.kernels import (
    METAL_DIR,
    TOLERANCE,
    LaunchShape,
    PagedAttentionKernels,
    gpu_cores,
    launch_shape,
)
from mlxkv.attention.lab.simulator import SimulatorError, metal_kernel
from mlxkv.attention.variant import PLAIN, Variant

# Each dtype meets every head dim once, and every block size, GQA ratio and split-K
# setting at least once; every head dim meets both split settings.
VARIANTS = [
    (mx.float32, 64, 8, 1, False),
    (mx.float32, 80, 16, 4, True),
    (mx.float32, 96, 32, 8, False),
    (mx.float32, 128, 16, 8, True),
    (mx.float16, 64, 16, 4, True),
    (mx.float16, 80, 32, 8, False),
    (mx.float16, 96, 8, 1, True),
    (mx.float16, 128, 32, 1, False),
    (mx.bfloat16, 64, 32, 8, False),
    (mx.bfloat16, 80, 8, 1, True),
    (mx.bfloat16, 96, 16, 4, False),
    (mx.bfloat16, 128, 8, 4, True),
]


@pytest.fixture(scope="module")
def kernels():
    """The paged kernel for every row, long prefill chunks included (see test_prefill.py)."""
    return PagedAttentionKernels(metal_kernel, prefill_from=10**9)


def compare(kernels, cache, batch, q_heads, dtype, split, variant=PLAIN):
    head_dim = cache.kv(0)[0].shape[-1]
    q = mx.array(np.random.default_rng(1).standard_normal((batch.num_tokens, q_heads, head_dim)), dtype)
    scale = 1 / math.sqrt(head_dim)
    out = kernels(q, *cache.kv(0), batch, scale, variant, split=split)
    expected = reference_attention(q, *cache.kv(0), batch, scale, variant)
    diff = mx.abs(out.astype(mx.float32) - expected.astype(mx.float32)).max().item()
    assert diff <= TOLERANCE[dtype], diff


@pytest.mark.parametrize(
    "dtype, head_dim, page_size, group, split",
    VARIANTS,
    ids=[f"{str(v[0]).split('.')[-1]}-d{v[1]}-bs{v[2]}-g{v[3]}-{'split' if v[4] else 'direct'}" for v in VARIANTS],
)
def test_variant_matches_reference_on_ragged_packed_batches(kernels, dtype, head_dim, page_size, group, split):
    kv_heads = 1 if group == 8 else 2
    bs = page_size
    contexts = [1, bs, 2 * bs, 3 * bs + 5, bs + 3 + 6]
    query_lens = [1, 1, 1, 1, 6]  # decodes, and a prefill chunk that starts mid-page
    cache, batch = packed_step("paged", bs, kv_heads, head_dim, dtype, contexts, query_lens)
    compare(kernels, cache, batch, kv_heads * group, dtype, split)


# Quantized pages: every bits value, (head dim, group size) pair that divides, block size and
# GQA ratio, each through both paths on the same pages (dtypes taking turns); head_dim 96 puts
# a lane's three values across two packed words and two groups.
QUANTIZED_VARIANTS = [
    (bits, d, gs, bs, g)
    for bits in (8, 4)
    for d, gs in ((64, 32), (64, 64), (128, 32), (128, 64), (128, 128))
    for bs in (16, 32)
    for g in (1, 4)
] + [(8, 96, 32, 16, 4), (4, 96, 32, 32, 1)]
DTYPES = (mx.float32, mx.float16, mx.bfloat16)


@pytest.mark.parametrize(
    "variant", range(len(QUANTIZED_VARIANTS)), ids=["{}bit-d{}-gs{}-bs{}-g{}".format(*v) for v in QUANTIZED_VARIANTS]
)
def test_quantized_variant_matches_reference_on_the_same_pages(kernels, variant):
    bits, head_dim, group_size, bs, group = QUANTIZED_VARIANTS[variant]
    dtype, kv_heads = DTYPES[variant % 3], 2
    contexts, query_lens = [1, bs, 2 * bs + 1, 3 * bs + 5, bs + 9], [1, 1, 1, 1, 6]
    cache, batch = packed_step(
        "paged", bs, kv_heads, head_dim, dtype, contexts, query_lens, kv_bits=bits, kv_group_size=group_size
    )
    assert (cache.kv(0)[0].bits, cache.kv(0)[1].group_size) == (bits, group_size)
    for split in (False, True):
        compare(kernels, cache, batch, kv_heads * group, dtype, split)


ATTENTION_VARIANTS = {
    "window": Variant(window=20),
    "softcap": Variant(softcap=1.5),
    "sinks": Variant(sinks=mx.arange(8) * 0.7 - 2.0),
    "window-softcap-sinks": Variant(window=300, softcap=30.0, sinks=mx.arange(8) * 0.5 - 1.0),
    "chunk": Variant(chunk=32),
    "chunk-sinks": Variant(chunk=256, sinks=mx.arange(8) * 0.5 - 1.0),
}


@pytest.mark.parametrize("split", [False, True], ids=["direct", "split"])
@pytest.mark.parametrize("name", list(ATTENTION_VARIANTS))
def test_window_chunk_softcap_and_sink_variants_match_the_reference(kernels, name, split):
    """Contexts around the window or chunk and across split-K partitions; GQA 4 over 2 KV heads."""
    cache, batch = packed_step(
        "paged", 16, 2, 64, mx.float32, [5, 21, 40, 300, 610, 35], [1, 1, 1, 1, 1, 12], max_model_len=640
    )
    compare(kernels, cache, batch, 8, mx.float32, split, ATTENTION_VARIANTS[name])


def test_a_quantized_kernel_that_swaps_scales_and_biases_is_caught(kernels):
    mutant = PagedAttentionKernels(mutant_kernels("k_pages, k_scales, k_biases", "k_pages, k_biases, k_scales"))
    cache, batch = packed_step("paged", 16, 2, 64, mx.float32, [40, 7], [1, 3], kv_bits=8)
    compare(kernels, cache, batch, 4, mx.float32, False)
    with pytest.raises(AssertionError):
        compare(mutant, cache, batch, 4, mx.float32, False)


@pytest.mark.parametrize("split", [False, True])
def test_contiguous_layout_runs_through_the_same_kernels(kernels, split):
    cache, batch = packed_step("contiguous", 16, 2, 64, mx.float32, [1, 33, 70], [1, 5, 1])
    assert batch.page_tables.shape[1] == 1
    compare(kernels, cache, batch, 4, mx.float32, split)


@pytest.mark.parametrize(
    "cores, context, partitions",
    [(8, 1100, 5), (8, 512, 2), (8, 256, None), (38, 4096, 16), (1, 1100, None)],
)
def test_split_k_into_partitions_that_give_every_core_threadgroups(cores, context, partitions, monkeypatch):
    """Two sequences of 2 KV heads make 4 threadgroups: too few for 8 cores (32 wanted, 8 a
    row: partitions of the 256-key floor at 1,100 and 512 keys, none at 256), enough for one.
    38 cores want 152: 4,096 keys in 16 partitions of 256 rather than 8 of 512."""
    kernels = PagedAttentionKernels(metal_kernel, cores=cores)
    calls = []
    monkeypatch.setitem(kernels.partitioned, False, lambda **kw: calls.append(kw) or (None, None))
    monkeypatch.setattr(kernels, "reduce", lambda **kw: [mx.zeros(kw["output_shapes"][0])])
    monkeypatch.setitem(kernels.direct, False, lambda **kw: [mx.zeros(kw["output_shapes"][0])])
    cache, batch = packed_step("paged", 16, 2, 64, mx.float32, [9, 9], [1, 1])
    long_batch = type(batch)(
        batch.seq_ids, batch.query_lens, np.array([context, 9], np.int32), batch.page_tables, batch.page_size
    )
    kernels(mx.zeros((2, 2, 64)), *cache.kv(0), long_batch)
    assert [call["grid"][2] // 2 for call in calls] == ([] if partitions is None else [partitions])


@pytest.mark.parametrize("kv_bits", [None, 8, 4])
def test_warm_up_checks_both_paths_against_the_reference(kernels, monkeypatch, kv_bits):
    launched = []
    for name, quantized in (("direct", kv_bits is not None), ("partitioned", kv_bits is not None)):
        original = getattr(kernels, name)[quantized]
        monkeypatch.setitem(
            getattr(kernels, name), quantized, lambda _f=original, _n=name, **kw: launched.append(_n) or _f(**kw)
        )
    monkeypatch.setattr(kernels, "reduce", lambda _f=kernels.reduce, **kw: launched.append("reduce") or _f(**kw))
    assert kernels.warm(mx.float16, 64, 16, 4, 2, kv_bits, 32) is None
    assert launched == ["direct", "partitioned", "reduce"]


def test_warm_up_reports_a_kernel_that_does_not_compile():
    problem = PagedAttentionKernels(uncompilable_kernels).warm(mx.float32, 64, 16, 4, 2)
    assert problem == (
        "paged_attention failed to compile or run: [metal::Device] Unable to build metal library from source"
    )


@pytest.mark.parametrize(
    "old, new, kernel",
    [
        ("static_cast<T>(acc / sum)", "static_cast<T>(acc / sum + 0.01f)", "paged_attention"),
        ("part * PARTITION + PARTITION", "part * PARTITION + PARTITION - 1", "paged_attention_partitioned + _reduce"),
    ],
)
def test_warm_up_reports_a_kernel_with_wrong_numbers(old, new, kernel):
    problem = PagedAttentionKernels(mutant_kernels(old, new)).warm(mx.float32, 64, 16, 4, 2)
    assert problem.startswith(f"{kernel} differs from the reference attention by up to ")
    assert problem.endswith("(tolerance 1e-05)")


@pytest.mark.parametrize("split", [False, True], ids=["direct", "split"])
@pytest.mark.parametrize("entries", [1, 7, 8, 9])
def test_block_tables_of_any_size_in_either_address_space(kernels, entries, split):
    """MLX passes an input of fewer than 8 elements in `constant`, a larger one in `device`:
    page tables of 1, 7, 8 and 9 entries, from one paged sequence and from contiguous rows."""
    cache, batch = packed_step("paged", 8, 2, 64, mx.float32, [8 * entries], [1], max_model_len=8 * entries)
    assert batch.page_tables.size == entries
    compare(kernels, cache, batch, 4, mx.float32, split)
    cache, batch = packed_step("contiguous", 8, 2, 64, mx.float32, list(range(3, 3 + entries)), [1] * entries)
    assert batch.page_tables.size == entries
    compare(kernels, cache, batch, 4, mx.float32, split)


@pytest.mark.parametrize(
    "head_dim, group, shape, simdgroups, memory",
    [
        (128, 8, (4, 8, 2), 4, 4160),  # GQA 8 at 128: two head sets of 4, two key splits, 4 KiB to merge
        (128, 4, (4, 8, 4), 4, 6240),
        (128, 1, (1, 16, 4), 4, 1560),  # tiles of a whole 16-key page
        (64, 8, (8, 4, 4), 4, 6336),  # 8 heads fit a SIMD group's registers at head_dim 64
        (256, 8, (2, 16, 1), 4, 8),  # ... 2 at 256; no key split, nothing to merge
        (128, 16, (4, 8, 1), 4, 8),
        (256, 16, (2, 16, 1), 8, 8),
        (96, 7, (4, 8, 2), 4, 3136),  # GQA 7: two head sets of 4, the last padded with one head
        (128, 5, (3, 8, 2), 4, 3120),  # GQA 5 (Qwen2.5 14B, 32B): 3 + 2 and a padding head
        (256, 32, (2, 16, 1), 8, 8),  # 16 head sets: 8 per threadgroup (256 threads), two threadgroups
    ],
)
def test_launch_shape_spreads_heads_over_simd_groups_and_merges_in_little_memory(
    head_dim, group, shape, simdgroups, memory
):
    launch = launch_shape(group, head_dim, 16)
    assert (launch.heads_per_simdgroup, launch.keys_per_tile, launch.splits) == shape
    assert (launch.simdgroups, launch.threadgroup_memory) == (simdgroups, memory)


@pytest.mark.parametrize("split", [False, True], ids=["direct", "split"])
@pytest.mark.parametrize("group", [5, 6, 7])  # Qwen2.5 14B and 32B; 7B
def test_head_sets_padded_for_groups_of_5_6_and_7_match_the_reference(kernels, group, split):
    cache, batch = packed_step("paged", 16, 2, 128, mx.float16, [300, 9], [1, 4], max_model_len=512)
    compare(kernels, cache, batch, 2 * group, mx.float16, split)


@pytest.mark.parametrize("head_dim, group, heads", [(256, 32, 16), (128, 64, 32), (128, 8, 8), (64, 40, 40)])
def test_no_threadgroup_passes_256_threads(head_dim, group, heads):
    launch = launch_shape(group, head_dim, 16)
    assert launch.heads == heads and group % launch.heads == 0
    assert 32 * launch.simdgroups <= 256


@pytest.mark.parametrize("split", [False, True], ids=["direct", "split"])
@pytest.mark.parametrize("head_dim, group", [(256, 8), (128, 16), (256, 32)])  # GLM-4-9B, Qwen3-235B, 256 threads
def test_large_head_groups_run_within_threadgroup_memory(kernels, head_dim, group, split):
    cache, batch = packed_step("paged", 16, 1, head_dim, mx.float16, [40, 7], [1, 3])
    compare(kernels, cache, batch, group, mx.float16, split)


def test_the_simulator_refuses_a_launch_over_32_kib_naming_the_arrays(kernels, monkeypatch):
    monkeypatch.setattr("mlxkv.attention.kernels.launch_shape", lambda *_: LaunchShape(8, 2, 16, 5, 256))
    cache, batch = packed_step("paged", 16, 1, 256, mx.float16, [5], [1])
    with pytest.raises(
        SimulatorError,
        match=r"launch refused: the kernel declares 33024 bytes of threadgroup memory, "
        r"more than the 32768 an Apple GPU allows a threadgroup: tg_ml \(256 B\), "
        r"tg_acc \(32768 B\)",
    ):
        compare(kernels, cache, batch, 8, mx.float16, False)


def test_page_offsets_are_64_bit():
    """One layer's float16 K pages of 4 GiB hold more than 2^31 elements."""
    kernel = metal_kernel(
        "page_row",
        ["pages"],
        ["out"],
        header=(METAL_DIR / "paged_attention.h").read_text(),
        source="uint i = thread_position_in_grid.x;\nout[i] = page_row<16>(pages[i], 8, 7);",
    )
    pages = np.array([0, 1, 2**20, 2**31 - 1], np.int32)
    out = kernel(
        inputs=[mx.array(pages)], output_shapes=[(4,)], output_dtypes=[mx.int64], grid=(4, 1, 1), threadgroup=(4, 1, 1)
    )[0]
    assert np.array(out).tolist() == ((pages.astype(np.int64) * 8 + 7) * 16).tolist()


# Around and across split-K partition boundaries (256 keys when a split is forced), in one batch: decode rows, and a
# 20-token prefill chunk over keys 500..519 that straddles the first boundary.
CONTEXTS, QUERY_LENS = [511, 512, 513, 1024, 1025, 2900, 520], [1, 1, 1, 1, 1, 1, 20]


@pytest.mark.parametrize("split", [False, True], ids=["direct", "split"])
def test_contexts_over_many_split_k_partitions(kernels, split):
    cache, batch = packed_step("paged", 16, 1, 64, mx.float32, CONTEXTS, QUERY_LENS, max_model_len=2912)
    compare(kernels, cache, batch, 2, mx.float32, split)


def test_a_kernel_that_drops_each_partitions_last_key_is_caught():
    assert "part * PARTITION + PARTITION" in (METAL_DIR / "paged_attention_partitioned.metal").read_text()
    mutant = PagedAttentionKernels(mutant_kernels("part * PARTITION + PARTITION", "part * PARTITION + PARTITION - 1"))
    cache, batch = packed_step("paged", 16, 1, 64, mx.float32, CONTEXTS, QUERY_LENS, max_model_len=2912)
    with pytest.raises(AssertionError):
        compare(mutant, cache, batch, 2, mx.float32, True)


def test_warm_up_checks_each_attention_variant_the_model_uses():
    sinks = Variant(sinks=mx.arange(4) * 1.0)
    mutant = PagedAttentionKernels(mutant_kernels("add_sink<SINKS>", "add_sink<false>"))
    assert mutant.warm(mx.float32, 64, 16, 4, 2) is None  # plain attention never adds a sink
    problem = mutant.warm(mx.float32, 64, 16, 4, 2, variants=[PLAIN, Variant(window=64), sinks])
    assert problem.startswith("paged_attention differs from the reference attention by up to ")


@pytest.mark.parametrize("split", [False, True], ids=["direct", "split"])
def test_decode_at_gqa_8_head_dim_128_meets_the_cost_goals(kernels, split):
    """Counted in the simulator, one float16 decode row over 2,048 keys: K/V come from device
    memory about once, by vector loads, with no 32-lane reductions and 4 KiB of threadgroup memory.
    Split, 8 partitions of 256 keys (one threadgroup wants 32 on 8 cores) hand the merge
    8 x 8 heads x 130 floats, written once and read once: 3% of the K/V bytes each way."""
    from mlxkv.attention.lab.simulator import cost_counters

    cache, batch = packed_step("paged", 16, 1, 128, mx.float16, [2048], [1], max_model_len=2048)
    q = mx.array(np.random.default_rng(1).standard_normal((1, 8, 128)), mx.float16)
    with cost_counters() as launches:
        kernels(q, *cache.kv(0), batch, None, split=split)
    kv_bytes = 2 * 2048 * 128 * 2
    attention = launches[0]
    assert [c.name for c in launches] == (
        ["mlxkv_paged_attention_partitioned", "mlxkv_paged_attention_reduce"] if split else ["mlxkv_paged_attention"]
    )
    assert (attention.threads, attention.threadgroup_memory) == (128, 4160)
    assert attention.read_bytes / kv_bytes <= 1.02
    partials = 8 * 8 * 130 * 4 if split else 0
    assert sum(c.read_bytes + c.written_bytes for c in launches) <= 1.02 * kv_bytes + 2 * partials + 8 * 128 * 2
    assert attention.vector_load_bytes / attention.load_bytes >= 0.9
    assert sum(c.reductions for c in launches) == 0
    assert attention.shuffles / 2048 < 18 and attention.transcendentals / 2048 <= 24  # 24: 8 partitions merged


@pytest.mark.parametrize("split", [False, True], ids=["direct", "split"])
def test_a_tile_loads_all_its_rows_whatever_the_mask(kernels, split):
    """Loads sit before any branch on the key: 2,041 keys load as many K/V rows as 2,048 (the last
    tile's 7 keys past the end read a row of the sequence instead, their scores masked)."""
    from mlxkv.attention.lab.simulator import cost_counters

    q = mx.array(np.random.default_rng(1).standard_normal((1, 8, 128)), mx.float16)
    vector_loads = []
    for context in (2048, 2041):
        cache, batch = packed_step("paged", 16, 1, 128, mx.float16, [context], [1], max_model_len=2048)
        with cost_counters() as launches:
            kernels(q, *cache.kv(0), batch, None, split=split)
        vector_loads.append(launches[0].vector_loads)
    assert vector_loads[0] == vector_loads[1]


@pytest.mark.parametrize(
    "dtype, head_dim, group, kv_bits, prefill",
    [
        (mx.float16, 128, 8, None, False),
        (mx.bfloat16, 96, 5, None, False),
        (mx.float32, 64, 1, None, True),
        (mx.float16, 128, 4, 4, False),
        (mx.bfloat16, 64, 2, 8, True),
    ],
)
def test_kernels_keep_every_private_array_in_registers(kernels, dtype, head_dim, group, kv_bits, prefill):
    """Every fixed-count loop is unrolled and indexes its arrays by constants, so nothing a lane
    holds (query parts, tile rows, the reduce-scatter's entries) is spilled to memory; split and
    unsplit, decode and a prefill chunk."""
    from mlxkv.attention.lab.simulator import cost_counters

    cache, batch = packed_step(
        "paged", 16, 1, head_dim, dtype, [300], [4 if prefill else 1], max_model_len=512, kv_bits=kv_bits
    )
    q = mx.array(np.random.default_rng(1).standard_normal((4 if prefill else 1, group, head_dim)), dtype)
    for split in (False, True):
        with cost_counters() as launches:
            kernels(q, *cache.kv(0), batch, None, split=split)
        assert [(c.name, c.dynamic_arrays) for c in launches] == [(c.name, ()) for c in launches]


def test_every_layer_of_a_step_passes_the_same_input_arrays(kernels, monkeypatch):
    """Page tables, positions and the scalar settings are made once per step, not per layer."""
    cache, batch = packed_step("paged", 16, 2, 64, mx.float32, [40, 70], [1, 1], max_model_len=128)
    q = mx.array(np.random.default_rng(1).standard_normal((2, 4, 64)), mx.float32)
    passed = []
    direct = kernels.direct[False]
    monkeypatch.setitem(
        kernels.direct, False, lambda inputs, **launch: passed.append(inputs) or direct(inputs=inputs, **launch)
    )
    for _layer in range(2):
        kernels(q, *cache.kv(0), batch, 0.125, split=False)
    first, second = passed
    assert len(first) == len(second) == 10
    assert all(a is b for a, b in zip(first[3:], second[3:]))  # all but the queries and K/V pages


def test_each_simd_group_loads_a_page_table_entry_once_per_page(kernels):
    """2,048 keys at GQA 8, head_dim 128: four SIMD groups of 32 lanes, two key splits taking
    alternate tiles of 8 keys. Pages of 16 give each SIMD group one tile of each of 128 pages,
    pages of 64 four tiles of each of 32 pages: 96 fewer table loads per lane, K/V loads equal."""
    from mlxkv.attention.lab.simulator import cost_counters

    q = mx.array(np.random.default_rng(1).standard_normal((1, 8, 128)), mx.float16)
    loads = {}
    for page_size in (16, 64):
        cache, batch = packed_step("paged", page_size, 1, 128, mx.float16, [2048], [1], max_model_len=2048)
        with cost_counters() as launches:
            kernels(q, *cache.kv(0), batch, None, split=False)
        loads[page_size] = (launches[0].loads, launches[0].vector_loads)
    assert loads[16][1] == loads[64][1]
    assert loads[16][0] - loads[64][0] == (128 - 32) * 128


@pytest.mark.parametrize(
    "architecture, cores", [("applegpu_g14c", 24), ("applegpu_g13g", 8), ("applegpu_g15d", 48), ("something_else", 8)]
)
def test_gpu_cores_come_from_the_architectures_class(architecture, cores, monkeypatch):
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    info = {mx.gpu: {"architecture": architecture}, None: {"device_name": "the CPU"}}
    monkeypatch.setattr(mx, "device_info", lambda device=None: info[device], raising=False)
    assert gpu_cores() == cores  # the GPU's info, not the default device's (the CPU's after set_default_device)
