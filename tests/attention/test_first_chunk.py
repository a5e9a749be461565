"""A sequence's first chunk attends its own K/V as computed; every other token reads the pages."""

import math

import mlx.core as mx
import numpy as np
import pytest
from helpers import packed_step, with_row_blocks

from mlxkv import reference_attention
from mlxkv.attention.first_chunk import first_chunk_attention
from mlxkv.attention.kernels import PagedAttentionKernels
from mlxkv.attention.lab.simulator import metal_kernel


def first_chunks_beside_decodes(bits):
    """Rows: a decode, a 9-token first chunk (an own-K/V span of 7), another decode, a 5-token first chunk (span 4)."""
    cache, batch = packed_step("paged", 16, 2, 64, mx.float32, [20, 9, 33, 5], [1, 9, 1, 5], kv_bits=bits)
    rng = np.random.default_rng(1)
    queries, keys, values = (mx.array(rng.standard_normal((batch.num_tokens, h, 64)), mx.float32) for h in (4, 2, 2))
    return cache, batch, queries, keys, values, np.array([0, 7, 0, 4], np.int32)


@pytest.mark.parametrize("attention", ["reference", "simulated kernels"])
def test_an_own_kv_span_attends_its_own_kv_and_the_rest_read_the_pages(attention):
    attention = reference_attention if attention == "reference" else PagedAttentionKernels(metal_kernel)
    cache, batch, q, k, v, own_kv = first_chunks_beside_decodes(4)
    scale = 1 / math.sqrt(64)
    out = first_chunk_attention(attention, q, k, v, *cache.kv(0), batch, own_kv, scale)
    paged = reference_attention(q, *cache.kv(0), batch, scale)
    for lo, n in ((1, 7), (11, 4)):
        q_own, k_own, v_own = (x[lo : lo + n].swapaxes(0, 1)[None] for x in (q, k, v))
        own = mx.fast.scaled_dot_product_attention(q_own, k_own, v_own, scale=scale, mask="causal")[0].swapaxes(0, 1)
        assert mx.allclose(out[lo : lo + n], own, atol=1e-5).item()
        assert not mx.allclose(out[lo : lo + n], paged[lo : lo + n], atol=1e-3).item()  # 4-bit pages differ
    rest = mx.array([0, 8, 9, 10, 15])
    assert mx.allclose(out[rest], paged[rest], atol=1e-5).item()


def test_without_an_own_kv_span_it_is_the_paged_attention():
    cache, batch, q, k, v, _ = first_chunks_beside_decodes(8)
    out = first_chunk_attention(reference_attention, q, k, v, *cache.kv(0), batch, np.zeros(4, np.int32), 0.125)
    assert mx.array_equal(out, reference_attention(q, *cache.kv(0), batch, 0.125)).item()


def test_a_batch_of_own_kv_spans_only_reads_no_page():
    cache, batch, q, k, v, _ = first_chunks_beside_decodes(8)

    def no_pages(*args):
        raise AssertionError("the pages were read")

    only = batch.skip(np.array([0, 0, 0, 0]))
    own_kv = only.query_lens.copy()
    out = first_chunk_attention(no_pages, q, k, v, *cache.kv(0), only, own_kv, 0.125)
    assert out.shape == q.shape


def test_an_own_kv_span_sees_its_blocks_whole():
    cache, causal_batch, q, k, v, own_kv = first_chunks_beside_decodes(8)
    batch = with_row_blocks(causal_batch, {1: [(2, 6)]})
    out = first_chunk_attention(reference_attention, q, k, v, *cache.kv(0), batch, own_kv, 0.125)
    pos = np.arange(7)
    seen = (pos[None] <= pos[:, None]) | ((pos[:, None] >= 2) & (pos[:, None] < 6) & (pos[None] >= 2) & (pos[None] < 6))
    q_own, k_own, v_own = (x[1:8].swapaxes(0, 1)[None] for x in (q, k, v))
    own = mx.fast.scaled_dot_product_attention(q_own, k_own, v_own, scale=0.125, mask=mx.array(seen))[0].swapaxes(0, 1)
    assert mx.allclose(out[1:8], own, atol=1e-5).item()
    causal = first_chunk_attention(reference_attention, q, k, v, *cache.kv(0), causal_batch, own_kv, 0.125)
    assert not mx.allclose(out[1:8], causal[1:8], atol=1e-3).item()
