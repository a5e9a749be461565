"""Reference paged attention in pure MLX: the path on machines without Metal, and the kernels' oracle."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from .kv_cache import KVBatch


def gather_kv(pool: mx.array, block_tables: np.ndarray, length: int) -> mx.array:
    """The first `length` tokens of each row's pages as `[rows, kv_heads, tokens, head_dim]`.

    Tokens past a row's own context are whatever the pages hold; callers mask them.
    A single page is sliced before the gather (no whole-slot read for the contiguous
    layout); several pages are gathered head-major in one `take`, which yields the
    head-major result directly instead of gathering and then transposing.
    """
    num_pages, kv_heads, page_size, head_dim = pool.shape
    pages = -(-length // page_size)
    if pages == 1:
        return mx.take(pool[:, :, :length], mx.array(block_tables[:, 0]), axis=0)
    rows = block_tables[:, None, :pages] * kv_heads + np.arange(kv_heads, dtype=np.int32)[None, :, None]
    gathered = mx.take(pool.reshape(num_pages * kv_heads, page_size, head_dim), mx.array(rows), axis=0)
    return gathered.reshape(len(block_tables), kv_heads, pages * page_size, head_dim)


def _attend_rows(queries: mx.array, k_pool: mx.array, v_pool: mx.array, batch: KVBatch,
                 rows: np.ndarray, scale: float) -> tuple[mx.array, np.ndarray]:
    """Attention for some rows of `batch`, queries padded to the longest; returns (out, token ids)."""
    q_lens = batch.query_lens[rows]
    ctx = batch.context_lens[rows]
    starts = (np.cumsum(batch.query_lens) - batch.query_lens)[rows]
    width = int(q_lens.max())
    offsets = np.arange(width, dtype=np.int32)
    token_ids = starts[:, None] + np.minimum(offsets[None, :], q_lens[:, None] - 1)
    n, q_heads, head_dim = len(rows), queries.shape[1], queries.shape[2]
    kv_heads = k_pool.shape[1]
    group = q_heads // kv_heads
    length = int(ctx.max())

    q = queries[mx.array(token_ids)].reshape(n, width, kv_heads, group, head_dim)
    q = q.transpose(0, 2, 3, 1, 4).reshape(n, kv_heads, group * width, head_dim)
    keys = gather_kv(k_pool, batch.block_tables[rows], length)
    values = gather_kv(v_pool, batch.block_tables[rows], length)
    scores = ((q * scale) @ keys.swapaxes(-1, -2)).reshape(n, kv_heads, group, width, -1)

    query_pos = (ctx - q_lens)[:, None] + offsets[None, :]
    key_pos = np.arange(scores.shape[-1])
    allowed = key_pos[None, None, :] <= query_pos[:, :, None]
    scores = mx.where(mx.array(allowed[:, None, None]), scores, -math.inf)
    probs = mx.softmax(scores.astype(mx.float32), axis=-1).astype(values.dtype)
    out = probs.reshape(n, kv_heads, group * width, -1) @ values
    out = out.reshape(n, kv_heads, group, width, head_dim).transpose(0, 3, 1, 2, 4)
    out = out.reshape(n * width, q_heads, head_dim)
    valid = (offsets[None, :] < q_lens[:, None]).reshape(-1)
    return out[mx.array(np.flatnonzero(valid))], token_ids.reshape(-1)[valid]


def reference_attention(queries: mx.array, k_pool: mx.array, v_pool: mx.array, batch: KVBatch,
                        scale: float | None = None) -> mx.array:
    """Attention for a packed batch of decode rows and prefill chunks, with GQA.

    `queries` is `[tokens, q_heads, head_dim]`, packed row after row as in `batch`; each
    new token attends causally to its sequence's cached tokens and the chunk's earlier
    tokens, which must already be written to the pools. Decode rows are computed
    together; prefill chunks together, padded to the longest chunk. Returns
    `[tokens, q_heads, head_dim]`.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(queries.shape[-1])
    live = batch.query_lens > 0
    groups = [np.flatnonzero(live & (batch.query_lens == 1)), np.flatnonzero(live & (batch.query_lens > 1))]
    parts = [_attend_rows(queries, k_pool, v_pool, batch, rows, scale) for rows in groups if rows.size]
    if len(parts) == 1:
        out, order = parts[0]
    else:
        out = mx.concatenate([p[0] for p in parts])
        order = np.concatenate([p[1] for p in parts])
    if np.array_equal(order, np.arange(order.size)):
        return out
    return out[mx.array(np.argsort(order).astype(np.int32))]
