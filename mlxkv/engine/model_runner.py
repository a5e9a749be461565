"""Runs an mlx-lm model over a packed batch, with every attention layer reading K/V through the cache."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..attention.backend import AttentionFn
from ..attention.first_chunk import first_chunk_attention
from ..attention.reference import reference_attention
from ..attention.variant import Variant
from ..cache.batch import KVBatch
from ..cache.manager import KVCacheManager
from ..models.adapters import Adapter, adapter_for
from ..models.rotary import Positions
from .scheduler import ScheduledBatch


@dataclass(frozen=True)
class StepContext:
    """Handed to every layer as its `cache`: where this step's tokens go and sit, and how
    many of each row's first tokens attend their own K/V as computed (`own_kv`).

    `own_kv` is None when no row has such tokens, as in every step without quantized pages.
    Model code that asks a cache for a mask gets None (the paged attention masks by
    position itself), and one that reads `offset` gets 0 (adapters use each token's own
    position instead)."""

    cache: KVCacheManager
    batch: KVBatch
    positions: Positions
    attention: AttentionFn
    own_kv: np.ndarray | None
    offset: int = 0

    def make_mask(self, *args: object, **kwargs: object) -> None:
        return None


class PagedAttention(nn.Module):
    """An mlx-lm attention layer run over the paged cache through its family's adapter.

    Tokens of the packed batch sit on the batch axis, so RoPE takes one offset per token.
    Called with any other cache (mlx-lm's own), it is the original layer, so a model
    handed to mlxkv still runs under mlx-lm.
    """

    def __init__(self, inner: nn.Module, layer: int, adapter: Adapter) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # nn.Module's __init__ has no annotations
        self.inner = inner
        self.layer = layer
        self.adapter = adapter

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        cache = kwargs.get("cache", args[-1] if args else None)
        if not isinstance(cache, StepContext):
            original: mx.array = self.inner(x, *args, **kwargs)
            return original
        queries, keys, values = self.adapter(x, cache.positions)
        batch = cache.batch.for_window(self.adapter.variant.window)
        cache.cache.write(self.layer, batch, keys, values)
        out = first_chunk_attention(
            cache.attention,
            queries,
            keys,
            values,
            *cache.cache.kv(self.layer),
            batch,
            cache.own_kv,
            self.adapter.scale,
            self.adapter.variant,
        )
        projected: mx.array = self.inner.o_proj(out.reshape(1, x.shape[1], -1))
        return projected


def layer_variants(model: nn.Module) -> list[Variant]:
    """How each layer attends (window, soft-cap, sinks), as its family's adapter reads it."""
    return [
        adapter_for(model, i, getattr(layer.self_attn, "inner", layer.self_attn)).variant
        for i, layer in enumerate(model.model.layers)
    ]


def kv_shape(model: nn.Module) -> tuple[int, int, int, mx.Dtype]:
    """(layers, KV heads, head dim, activation dtype) of a loaded mlx-lm model."""
    args, attn = model.args, model.model.layers[0].self_attn
    attn = getattr(attn, "inner", attn)
    adapter = adapter_for(model, 0, attn)
    head_dim = getattr(attn, "head_dim", None) or getattr(args, "head_dim", None) or args.hidden_size // adapter.heads
    return len(model.model.layers), adapter.kv_heads, head_dim, model.model.norm.weight.dtype


class ModelRunner:
    """Owns the model and the KV cache; turns a scheduled batch into logits for the rows that sample."""

    def __init__(self, model: nn.Module, cache: KVCacheManager, attention: AttentionFn = reference_attention) -> None:
        self.model = model
        self.cache = cache
        self.attention = attention
        for index, layer in enumerate(model.model.layers):
            if not isinstance(layer.self_attn, PagedAttention):
                layer.self_attn = PagedAttention(layer.self_attn, index, adapter_for(model, index, layer.self_attn))

    def forward(self, step: ScheduledBatch, token_ids: mx.array) -> mx.array | None:
        """Logits `[rows that sample, vocab]` for `step`, whose packed input tokens are
        `token_ids`; None if no row samples (lazy either way)."""
        hidden = self.hidden(token_ids, step.kv, step.own_kv)
        if len(step.samples) == hidden.shape[0] and all(step.samples):  # all decode rows: every token samples
            return self.head(hidden)
        rows = (np.cumsum(step.counts) - 1)[np.asarray(step.samples, dtype=bool)]
        return self.head(hidden[mx.array(rows.astype(np.int32))]) if rows.size else None

    def hidden(self, token_ids: np.ndarray | mx.array, kv: KVBatch, own_kv: Sequence[int]) -> mx.array:
        """The final hidden state `[tokens, hidden]` of a packed batch whose K/V slots `kv` holds,
        the first `own_kv[b]` tokens of row b attending their own K/V as computed (lazy)."""
        spans = np.asarray(own_kv, np.int32) if any(own_kv) else None  # a scan, not an array, in the common case
        context = StepContext(self.cache, kv, Positions(mx.array(kv.positions)), self.attention, spans)
        states: mx.array = self.model.model(mx.array(token_ids)[None], cache=[context] * len(self.model.model.layers))
        return states[0]

    def head(self, hidden: mx.array) -> mx.array:
        """Logits for final hidden states."""
        lm_head = getattr(self.model, "lm_head", None)  # None: tied to the embeddings
        logits: mx.array = (self.model.model.embed_tokens.as_linear if lm_head is None else lm_head)(hidden)
        return logits
