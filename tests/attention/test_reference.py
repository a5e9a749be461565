import math

import mlx.core as mx
import numpy as np
import pytest
from helpers import packed_step, scramble_free_pages, with_row_blocks

from mlxkv import KVCacheManager, reference_attention
from mlxkv.attention.reference import gather_kv
from mlxkv.attention.variant import PLAIN, Variant

TOLERANCE = {mx.float32: 2e-5, mx.float16: 4e-3, mx.bfloat16: 3e-2}
HEAD_DIM = 32


def sdpa_oracle(q, keys, values, scale):
    """mx.fast SDPA on one sequence's K/V laid out contiguously; q is the last len(q) positions."""
    n, length = q.shape[0], keys.shape[0]
    allowed = np.arange(length)[None, :] <= (length - n + np.arange(n))[:, None]
    out = mx.fast.scaled_dot_product_attention(
        q.transpose(1, 0, 2)[None],
        keys.transpose(1, 0, 2)[None],
        values.transpose(1, 0, 2)[None],
        scale=scale,
        mask=mx.array(allowed),
    )
    return out[0].transpose(1, 0, 2)


def stored(x, kv_bits):
    """What the cache gives back for K/V `x`: itself, or its quantized values."""
    if kv_bits is None:
        return x
    return mx.dequantize(*mx.quantize(x, group_size=32, bits=kv_bits), group_size=32, bits=kv_bits)


def run_case(layout, page_size, kv_heads, group, dtype, contexts, query_lens, seed=0, kv_bits=None):
    """Fill each sequence's cache in interleaved chunks, then attend for one packed step."""
    rng = np.random.default_rng(seed)
    cache = KVCacheManager(
        1,
        kv_heads,
        HEAD_DIM,
        max_num_seqs=len(contexts) + 3,
        max_model_len=512,
        layout=layout,
        page_size=page_size,
        num_pages=4096 // page_size,
        dtype=dtype,
        kv_bits=kv_bits,
        kv_group_size=32,
    )
    if layout == "paged":
        scramble_free_pages(cache, rng)
    ids = cache.claim(len(contexts))
    history = {s: ([], []) for s in ids}

    def add(seq_ids, counts):
        batch = cache.append(seq_ids, counts)
        keys = mx.array(rng.standard_normal((sum(counts), kv_heads, HEAD_DIM)), dtype=dtype)
        values = mx.array(rng.standard_normal((sum(counts), kv_heads, HEAD_DIM)), dtype=dtype)
        cache.write(0, batch, keys, values)
        for s, lo, hi in zip(seq_ids, np.cumsum(counts) - counts, np.cumsum(counts)):
            history[s][0].append(stored(keys[int(lo) : int(hi)], kv_bits))
            history[s][1].append(stored(values[int(lo) : int(hi)], kv_bits))
        return batch

    cached = {s: c - q for s, c, q in zip(ids, contexts, query_lens)}
    while any(cached.values()):
        chunk = {s: min(left, int(rng.integers(1, 2 * page_size + 2))) for s, left in cached.items() if left}
        add(list(chunk), list(chunk.values()))
        cached = {s: cached[s] - chunk.get(s, 0) for s in cached}
    order = list(rng.permutation(len(ids)))
    batch = add([ids[i] for i in order], [query_lens[i] for i in order])
    q = mx.array(rng.standard_normal((batch.num_tokens, kv_heads * group, HEAD_DIM)), dtype=dtype)
    scale = 1 / math.sqrt(HEAD_DIM)
    out = reference_attention(q, *cache.kv(0), batch, scale)

    starts = np.cumsum(batch.query_lens) - batch.query_lens
    for row, seq_id in enumerate(batch.seq_ids):
        lo, hi = int(starts[row]), int(starts[row] + batch.query_lens[row])
        keys, values = (mx.concatenate(parts) for parts in history[seq_id])
        expected = sdpa_oracle(q[lo:hi], keys, values, scale)
        diff = mx.abs(out[lo:hi].astype(mx.float32) - expected.astype(mx.float32)).max().item()
        assert diff <= TOLERANCE[dtype], (row, diff)
    return batch


CASES = [(layout, bs) for layout in ("paged",) for bs in (1, 16, 64)] + [("contiguous", None)]


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("group", [1, 2, 8])
@pytest.mark.parametrize("layout, page_size", CASES)
def test_mixed_decode_and_prefill_rows_match_sdpa(layout, page_size, group, dtype):
    bs = page_size or 16
    contexts = [1, bs, 2 * bs, 3 * bs + 5, 37, 70, 9, bs + 3]
    query_lens = [1, 1, 1, 1, 5, 1, 9, min(bs, 4) + 2]
    run_case(layout, bs, 2 if group < 8 else 1, group, dtype, contexts, query_lens)


