import mlx.core as mx
import numpy as np
import pytest

from mlxkv.attention.kernels import PagedAttentionKernels, launch_shape
from mlxkv.attention.lab.cost_model import (
    M5_PRO,
    calibration_points,
    estimate,
    fit_latency,
    paged_tile_events,
    paged_work,
    vector_sdpa,
    vector_sdpa_kernel,
)
from mlxkv.attention.lab.simulator import cost_counters, metal_kernel
from mlxkv.cache.batch import KVBatch


@pytest.mark.parametrize("group, head_dim", [(1, 128), (4, 64), (8, 128)])
def test_the_calibration_kernel_computes_attention(group, head_dim):
    """MLX's vector SDPA structure in the project's words, blocks merged: what SDPA gives."""
    rng = np.random.default_rng(0)
    k, v = (mx.array(rng.standard_normal((2, 300, head_dim)), mx.float16) for _ in range(2))
    q = mx.array(rng.standard_normal((2 * group, head_dim)), mx.float16)
    out = vector_sdpa(vector_sdpa_kernel(), q, k, v, blocks=8).astype(mx.float32)
    expected = mx.fast.scaled_dot_product_attention(q[None, :, None], k[None], v[None], scale=head_dim**-0.5)
    assert mx.abs(out - expected.reshape(out.shape).astype(mx.float32)).max().item() < 2e-3


@pytest.mark.parametrize("group, head_dim", [(1, 128), (4, 128), (8, 128), (8, 64), (5, 128)])
def test_the_tally_of_a_tile_is_what_the_kernel_issues(group, head_dim):
    """The model's per-tile loads and shuffles are the simulator's counts: 256 more keys
    (one unsplit threadgroup) add exactly 256 / keys-per-tile / key-splits tiles' worth to each
    SIMD group."""
    shape = launch_shape(group, head_dim, 16)
    kernels = PagedAttentionKernels(metal_kernel, prefill_from=10**9)
    rng = np.random.default_rng(0)
    counted = []
    for context in (256, 512):
        pages = context // 16
        k_pages, v_pages = (mx.array(rng.standard_normal((pages, 1, 16, head_dim)), mx.float16) for _ in range(2))
        batch = KVBatch((0,), np.ones(1, np.int32), np.array([context], np.int32), np.arange(pages)[None], 16)
        q = mx.array(rng.standard_normal((1, group, head_dim)), mx.float16)
        with cost_counters() as launches:
            kernels(q, k_pages, v_pages, batch, split=False)
        counted.append(launches[0])
    tiles = 256 // shape.keys_per_tile // shape.splits * shape.simdgroups * (group // shape.heads)
    events = paged_tile_events(shape.heads_per_simdgroup, shape.keys_per_tile, head_dim)
    assert counted[1].vector_loads - counted[0].vector_loads == tiles * events["loads"] * 32
    assert counted[1].shuffles - counted[0].shuffles == tiles * events["shuffles"]


def test_the_model_is_calibrated_on_mlx_published_figures():
    """The latency `M5_PRO` carries is the one that fits MLX's published SDPA speeds best, and
    with it the model is within 25% of every published point, never above it."""
    points = calibration_points()
    assert fit_latency(points).latency == pytest.approx(M5_PRO.latency)
    errors = [p.error(M5_PRO) for p in points]
    assert min(errors) >= -0.25 and max(errors) <= 0.0


def test_a_large_batch_is_bound_by_memory_at_the_streaming_share():
    """64 sequences x 8 KV heads x 32k keys: DRAM-bound, so the modelled rate is the share of
    bandwidth a streaming kernel reaches (less the launch's fixed cost)."""
    work = paged_work(32768, 1, 128, 64 * 8, M5_PRO.cores)
    est = estimate(work, 64 * 8, M5_PRO)
    rate = 2 * 32768 * 128 * 2 * 64 * 8 / est.seconds
    assert est.bound == "dram"
    assert rate == pytest.approx(M5_PRO.bandwidth * M5_PRO.streaming, rel=0.01)


def test_a_lane_of_three_values_loads_them_one_by_one():
    """head_dim 96: 3 values a lane, 3 loads a row. At GQA 2 a tile is a page of 16 keys and one
    SIMD group reads it, so 256 more keys add 16 tiles of 2 x 16 rows and 16 page-table entries,
    each a load per lane."""
    kernels = PagedAttentionKernels(metal_kernel, prefill_from=10**9)
    rng = np.random.default_rng(0)
    loads = []
    for context in (256, 512):
        pages = context // 16
        k_pages, v_pages = (mx.array(rng.standard_normal((pages, 1, 16, 96)), mx.float16) for _ in range(2))
        batch = KVBatch((0,), np.ones(1, np.int32), np.array([context], np.int32), np.arange(pages)[None], 16)
        with cost_counters() as launches:
            kernels(mx.array(rng.standard_normal((1, 2, 96)), mx.float16), k_pages, v_pages, batch, split=False)
        loads.append(launches[0].loads)
    assert paged_tile_events(2, 16, 96)["loads"] == 96
    assert loads[1] - loads[0] == (16 * 96 + 16) * 32
