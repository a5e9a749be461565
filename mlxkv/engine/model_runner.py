"""Runs an mlx-lm model over a packed batch, with every attention layer reading K/V through the cache."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..attention.backend import AttentionFn, AttentionSpec, choose_attention
from ..attention.first_chunk import first_chunk_attention
from ..attention.heads import Heads
from ..attention.kernels import PagedAttentionKernels
from ..attention.reference import reference_attention
from ..attention.variant import Variant
from ..cache.batch import KVBatch
from ..cache.manager import KVCacheManager
from ..cache.state_batch import state_batch
from ..models.adapters import Adapter, Gemma4Adapter, adapter_for
from ..models.loading import model_context
from ..models.rotary import Positions
from ..models.structure import (
    LayerRoles,
    activation_dtype,
    decoder,
    layer_roles,
    logits,
    mlx_lm_module,
    pads_exactly,
    state_shapes,
    text_model,
)
from .kv_budget import ModelKV
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
        self.layer = layer  # the number of the pages it reads among the cache's layers
        self.adapter = adapter

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        step = StepContext.of(args, kwargs)
        if step is None:
            original: mx.array = self.inner(x, *args, **kwargs)
            return original
        queries, keys, values, gate = self.adapter(x, step.positions)
        out = self.attend(step, queries, keys, values, write=True)
        projected: mx.array = self.adapter.out_proj(out if gate is None else out * mx.sigmoid(gate))
        return projected

    def attend(self, step: StepContext, queries: mx.array, keys: mx.array, values: mx.array, write: bool) -> mx.array:
        """`[1, tokens, heads * head_dim]`: the step's `queries` over this layer's pages, after
        writing the new tokens' `keys` and `values` there if `write`."""
        batch = step.batch.for_window(self.adapter.variant.window)
        if write:
            step.cache.write(self.layer, batch, keys, values)
        out = first_chunk_attention(
            step.attention,
            queries,
            keys,
            values,
            *step.cache.kv(self.layer),
            batch,
            step.own_kv,
            self.adapter.scale,
            self.adapter.variant,
        )
        return out.reshape(1, queries.shape[0], -1)


class SharingAttention(PagedAttention):
    """Gemma 4's attention, which hands its new K/V on to the layers that share them, as mlx-lm's
    does (it returns `(output, (keys, values), offset)`). A KV-shared layer (`shared`) attends the
    pages of the layer it shares with (`layer` is that one's number) and writes none: the cache
    keeps no pages for it."""

    adapter: Gemma4Adapter

    def __init__(self, inner: nn.Module, layer: int, adapter: Gemma4Adapter, shared: bool) -> None:
        super().__init__(inner, layer, adapter)
        self.shared = shared

    def __call__(  # type: ignore[override]  # mlx-lm's Gemma 4 layers return a tuple
        self, x: mx.array, *args: Any, shared_kv: tuple[mx.array, mx.array] | None = None, **kwargs: Any
    ) -> tuple[mx.array, tuple[mx.array, mx.array], Any]:
        step = StepContext.of(args, kwargs)
        if step is None:
            original: tuple[mx.array, tuple[mx.array, mx.array], Any] = self.inner(
                x, *args, shared_kv=shared_kv, **kwargs
            )
            return original
        if self.shared:
            assert shared_kv is not None, "a KV-shared layer is called after the layer it shares with"
            queries, (keys, values) = self.adapter.queries(x, step.positions), shared_kv
        else:
            queries, keys, values, _ = self.adapter(x, step.positions)
        out = self.attend(step, queries, keys, values, write=not self.shared)
        return self.adapter.out_proj(out), (keys, values), kwargs.get("offset")


def _attention(layer: nn.Module) -> nn.Module:
    """A decoder layer's attention module as mlx-lm made it."""
    return mlx_lm_module(layer, LayerRoles.attention_module(layer))


def _adapters(model: nn.Module) -> list[Adapter]:
    """The adapters of `model`'s attention layers with pages of their own, in the cache's order."""
    layers = decoder(model).layers
    return [adapter_for(model, i, _attention(layers[i])) for i in layer_roles(model).attention]


def layer_variants(model: nn.Module) -> list[Variant]:
    """How each attention layer attends (window, soft-cap, sinks), as its family's adapter reads it."""
    return [adapter.variant for adapter in _adapters(text_model(model))]


