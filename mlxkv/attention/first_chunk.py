"""Attention in which a prompt's first chunk attends its own K/V as computed, not the pages.

With quantized pages this is mlx-lm's order (`generate_step` with `kv_bits`): the prompt's
first chunk, all of it but the last token, attends its own unquantized K/V; every later token
(the prompt's last, later chunks, generated tokens) attends the quantized pages. That own-K/V
span is scheduled whole in one step (`Scheduler.own_kv_span`), so which tokens read
unquantized K/V depends on the prompt alone, not on what else shares the step.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np

from ..cache.batch import KVBatch
from ..cache.storage import Pages
from .reference import in_packed_order
from .variant import PLAIN, Variant, visible


def first_chunk_attention(
    attention: Callable,
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    k_pages: Pages,
    v_pages: Pages,
    batch: KVBatch,
    own_kv: np.ndarray | None,
    scale: float,
    variant: Variant = PLAIN,
) -> mx.array:
    """`attention` over the pages for the packed batch's tokens, except the first `own_kv[b]`
    tokens of each row b (a chunk that starts its sequence), which attend causally to each
    other's `keys` and `values` as computed, through MLX's SDPA as mlx-lm's prefill does.
    `own_kv` is None when no row has such tokens."""
    if own_kv is None or not own_kv.any():
        return attention(queries, k_pages, v_pages, batch, scale, variant)
    parts = []
    for row in np.flatnonzero(own_kv):
        lo, n = int(batch.query_starts[row]), int(own_kv[row])
        q, k, v = (x[lo : lo + n].swapaxes(0, 1)[None] for x in (queries, keys, values))
        blocks = None if batch.blocks is None else batch.blocks[lo : lo + n]
        parts.append((_own_attention(q, k, v, scale, variant, blocks)[0].swapaxes(0, 1), np.arange(lo, lo + n)))
    rest = np.setdiff1d(np.arange(batch.num_tokens), np.concatenate([p[1] for p in parts]))
    if rest.size:
        parts.append(
            (
                attention(
                    queries[mx.array(rest.astype(np.int32))], k_pages, v_pages, batch.skip(own_kv), scale, variant
                ),
                rest,
            )
        )
    return in_packed_order(parts)


def _own_attention(
    q: mx.array, k: mx.array, v: mx.array, scale: float, variant: Variant, blocks: np.ndarray | None
) -> mx.array:
    """Causal attention of one chunk over its own K/V (`[1, heads, tokens, head_dim]`), as the
    mlx-lm model computes it: MLX's SDPA with the window's mask (and the blocks its tokens see
    whole) and the sinks, or written out with the soft-cap before the mask (Gemma 2)."""
    pos = np.arange(q.shape[2])  # the chunk starts its sequence
    plain = variant.window is None and variant.chunk is None and variant.softcap is None and blocks is None
    shaped = None if blocks is None else blocks[:, None, :]
    allowed = None if plain else mx.array(visible(pos[:, None], pos[None], variant.window, variant.chunk, shaped))
    if allowed is None or variant.softcap is None:
        mask = "causal" if allowed is None else allowed
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=variant.sinks)
    group = q.shape[1] // k.shape[1]
    k, v = mx.repeat(k, group, axis=1), mx.repeat(v, group, axis=1)
    scores = mx.tanh(((q * scale) @ k.swapaxes(-1, -2)) / variant.softcap) * variant.softcap
    return mx.softmax(mx.where(allowed, scores, -mx.inf), axis=-1, precise=True).astype(v.dtype) @ v
