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

from ..cache.batch import KVBatch
from ..cache.storage import Pages
from .heads import Heads
from .reference import gather_kv, in_packed_order, reference_attention
from .variant import PLAIN, Variant, key_range, visible

PREFILL_FROM = 8  # query tokens from which a chunk runs on SDPA; a Mac measures it: scripts/bench_kernels.py --prefill


def chunk_attention(
    queries: mx.array,
    k_pages: Pages,
    v_pages: Pages,
    table: np.ndarray,
    context: int,
    scale: float,
    variant: Variant = PLAIN,
    blocks: np.ndarray | None = None,
) -> mx.array:
    """Attention for one sequence's chunk of `queries` (`[tokens, q_heads, head_dim]`), the
    last tokens of its `context`, over its pages `table` through MLX's SDPA; `blocks`: the blocks
    its tokens see whole (`KVBatch.blocks`), which the chunk holds."""
    tokens, page_size = queries.shape[0], k_pages.shape[2]
    queries_at = np.arange(context - tokens, context)[:, None]
    first = key_range(queries_at, variant.window, variant.chunk, blocks)[0] // page_size * page_size
    keys, values = (
        gather_kv(pages, table[None, first // page_size :], context - first)[:, :, : context - first]
        for pages in (k_pages, v_pages)
    )
    mask: str | mx.array = "causal"
    if variant.window is not None or variant.chunk is not None or blocks is not None:
        shaped = None if blocks is None else blocks[:, None, :]
        mask = mx.array(visible(queries_at, np.arange(first, context)[None, :], variant.window, variant.chunk, shaped))
    out = mx.fast.scaled_dot_product_attention(
        queries.swapaxes(0, 1)[None], keys, values, scale=scale, mask=mask, sinks=variant.sinks
    )
    return out[0].swapaxes(0, 1)


def temporary_bytes(heads: Heads, queries: int, context: int) -> int:
    """Bytes `chunk_attention` holds in one layer for a chunk of `queries` tokens over `context`
    keys: the gathered K/V of the whole context, the queries and output transposed, and a sliding
    window's mask. Metal's SDPA is fused: its scores never reach memory."""
    transposed = 2 * queries * heads.q_heads * heads.head_dim * heads.itemsize
    return heads.kv_bytes(context) + transposed + queries * context


def with_chunks_on_sdpa(
    attention: Callable,
    queries: mx.array,
    k_pages: Pages,
    v_pages: Pages,
    batch: KVBatch,
    scale: float,
    variant: Variant = PLAIN,
    smallest: int = PREFILL_FROM,
) -> mx.array:
    """`attention` for the batch's decode rows and short chunks, `chunk_attention` for each
    chunk of at least `smallest` tokens or with a block its tokens see whole (`KVBatch.blocks`:
    `attention` is causal). Soft-capped scores (Gemma 2) have no SDPA form and stay with
    `attention`, or the reference path where blocks need a mask."""
    blocks = batch.blocks
    in_blocks = np.zeros(0, np.int64) if blocks is None else batch.token_rows[blocks[:, 1] > blocks[:, 0]]
    if variant.softcap is not None:
        if in_blocks.size:
            return reference_attention(queries, k_pages, v_pages, batch, scale, variant)
        return attention(queries, k_pages, v_pages, batch, scale, variant)
    chunks = np.union1d(np.flatnonzero(batch.query_lens >= smallest), in_blocks)
    if not chunks.size:
        return attention(queries, k_pages, v_pages, batch, scale, variant)
    parts = []
    for row in chunks:
        lo, hi = int(batch.query_starts[row]), int(batch.query_starts[row] + batch.query_lens[row])
        own = blocks[lo:hi] if blocks is not None and row in in_blocks else None
        context = int(batch.context_lens[row])
        out = chunk_attention(queries[lo:hi], k_pages, v_pages, batch.page_tables[row], context, scale, variant, own)
        parts.append((out, np.arange(lo, hi)))
    rest = np.setdiff1d(np.arange(len(batch.query_lens)), chunks)
    if rest.size:
        tokens = np.flatnonzero(~np.isin(batch.token_rows, chunks))
        parts.append(
            (
                attention(
                    queries[mx.array(tokens.astype(np.int32))], k_pages, v_pages, batch.select(rest), scale, variant
                ),
                tokens,
            )
        )
    return in_packed_order(parts)
