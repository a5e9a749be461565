"""What the engine needs to know of a loaded mlx-lm model's attention to size and read a KV cache:
its layers' K/V shape, dtype and windows (`ModelKV`, `model_kv`), its query heads, and the
attention path its layers run."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..attention.backend import AttentionFn, AttentionSpec, choose_attention
from ..attention.heads import Heads
from ..attention.kernels import PagedAttentionKernels
from ..attention.variant import Variant
from ..cache.manager import KVCacheManager
from ..cache.state_pool import StateShape, state_bytes
from ..cache.storage import PerLayer
from ..models.adapters import Adapter, LatentAdapter, ModuleAdapter, adapter_for
from ..models.loading import model_context
from ..models.structure import (
    activation_dtype,
    attention_module,
    decoder_layers,
    layer_roles,
    model_args,
    state_shapes,
    text_model,
)


@dataclass(frozen=True)
class ModelKV:
    """What sizing a KV cache needs to know of a model: its attention layers' K/V shape (KV heads and
    head dim: one for all layers, or each layer's) and dtype, its own context (None if its config
    gives none), its weights' bytes, each attention layer's sliding window (None: full), what
    each recurrent layer of a hybrid keeps per sequence, and the layers whose keys are their
    values (multi-head latent attention's)."""

    num_layers: int
    num_kv_heads: PerLayer
    head_dim: PerLayer
    dtype: mx.Dtype
    context: int | None = None
    weights_bytes: int = 0
    layer_windows: Sequence[int | None] | None = None
    state_shapes: Sequence[Sequence[StateShape]] = ()
    keys_only: Sequence[int] = ()

    @property
    def state_bytes_per_sequence(self) -> int:
        return state_bytes(self.state_shapes)


def _adapters(model: nn.Module) -> list[Adapter | ModuleAdapter | LatentAdapter]:
    """The adapters of `model`'s attention layers with pages of their own, in the cache's order."""
    layers = decoder_layers(model)
    return [adapter_for(model, i, attention_module(layers[i])) for i in layer_roles(model).attention]


def layer_variants(model: nn.Module) -> list[Variant]:
    """How each attention layer attends (window, soft-cap, sinks), as its family's adapter reads it."""
    return [adapter.variant for adapter in _adapters(text_model(model))]


def kv_shape(model: nn.Module) -> tuple[int, tuple[int, ...], tuple[int, ...], mx.Dtype]:
    """(attention layers, each one's KV heads, each one's head dim, activation dtype) of a loaded
    mlx-lm model."""
    model = text_model(model)
    return _shape(model, _adapters(model))


def _shape(
    model: nn.Module, adapters: list[Adapter | ModuleAdapter | LatentAdapter]
) -> tuple[int, tuple[int, ...], tuple[int, ...], mx.Dtype]:
    """`kv_shape` of a text model whose adapters are `adapters`."""
    args = model_args(model)
    head_dims = tuple(
        getattr(a, "head_dim", None)
        or getattr(a.attn, "head_dim", None)
        or getattr(args, "head_dim", None)
        or args.hidden_size // args.num_attention_heads
        for a in adapters
    )
    return len(adapters), tuple(a.kv_heads for a in adapters), head_dims, activation_dtype(model)


def model_kv(model: nn.Module) -> ModelKV:
    """What sizing a KV cache needs to know of a loaded mlx-lm text model (its weights' bytes
    from their shapes: a lazily built model is not evaluated)."""
    text = text_model(model)
    adapters = _adapters(text)  # each layer's module probed once (see `ModuleAdapter`)
    layers, kv_heads, head_dims, dtype = _shape(text, adapters)
    parameters = cast("list[tuple[str, mx.array]]", tree_flatten(model.parameters()))
    weights = sum(array.nbytes for _, array in parameters)
    windows = [adapter.variant.window for adapter in adapters]
    states = state_shapes(model, layer_roles(model))
    keys_only = [i for i, adapter in enumerate(adapters) if isinstance(adapter, LatentAdapter)]
    return ModelKV(layers, kv_heads, head_dims, dtype, model_context(model), weights, windows, states, keys_only)


def attention_heads(model: nn.Module) -> Heads:
    """The widest attention layer's heads of a loaded mlx-lm text model (this process's share, under
    tensor parallel), and its dtype's size; no heads (zeros) for a model without attention layers."""
    _, kv_heads, head_dims, dtype = kv_shape(model)
    return Heads(query_heads(model), max(kv_heads, default=0), max(head_dims, default=0), dtype.size)


def query_heads(model: nn.Module) -> int:
    """The most query heads an attention layer of `model` computes in this process (0: it has none)."""
    return max((int(adapter.heads) for adapter in _adapters(text_model(model))), default=0)


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
