"""Runs an mlx-lm model over a packed batch, with every attention layer reading K/V through the cache."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..attention.first_chunk import first_chunk_attention
from ..attention.reference import reference_attention
from ..cache.manager import KVBatch, KVCacheManager
from .scheduler import ScheduledBatch

AttentionFn = Callable[[mx.array, mx.array, mx.array, KVBatch, float], mx.array]


@dataclass(frozen=True)
class StepContext:
    """Handed to every layer as its `cache`: where this step's tokens go and sit, and how
    many of each row's first tokens attend their own K/V as computed (`exact`)."""

    cache: KVCacheManager
    batch: KVBatch
    positions: mx.array
    attention: AttentionFn
    exact: np.ndarray


class PagedAttention(nn.Module):
    """An mlx-lm attention layer's own projections, norms and RoPE, with K/V kept in the cache.

    Tokens of the packed batch sit on the batch axis, so RoPE takes one offset per token.
    Called with any other cache (mlx-lm's own), it is the original layer, so a model
    handed to mlxkv still runs under mlx-lm.
    """

    def __init__(self, inner: nn.Module, layer: int) -> None:
        super().__init__()
        self.inner = inner
        self.layer = layer

    def __call__(self, x: mx.array, mask: object = None, cache: object = None) -> mx.array:
        if not isinstance(cache, StepContext):
            return self.inner(x, mask, cache)
        attn, tokens = self.inner, x.shape[1]
        queries = attn.q_proj(x).reshape(tokens, attn.n_heads, -1)
        keys = attn.k_proj(x).reshape(tokens, attn.n_kv_heads, -1)
        values = attn.v_proj(x).reshape(tokens, attn.n_kv_heads, -1)
        if hasattr(attn, "q_norm"):
            queries, keys = attn.q_norm(queries), attn.k_norm(keys)
        queries = attn.rope(queries[:, :, None], offset=cache.positions)[:, :, 0]
        keys = attn.rope(keys[:, :, None], offset=cache.positions)[:, :, 0]
        cache.cache.write(self.layer, cache.batch, keys, values)
        out = first_chunk_attention(cache.attention, queries, keys, values, *cache.cache.kv(self.layer), cache.batch,
                                    cache.exact, attn.scale)
        return attn.o_proj(out.reshape(1, tokens, -1))


def kv_shape(model: nn.Module) -> tuple[int, int, int, mx.Dtype]:
    """(layers, KV heads, head dim, activation dtype) of a loaded mlx-lm model."""
    args = model.args
    kv_heads = args.num_key_value_heads or args.num_attention_heads
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    return len(model.model.layers), kv_heads, head_dim, model.model.norm.weight.dtype


class ModelRunner:
    """Owns the model and the KV cache; turns a scheduled batch into logits for the rows that sample."""

    def __init__(self, model: nn.Module, cache: KVCacheManager, attention: AttentionFn = reference_attention) -> None:
        self.model = model
        self.cache = cache
        self.attention = attention
        for index, layer in enumerate(model.model.layers):
            if not isinstance(layer.self_attn, PagedAttention):
                layer.self_attn = PagedAttention(layer.self_attn, index)

    def forward(self, step: ScheduledBatch) -> mx.array | None:
        """Logits `[rows that sample, vocab]` for `step`, None if no row samples (lazy either way)."""
        token_ids = np.concatenate([r.pending(n) for r, n in zip(step.requests, step.counts)]).astype(np.int32)
        hidden = self.hidden(token_ids, step.kv, np.asarray(step.exact, np.int32))
        rows = (np.cumsum(step.counts) - 1)[np.asarray(step.samples, dtype=bool)]
        return self.head(hidden[mx.array(rows.astype(np.int32))]) if rows.size else None

    def hidden(self, token_ids: np.ndarray, kv: KVBatch, exact: np.ndarray) -> mx.array:
        """The final hidden state `[tokens, hidden]` of a packed batch whose K/V slots `kv` holds,
        the first `exact[b]` tokens of row b attending their own K/V as computed (lazy)."""
        context = StepContext(self.cache, kv, mx.array(kv.positions), self.attention, exact)
        return self.model.model(mx.array(token_ids)[None], cache=[context] * len(self.model.model.layers))[0]

    def head(self, hidden: mx.array) -> mx.array:
        """Logits for final hidden states."""
        if getattr(self.model, "lm_head", None) is not None:
            return self.model.lm_head(hidden)
        return self.model.model.embed_tokens.as_linear(hidden)