@pytest.mark.parametrize("kv_bits", [8, 4])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("layout, page_size", [("paged", 16), ("contiguous", None)])
def test_quantized_pages_attend_as_their_dequantized_values(layout, page_size, dtype, kv_bits):
    bs = page_size or 16
    run_case(layout, bs, 2, 4, dtype, [1, 16, 37, 70, 9], [1, 1, 5, 1, 9], kv_bits=kv_bits)


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_prefill_chunks_that_start_mid_page_and_end_on_a_boundary(layout):
    batch = run_case(layout, 16, 2, 4, mx.float32, contexts=[32, 48, 17], query_lens=[27, 16, 17])
    assert sorted(zip(batch.context_lens.tolist(), batch.query_lens.tolist())) == [(17, 17), (32, 27), (48, 16)]


def test_decode_only_batch_with_pages_out_of_order():
    batch = run_case("paged", 16, 2, 2, mx.float32, contexts=[5, 16, 33, 64], query_lens=[1, 1, 1, 1])
    used = [row[: -(-n // 16)] for row, n in zip(batch.page_tables.tolist(), batch.context_lens)]
    assert any(pages != sorted(pages) for pages in used)


def test_rows_without_new_tokens_are_skipped():
    cache = KVCacheManager(1, 1, 8, max_num_seqs=2, max_model_len=32, page_size=4, dtype=mx.float32)
    a, b = cache.claim(2)
    cache.write(0, cache.append([a], [3]), mx.ones((3, 1, 8)), mx.ones((3, 1, 8)))
    batch = cache.append([a, b], [0, 2])
    cache.write(0, batch, mx.ones((2, 1, 8)), mx.full((2, 1, 8), 2.0))
    out = reference_attention(mx.ones((2, 1, 8)), *cache.kv(0), batch)
    assert out.tolist() == [[[2.0] * 8]] * 2


def test_chunk_longer_than_a_query_tile_matches_sdpa(monkeypatch):
    monkeypatch.setattr("mlxkv.attention.reference.QUERY_TILE", 8)
    run_case("paged", 16, 2, 4, mx.float32, contexts=[40, 21, 3], query_lens=[30, 21, 1])


@pytest.mark.parametrize("page_size", [4, 8, 16])
def test_keys_read_a_tile_at_a_time_match_sdpa(monkeypatch, page_size):
    monkeypatch.setattr("mlxkv.attention.reference.KEY_TILE", 16)  # tiles of 4, 2 and 1 pages
    run_case("paged", page_size, 2, 4, mx.float32, contexts=[40, 21, 3, 70, 69], query_lens=[30, 21, 1, 1, 1])
    run_case("paged", page_size, 2, 4, mx.float16, contexts=[40, 21, 70], query_lens=[30, 21, 1], kv_bits=8)


def numpy_oracle(q, keys, values, scale, variant, blocks=None, end=None):
    """One sequence's attention written out: q holds positions `end - len(q)` to `end - 1` (by
    default the last ones of `keys`), each also seeing its block `blocks[i]` (`[first, end)`)."""
    q, keys, values = (np.array(x, np.float64) for x in (q, keys, values))
    n, q_heads, _ = q.shape
    length, kv_heads, _ = keys.shape
    end = length if end is None else end
    out = np.zeros_like(q)
    for i in range(n):
        pos = end - n + i
        lo = 0 if variant.window is None else max(0, pos - variant.window + 1)
        if variant.chunk is not None:  # the chunk's first position
            lo = pos // variant.chunk * variant.chunk
        seen = (np.arange(length) >= lo) & (np.arange(length) <= pos)
        if blocks is not None:
            seen |= (np.arange(length) >= blocks[i][0]) & (np.arange(length) < blocks[i][1])
        for h in range(q_heads):
            kh = h // (q_heads // kv_heads)
            s = keys[seen, kh] @ q[i, h] * scale
            if variant.softcap is not None:
                s = np.tanh(s / variant.softcap) * variant.softcap
            logits = s if variant.sinks is None else np.append(s, float(variant.sinks[h]))
            w = np.exp(logits - logits.max())
            w = w[: int(seen.sum())] / w.sum()
            out[i, h] = w @ values[seen, kh]
    return out


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
@pytest.mark.parametrize(
    "variant",
    [
        Variant(window=5),
        Variant(window=16),
        Variant(softcap=2.0),
        Variant(window=7, softcap=1.5),
        Variant(sinks=mx.array([0.5, -1.0, 2.0, 0.0])),
        Variant(window=9, sinks=mx.array([3.0, 1.0, -2.0, 0.5])),
        Variant(chunk=8),
        Variant(chunk=12),
    ],
    ids=["window5", "window16", "softcap", "window-softcap", "sinks", "window-sinks", "chunk8", "chunk12"],
)
@pytest.mark.parametrize("key_tile", [1024, 8], ids=["one-key-tile", "key-tiles-of-8"])
def test_attention_variants_match_the_written_out_oracle(monkeypatch, layout, variant, key_tile):
    monkeypatch.setattr("mlxkv.attention.reference.KEY_TILE", key_tile)
    rng = np.random.default_rng(7)
    cache = KVCacheManager(
        1, 2, HEAD_DIM, max_num_seqs=4, max_model_len=128, layout=layout, page_size=8, dtype=mx.float32
    )
    ids = cache.claim(3)
    contexts, query_lens = [40, 23, 9], [1, 6, 9]
    history = {}
    for s, c, n in zip(ids, contexts, query_lens):
        batch = cache.append([s], [c - n])
        history[s] = [mx.array(rng.standard_normal((c - n, 2, HEAD_DIM)), mx.float32) for _ in range(2)]
        cache.write(0, batch, *history[s])
    batch = cache.append(ids, query_lens)
    new = [mx.array(rng.standard_normal((sum(query_lens), 2, HEAD_DIM)), mx.float32) for _ in range(2)]
    cache.write(0, batch, *new)
    q = mx.array(rng.standard_normal((sum(query_lens), 4, HEAD_DIM)), mx.float32)
    out = reference_attention(q, *cache.kv(0), batch, 0.3, variant)
    for row, s in enumerate(ids):
        lo, hi = int(batch.query_starts[row]), int(batch.query_starts[row] + query_lens[row])
        keys, values = (mx.concatenate([h, x[lo:hi]]) for h, x in zip(history[s], new))
        expected = numpy_oracle(q[lo:hi], keys, values, 0.3, variant)
        assert np.abs(np.array(out[lo:hi]) - expected).max() < 1e-5


BLOCKS = {1: [(14, 22)], 2: [(3, 13), (15, 20)]}  # row 0 decodes, row 1 a chunk at 10-29, row 2 a first chunk


def blocked_oracle(cache, batch, q, scale, variant):
    """`numpy_oracle` row by row over the keys and values the pages hold."""
    expected = []
    for row in range(len(batch.query_lens)):
        lo, hi = int(batch.query_starts[row]), int(batch.query_starts[row] + batch.query_lens[row])
        ctx = int(batch.context_lens[row])
        table = batch.page_tables[row : row + 1]
        keys, values = (gather_kv(p, table, ctx)[0, :, :ctx].swapaxes(0, 1) for p in cache.kv(0))
        blocks = batch.blocks[lo:hi]
        expected.append(numpy_oracle(q[lo:hi], keys, values, scale, variant, blocks))
    return np.concatenate(expected)


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
@pytest.mark.parametrize(
    "variant", [PLAIN, Variant(window=5), Variant(window=16)], ids=["causal", "window5", "window16"]
)
@pytest.mark.parametrize("tiles", [(512, 1024), (8, 8)], ids=["one-tile", "tiles-of-8"])
def test_blocks_are_seen_whole_beside_causal_rows(monkeypatch, layout, variant, tiles):
    """Each token of a block sees all of it, later keys included (Gemma 4's image spans), also
    where a block is longer than the window and where query and key tiles cut through it."""
    monkeypatch.setattr("mlxkv.attention.reference.QUERY_TILE", tiles[0])
    monkeypatch.setattr("mlxkv.attention.reference.KEY_TILE", tiles[1])
    cache, batch = packed_step(layout, 8, 2, HEAD_DIM, mx.float32, [40, 30, 24], [1, 20, 24], seed=3)
    batch = with_row_blocks(batch, BLOCKS)
    q = mx.array(np.random.default_rng(4).standard_normal((batch.num_tokens, 4, HEAD_DIM)), mx.float32)
    out = reference_attention(q, *cache.kv(0), batch, 0.3, variant)
    assert np.abs(np.array(out) - blocked_oracle(cache, batch, q, 0.3, variant)).max() < 1e-5
