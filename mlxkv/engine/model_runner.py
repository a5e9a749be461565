"""Runs an mlx-lm model over a packed batch, with every attention layer reading K/V through the cache."""

from __future__ import annotations

from collections.abc import Sequence
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
from ..cache.state_batch import state_batch
from ..models.adapters import Adapter, adapter_for
from ..models.rotary import Positions
from ..models.structure import (
    LayerRoles,
    activation_dtype,
    decoder,
    layer_roles,
    logits,
    mlx_lm_module,
    pads_exactly,
    text_model,
)
from .recurrent import RecurrentLayer
from .scheduler import ScheduledBatch
from .step_context import StepContext


class PagedAttention(nn.Module):
    """An mlx-lm attention layer run over the paged cache through its family's adapter.

    Tokens of the packed batch sit on the batch axis, so RoPE takes one offset per token.
    Called with any other cache (mlx-lm's own), it is the original layer, so a model
    handed to mlxkv still runs under mlx-lm.
    """

    def __init__(self, inner: nn.Module, layer: int, adapter: Adapter) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # nn.Module's __init__ has no annotations
        self.inner = inner
        self.layer = layer  # its number among the model's attention layers, as the KV cache counts them
        self.adapter = adapter

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        cache = StepContext.of(args, kwargs)
        if cache is None:
            original: mx.array = self.inner(x, *args, **kwargs)
            return original
        queries, keys, values, gate = self.adapter(x, cache.positions)
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
        out = out.reshape(1, x.shape[1], -1)
        projected: mx.array = self.adapter.out_proj(out if gate is None else out * mx.sigmoid(gate))
        return projected


def _attention(layer: nn.Module) -> nn.Module:
    """A decoder layer's attention module as mlx-lm made it."""
    return mlx_lm_module(layer, LayerRoles.attention_module(layer))


def layer_variants(model: nn.Module) -> list[Variant]:
    """How each attention layer attends (window, soft-cap, sinks), as its family's adapter reads it."""
    model = text_model(model)
    layers = decoder(model).layers
    return [adapter_for(model, i, _attention(layers[i])).variant for i in layer_roles(model).attention]


def kv_shape(model: nn.Module) -> tuple[int, int, int, mx.Dtype]:
    """(attention layers, KV heads, head dim, activation dtype) of a loaded mlx-lm model."""
    model = text_model(model)
    attention = layer_roles(model).attention
    args, attn = model.args, _attention(decoder(model).layers[attention[0]])
    adapter = adapter_for(model, attention[0], attn)
    head_dim = getattr(attn, "head_dim", None) or getattr(args, "head_dim", None) or args.hidden_size // adapter.heads
    return len(attention), adapter.kv_heads, head_dim, activation_dtype(model)


class ModelRunner:
    """Owns the model and the KV cache; turns a scheduled batch into logits for the rows that sample."""

    def __init__(self, model: nn.Module, cache: KVCacheManager, attention: AttentionFn = reference_attention) -> None:
        self.model = model
        self.cache = cache
        self.attention = attention
        roles, layers = layer_roles(model), decoder(model).layers
        self.pads = pads_exactly(model, roles)  # else a step's prefill chunks run one by one
        # Always around mlx-lm's own module: a model handed to a second engine is wrapped afresh, alike.
        for number, index in enumerate(roles.attention):
            name = roles.attention_module(layers[index])
            attn = mlx_lm_module(layers[index], name)
            setattr(layers[index], name, PagedAttention(attn, number, adapter_for(model, index, attn)))
        for number, index in enumerate(roles.recurrent):
            name = roles.recurrent_module(layers[index])
            setattr(layers[index], name, RecurrentLayer(mlx_lm_module(layers[index], name), number))

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
        states = state_batch(kv, self.pads) if self.cache.states is not None else None
        context = StepContext(self.cache, kv, Positions(mx.array(kv.positions)), self.attention, spans, states)
        inner = decoder(self.model)
        hidden: mx.array = inner(mx.array(token_ids)[None], cache=[context] * len(inner.layers))
        return hidden[0]

    def head(self, hidden: mx.array) -> mx.array:
        """Logits for final hidden states."""
        return logits(self.model, hidden)
