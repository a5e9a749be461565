"""Every kernel variant through the CPU simulator, against the reference attention."""

import math

import mlx.core as mx
import numpy as np
import pytest
from helpers import packed_step

from mlxkv import reference_attention
from mlxkv.attention.kernels import PagedAttentionKernels, select_attention
from mlxkv.attention.simulator import metal_kernel

TOLERANCE = {mx.float32: 1e-5, mx.float16: 4e-3, mx.bfloat16: 3e-2}

# Each dtype meets every head dim once, and every block size, GQA ratio and split-K
# setting at least once; every head dim meets both split settings.
VARIANTS = [
    (mx.float32, 64, 8, 1, False), (mx.float32, 80, 16, 4, True), (mx.float32, 96, 32, 8, False),
    (mx.float32, 128, 16, 8, True), (mx.float16, 64, 16, 4, True), (mx.float16, 80, 32, 8, False),
    (mx.float16, 96, 8, 1, True), (mx.float16, 128, 32, 1, False), (mx.bfloat16, 64, 32, 8, False),
    (mx.bfloat16, 80, 8, 1, True), (mx.bfloat16, 96, 16, 4, False), (mx.bfloat16, 128, 8, 4, True),
]


@pytest.fixture(scope="module")
def kernels():
    return PagedAttentionKernels(metal_kernel)


def compare(kernels, cache, batch, q_heads, dtype, split):
    head_dim = cache.kv(0)[0].shape[-1]
    q = mx.array(np.random.default_rng(1).standard_normal((batch.num_tokens, q_heads, head_dim)), dtype)
    scale = 1 / math.sqrt(head_dim)
    out = kernels(q, *cache.kv(0), batch, scale, split=split)
    expected = reference_attention(q, *cache.kv(0), batch, scale)
    diff = mx.abs(out.astype(mx.float32) - expected.astype(mx.float32)).max().item()
    assert diff <= TOLERANCE[dtype], diff


@pytest.mark.parametrize("dtype, head_dim, block_size, group, split", VARIANTS,
                         ids=[f"{str(v[0]).split('.')[-1]}-d{v[1]}-bs{v[2]}-g{v[3]}-{'split' if v[4] else 'direct'}"
                              for v in VARIANTS])
def test_variant_matches_reference_on_ragged_packed_batches(kernels, dtype, head_dim, block_size, group, split):
    kv_heads = 1 if group == 8 else 2
    bs = block_size
    contexts = [1, bs, 2 * bs, 3 * bs + 5, bs + 3 + 6]
    query_lens = [1, 1, 1, 1, 6]          # decodes, and a prefill chunk that starts mid-page
    cache, batch = packed_step("paged", bs, kv_heads, head_dim, dtype, contexts, query_lens)
    compare(kernels, cache, batch, kv_heads * group, dtype, split)


@pytest.mark.parametrize("split", [False, True])
def test_contiguous_layout_runs_through_the_same_kernels(kernels, split):
    cache, batch = packed_step("contiguous", 16, 2, 64, mx.float32, [1, 33, 70], [1, 5, 1])
    assert batch.block_tables.shape[1] == 1
    compare(kernels, cache, batch, 4, mx.float32, split)


def test_split_k_is_chosen_for_few_long_sequences(kernels, monkeypatch):
    calls = []
    monkeypatch.setattr(kernels, "partitioned", lambda **kw: calls.append(kw) or (None, None))
    monkeypatch.setattr(kernels, "reduce", lambda **kw: [mx.zeros(kw["output_shapes"][0])])
    cache, batch = packed_step("paged", 16, 1, 64, mx.float32, [9], [1])
    q = mx.zeros((1, 1, 64))
    long_batch = type(batch)(batch.seq_ids, batch.query_lens, np.array([600], np.int32), batch.block_tables,
                             batch.slot_mapping, batch.block_size)
    kernels(q, *cache.kv(0), long_batch)
    assert len(calls) == 1 and calls[0]["grid"][2] == 3


def test_attention_backend_choice(monkeypatch):
    monkeypatch.delenv("MLXKV_ATTENTION", raising=False)
    assert select_attention() is reference_attention  # no Metal on this machine
    monkeypatch.setenv("MLXKV_ATTENTION", "reference")
    assert select_attention() is reference_attention
    monkeypatch.setenv("MLXKV_ATTENTION", "metal")
    with pytest.raises(ValueError, match="MLXKV_ATTENTION='metal' but Metal is not available"):
        select_attention()
    monkeypatch.setenv("MLXKV_ATTENTION", "cuda")
    with pytest.raises(ValueError, match="MLXKV_ATTENTION='cuda' is not an attention backend"):
        select_attention()


def test_warm_up_runs_both_paths(kernels, monkeypatch):
    launched = []
    for name in ("direct", "partitioned", "reduce"):
        original = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda _f=original, _n=name, **kw: launched.append(_n) or _f(**kw))
    kernels.warm(mx.float16, 64, 16, 4, 2)
    assert launched == ["direct", "partitioned", "reduce"]