def kv_shape(model: nn.Module) -> tuple[int, tuple[int, ...], tuple[int, ...], mx.Dtype]:
    """(attention layers, each one's KV heads, each one's head dim, activation dtype) of a loaded
    mlx-lm model."""
    model = text_model(model)
    adapters, args = _adapters(model), model.args
    head_dims = tuple(
        getattr(a.attn, "head_dim", None)
        or getattr(args, "head_dim", None)
        or args.hidden_size // args.num_attention_heads
        for a in adapters
    )
    return len(adapters), tuple(a.kv_heads for a in adapters), head_dims, activation_dtype(model)


def model_kv(model: nn.Module) -> ModelKV:
    """What sizing a KV cache needs to know of a loaded mlx-lm text model (its weights' bytes
    from their shapes: a lazily built model is not evaluated)."""
    layers, kv_heads, head_dims, dtype = kv_shape(model)
    parameters = cast("list[tuple[str, mx.array]]", tree_flatten(model.parameters()))
    weights = sum(array.nbytes for _, array in parameters)
    windows = [variant.window for variant in layer_variants(model)]
    states = state_shapes(model, layer_roles(model))
    return ModelKV(layers, kv_heads, head_dims, dtype, model_context(model), weights, windows, states)


def attention_heads(model: nn.Module) -> Heads:
    """The widest attention layer's heads of a loaded mlx-lm text model (this process's share, under
    tensor parallel), and its dtype's size."""
    _, kv_heads, head_dims, dtype = kv_shape(model)
    return Heads(query_heads(model), max(kv_heads), max(head_dims), dtype.size)


def query_heads(model: nn.Module) -> int:
    """The most query heads an attention layer of `model` computes in this process."""
    return max(int(adapter.heads) for adapter in _adapters(text_model(model)))


def attention_for(
    model: nn.Module, cache: KVCacheManager, choice: str | None, kernels: PagedAttentionKernels | None = None
) -> AttentionFn:
    """The attention `model`'s layers run over `cache` (see `choose_attention`)."""
    _, kv_heads, head_dims, dtype = kv_shape(model)
    spec = AttentionSpec(
        dtype,
        query_heads(model),
        kv_heads,
        head_dims,
        cache.page_size,
        cache.kv_bits,
        cache.kv_group_size,
        layer_variants(model),
    )
    return choose_attention(choice, spec, kernels)


class ModelRunner:
    """Owns the model and the KV cache; turns a scheduled batch into logits for the rows that sample."""

    def __init__(self, model: nn.Module, cache: KVCacheManager, attention: AttentionFn = reference_attention) -> None:
        self.model = model
        self.cache = cache
        self.attention = attention
        roles, layers = layer_roles(model), decoder(model).layers
        self.pads = pads_exactly(model, roles)  # else a step's prefill chunks run one by one
        # Always around mlx-lm's own module: a model handed to a second engine is wrapped afresh, alike.
        numbers = {index: number for number, index in enumerate(roles.attention)}
        for index, source in [(i, None) for i in roles.attention] + list(roles.shares):
            name = roles.attention_module(layers[index])
            attn = mlx_lm_module(layers[index], name)
            adapter, number = adapter_for(model, index, attn), numbers[index if source is None else source]
            wrapped = (
                SharingAttention(attn, number, adapter, source is not None)
                if isinstance(adapter, Gemma4Adapter)
                else PagedAttention(attn, number, adapter)
            )
            setattr(layers[index], name, wrapped)
        for number, index in enumerate(roles.recurrent):
            name = roles.recurrent_module(layers[index])
            setattr(layers[index], name, RecurrentLayer(mlx_lm_module(layers[index], name), number))

    def logits(self, step: ScheduledBatch, hidden: mx.array) -> mx.array | None:
        """Logits for `step` from its final hidden states: a row for each row that samples, and one
        more for each of its draft tokens (`[rows, vocab]`); None if no row samples (lazy either way)."""
        if len(step.samples) == hidden.shape[0] and all(step.samples):  # all decode rows: every token samples
            return self.head(hidden)
        ends = np.cumsum(step.counts)
        rows = [np.arange(end - len(draft) - 1, end) for end, draft, s in zip(ends, step.drafts, step.samples) if s]
        return self.head(hidden[mx.array(np.concatenate(rows).astype(np.int32))]) if rows else None

    def hidden(self, token_ids: np.ndarray | mx.array, kv: KVBatch, own_kv: Sequence[int] | np.ndarray) -> mx.array:
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
