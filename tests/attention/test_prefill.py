"""Prefill chunks on MLX's SDPA over their gathered pages, beside decode rows on the kernel."""

import math

import mlx.core as mx
import numpy as np
import pytest
from helpers import packed_step, with_row_blocks

from mlxkv import reference_attention
from mlxkv.attention.kernels import TOLERANCE, PagedAttentionKernels
from mlxkv.attention.lab.simulator import metal_kernel
from mlxkv.attention.prefill import PREFILL_FROM, with_chunks_on_sdpa
from mlxkv.attention.variant import PLAIN, Variant

VARIANTS = {
    "plain": PLAIN,
    "window": Variant(window=20),
    "chunk": Variant(chunk=24),
    "sinks": Variant(sinks=mx.array([0.5, -1.0, 2.0, 0.0])),
    "softcap": Variant(softcap=5.0),
}


def queries(batch, q_heads, head_dim, dtype=mx.float32):
    return mx.array(np.random.default_rng(1).standard_normal((batch.num_tokens, q_heads, head_dim)), dtype)


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
@pytest.mark.parametrize("kv_bits", [None, 8])
@pytest.mark.parametrize("name", VARIANTS)
def test_chunks_on_sdpa_equal_the_reference(layout, kv_bits, name):
    """Decode rows, a short chunk and two long ones (one from the first token, one mid-page)."""
    cache, batch = packed_step(
        layout, 16, 2, 64, mx.float32, [5, 70, PREFILL_FROM, 45, 3], [1, 1, PREFILL_FROM, 30, 2], kv_bits=kv_bits
    )
    q = queries(batch, 4, 64)
    reference = reference_attention(q, *cache.kv(0), batch, 0.125, VARIANTS[name])
    out = with_chunks_on_sdpa(reference_attention, q, *cache.kv(0), batch, 0.125, VARIANTS[name])
    assert mx.abs(out - reference).max().item() <= TOLERANCE[mx.float32]


def test_only_chunks_of_prefill_from_tokens_leave_the_paged_kernel():
    cache, batch = packed_step(
        "paged", 16, 2, 64, mx.float32, [5, 70, PREFILL_FROM, 40], [1, 1, PREFILL_FROM, PREFILL_FROM - 1]
    )
    seen = []

    def paged(q, k_pages, v_pages, sub, scale, variant):
        seen.append(sub.query_lens.tolist())
        return reference_attention(q, k_pages, v_pages, sub, scale, variant)

    with_chunks_on_sdpa(paged, queries(batch, 4, 64), *cache.kv(0), batch, 0.125)
    assert seen == [[1, 1, PREFILL_FROM - 1]]
    with_chunks_on_sdpa(paged, queries(batch, 4, 64), *cache.kv(0), batch, 0.125, Variant(softcap=5.0))
    assert seen[1] == [1, 1, PREFILL_FROM, PREFILL_FROM - 1]  # no soft-cap in SDPA: all on the kernel


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_the_metal_path_sends_long_chunks_to_sdpa_and_decode_rows_to_the_kernel(dtype):
    kernels = PagedAttentionKernels(metal_kernel)
    cache, batch = packed_step("paged", 16, 2, 64, dtype, [600, 9, 40], [1, 1, 24], max_model_len=608)
    q = queries(batch, 8, 64, dtype)
    out = kernels(q, *cache.kv(0), batch)
    expected = reference_attention(q, *cache.kv(0), batch, 1 / math.sqrt(64))
    assert mx.abs(out.astype(mx.float32) - expected.astype(mx.float32)).max().item() <= TOLERANCE[dtype]


@pytest.mark.parametrize("name", ["plain", "window", "softcap"])
def test_rows_with_blocks_leave_the_paged_kernel_and_see_them_whole(name):
    """A short chunk with a block goes to SDPA like a long one (the kernel is causal); soft-capped
    rows, which SDPA cannot take, run on the reference path."""
    cache, batch = packed_step("paged", 16, 2, 64, mx.float32, [5, 70, 30, 45], [1, 1, 5, 30])
    batch = with_row_blocks(batch, {2: [(26, 29)], 3: [(20, 36)]})
    q, variant = queries(batch, 4, 64), VARIANTS[name]
    seen = []

    def paged(q, k_pages, v_pages, sub, scale, variant):
        seen.append(sub.query_lens.tolist())
        return reference_attention(q, k_pages, v_pages, sub, scale, variant)

    out = with_chunks_on_sdpa(paged, q, *cache.kv(0), batch, 0.125, variant)
    assert seen == ([] if name == "softcap" else [[1, 1]])
    reference = reference_attention(q, *cache.kv(0), batch, 0.125, variant)
    assert mx.abs(out - reference).max().item() <= TOLERANCE[mx.float32]
    kernels = PagedAttentionKernels(metal_kernel)
    assert mx.abs(kernels(q, *cache.kv(0), batch, 0.125, variant) - reference).max().item() <= TOLERANCE[mx.float32]
