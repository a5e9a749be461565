"""Prefill chunks on MLX's fused SDPA: the matrix units, not a per-token kernel.

A chunk of many query tokens from one sequence reads the same keys for every token. The
paged decode kernel would read them once per token, on the SIMD units; gathering the
sequence's pages once and running `mx.fast.scaled_dot_product_attention` (tiled, on the
simdgroup matrix units on a Mac) reads them once per tile of queries. The chunk's queries
are the last tokens of its context, so SDPA's causal mask, aligned to the last key, is the
right one. Decode rows and short chunks stay on the paged kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np

from ..cache.manager import KVBatch
from ..cache.storage import Pool
from .reference import PLAIN, Variant, gather_kv, in_packed_order, visible

PREFILL_FROM = 8  # query tokens from which a chunk runs on SDPA; a Mac measures it: scripts/bench_kernels.py --prefill


def chunk_attention(queries: mx.array, k_pool: Pool, v_pool: Pool, table: np.ndarray, context: int, scale: float,
                    variant: Variant = PLAIN) -> mx.array:
    """Attention for one sequence's chunk of `queries` (`[tokens, q_heads, head_dim]`), the
    last tokens of its `context`, over its pages `table` through MLX's SDPA."""
    tokens, block_size = queries.shape[0], k_pool.shape[2]
    first = 0 if variant.window is None else max(0, context - tokens - variant.window + 1) // block_size * block_size
    keys, values = (gather_kv(pool, table[None, first // block_size:], context - first)[:, :, :context - first]
                    for pool in (k_pool, v_pool))
    mask = "causal"
    if variant.window is not None:
        mask = mx.array(visible(np.arange(context - tokens, context)[:, None], np.arange(first, context)[None, :],
                                variant.window))
    out = mx.fast.scaled_dot_product_attention(queries.swapaxes(0, 1)[None], keys, values, scale=scale, mask=mask,
                                               sinks=variant.sinks)
    return out[0].swapaxes(0, 1)


def with_chunks_on_sdpa(attention: Callable, queries: mx.array, k_pool: Pool, v_pool: Pool, batch: KVBatch,
                        scale: float, variant: Variant = PLAIN, smallest: int = PREFILL_FROM) -> mx.array:
    """`attention` for the batch's decode rows and short chunks, `chunk_attention` for each
    chunk of at least `smallest` tokens. Soft-capped scores (Gemma 2) have no SDPA form and
    stay with `attention`."""
    chunks = np.flatnonzero(batch.query_lens >= smallest) if variant.softcap is None else np.zeros(0, np.int64)
    if not chunks.size:
        return attention(queries, k_pool, v_pool, batch, scale, variant)
    parts = []
    for row in chunks:
        lo, hi = int(batch.query_starts[row]), int(batch.query_starts[row] + batch.query_lens[row])
        parts.append((chunk_attention(queries[lo:hi], k_pool, v_pool, batch.block_tables[row],
                                      int(batch.context_lens[row]), scale, variant), np.arange(lo, hi)))
    rest = np.setdiff1d(np.arange(len(batch.query_lens)), chunks)
    if rest.size:
        tokens = np.flatnonzero(~np.isin(batch.token_rows, chunks))
        parts.append((attention(queries[mx.array(tokens.astype(np.int32))], k_pool, v_pool, batch.select(rest),
                                scale, variant), tokens))
    return in_packed_order(parts)
