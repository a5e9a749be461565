"""Reference paged attention in pure MLX: the path on machines without Metal, and the kernels' oracle."""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..cache.manager import KVBatch
from ..cache.storage import Pool, QuantizedPages

QUERY_TILE = 512
LOG2_E = math.log2(math.e)


def gather_kv(pool: Pool, block_tables: np.ndarray, length: int) -> mx.array:
    """The first `length` tokens of each row's pages as `[rows, kv_heads, tokens, head_dim]`.

    Tokens past a row's own context are whatever the pages hold; callers mask them.
    Quantized pages are gathered packed and dequantized after the gather. Measured on the
    CPU against `mx.quantized_matmul` over the gathered packed rows: ten times as fast in
    float16 and bfloat16, whose quantized matmul has no fast CPU path; in float32 from
    twice as fast (one sequence, 8-bit) to half as fast (16 sequences, 4-bit).
    """
    if isinstance(pool, QuantizedPages):
        return pool.dequantize(tuple(_gather(part, block_tables, length) for part in pool.parts))
    return _gather(pool, block_tables, length)


def _gather(pool: mx.array, block_tables: np.ndarray, length: int) -> mx.array:
    """`gather_kv` for one array of `[pages, kv_heads, page_size, row]`.

    A single page is sliced before the gather (no whole-slot read for the contiguous
    layout); several pages are gathered head-major in one `take`, which yields the
    head-major result directly instead of gathering and then transposing.
    """
    num_pages, kv_heads, page_size, row = pool.shape
    pages = -(-length // page_size)
    if pages == 1:
        return mx.take(pool[:, :, :length], mx.array(block_tables[:, 0]), axis=0)
    rows = block_tables[:, None, :pages] * kv_heads + np.arange(kv_heads, dtype=np.int32)[None, :, None]
    gathered = mx.take(pool.reshape(num_pages * kv_heads, page_size, row), mx.array(rows), axis=0)
    return gathered.reshape(len(block_tables), kv_heads, pages * page_size, row)


def _softmax(scores: mx.array, sinks: mx.array | None = None) -> mx.array:
    """`mx.softmax` over the last axis, with `exp(x)` computed as `2 ** (x * log2(e))`;
    `sinks` (broadcast against `scores[..., :1]`) are extra logits that take their share of
    the weight and give nothing back (GPT-OSS's attention sinks).

    Equal up to rounding, and the same trick as flash attention's exp2: on the CPU, MLX's
    `power(2, x)` runs about three times as fast as its `exp`, which is most of the cost
    of attending over a long context there."""
    top = mx.max(scores, axis=-1, keepdims=True)
    if sinks is not None:
        top = mx.maximum(top, sinks)
    weights = mx.power(2.0, (scores - top) * LOG2_E)
    total = mx.sum(weights, axis=-1, keepdims=True)
    if sinks is not None:
        total = total + mx.power(2.0, (sinks - top) * LOG2_E)
    return weights / total


@dataclass(frozen=True)
class Variant:
    """How one layer's attention departs from plain causal softmax attention.

    `window`: a query at position p sees keys p - window < j <= p (sliding-window layers);
    `softcap`: scores become softcap * tanh(score / softcap) (Gemma 2); `sinks`: one logit
    per query head that joins every softmax (GPT-OSS)."""

    window: int | None = None
    softcap: float | None = None
    sinks: mx.array | None = None


PLAIN = Variant()


def _attend(queries: mx.array, k_pool: Pool, v_pool: Pool, starts: np.ndarray, width: int,
            ctx: np.ndarray, block_tables: np.ndarray, scale: float, variant: Variant) -> tuple[mx.array, np.ndarray]:
    """Attention for rows of `width` queries each, from token `starts[i]`, the last one at
    position `ctx[i] - 1`. Returns (out, the token ids of its rows)."""
    n, q_heads, head_dim = len(starts), queries.shape[1], queries.shape[2]
    kv_heads, page_size = k_pool.shape[1], k_pool.shape[2]
    group = q_heads // kv_heads
    token_ids = (starts[:, None] + np.arange(width)[None, :]).reshape(-1)

    q = queries[mx.array(token_ids)].reshape(n, width, kv_heads, group, head_dim)
    q = q.transpose(0, 2, 3, 1, 4).reshape(n, kv_heads, group * width, head_dim)
    query_pos = (ctx - width)[:, None] + np.arange(width)[None, :]
    first_page = 0 if variant.window is None else max(0, int(query_pos.min()) - variant.window + 1) // page_size
    tables = block_tables[:, first_page:]
    keys = gather_kv(k_pool, tables, int(ctx.max()) - first_page * page_size)
    values = gather_kv(v_pool, tables, int(ctx.max()) - first_page * page_size)
    scores = ((q * scale) @ keys.swapaxes(-1, -2)).reshape(n, kv_heads, group, width, -1)
    if variant.softcap is not None:
        scores = mx.tanh(scores / variant.softcap) * variant.softcap

    key_pos = first_page * page_size + np.arange(scores.shape[-1])[None, None, :]
    allowed = key_pos <= query_pos[:, :, None]
    if variant.window is not None:
        allowed &= key_pos > query_pos[:, :, None] - variant.window
    scores = mx.where(mx.array(allowed[:, None, None]), scores, -math.inf)
    sinks = None if variant.sinks is None else variant.sinks.astype(mx.float32).reshape(1, kv_heads, group, 1, 1)
    probs = _softmax(scores.astype(mx.float32), sinks).astype(values.dtype)
    out = probs.reshape(n, kv_heads, group * width, -1) @ values
    out = out.reshape(n, kv_heads, group, width, head_dim).transpose(0, 3, 1, 2, 4)
    return out.reshape(n * width, q_heads, head_dim), token_ids


def reference_attention(queries: mx.array, k_pool: Pool, v_pool: Pool, batch: KVBatch,
                        scale: float | None = None, variant: Variant = PLAIN) -> mx.array:
    """Attention for a packed batch of decode rows and prefill chunks, with GQA.

    `queries` is `[tokens, q_heads, head_dim]`, packed row after row as in `batch`; each
    new token attends causally to its sequence's cached tokens and the chunk's earlier
    tokens, which must already be written to the pools (float or quantized), as `variant`
    says (a sliding window reads only the pages the window reaches). Decode rows are computed together
    in buckets of similar length (page counts within a power of two), so a short context
    does not copy the batch's longest; each prefill chunk runs on its own in tiles of at
    most `QUERY_TILE` queries, which bounds the score matrix whatever the chunk length.
    Returns `[tokens, q_heads, head_dim]`.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(queries.shape[-1])
    q_lens, ctx, tables, starts = batch.query_lens, batch.context_lens, batch.block_tables, batch.query_starts
    parts = []
    decode = np.flatnonzero(q_lens == 1)
    buckets = np.array([int(n).bit_length() for n in -(-ctx[decode] // k_pool.shape[2])])
    for bucket in np.unique(buckets):
        rows = decode[buckets == bucket]
        parts.append(_attend(queries, k_pool, v_pool, starts[rows], 1, ctx[rows], tables[rows], scale, variant))
    for row in np.flatnonzero(q_lens > 1):
        for lo in range(0, int(q_lens[row]), QUERY_TILE):
            n = min(QUERY_TILE, int(q_lens[row]) - lo)
            last = ctx[row] - q_lens[row] + lo + n
            parts.append(_attend(queries, k_pool, v_pool, starts[row:row + 1] + lo, n, np.array([last]),
                                 tables[row:row + 1], scale, variant))
    return in_packed_order(parts)


def in_packed_order(parts: list[tuple[mx.array, np.ndarray]]) -> mx.array:
    """Outputs computed for groups of a batch's tokens, `(out, the token ids of its rows)`, as
    one array in the packed order of the tokens."""
    out = parts[0][0] if len(parts) == 1 else mx.concatenate([p[0] for p in parts])
    order = np.concatenate([p[1] for p in parts])
    if np.array_equal(order, np.arange(order.size)):
        return out
    return out[mx.array(np.argsort(order).astype(np.int32))]
