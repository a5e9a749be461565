"""Which decoder layers of an mlx-lm model attend through the K/V pages, and which keep a recurrent state.

A hybrid family (Qwen3.5, Qwen3-Next, LFM2, Granite 4) interleaves attention layers with layers
that keep a per-sequence state instead of K/V: a gated delta rule's state, a Mamba state, a
short convolution's last inputs. mlx-lm's own `make_cache` says which is which (an
`ArraysCache` for a recurrent layer), and each family names its recurrent module in one of a
few ways.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache

from ..cache.state_pool import StateShape

RECURRENT_MODULES = ("linear_attn", "conv", "mamba")  # Qwen3.5 and Qwen3-Next; LFM2; Granite 4


def text_model(model: nn.Module) -> nn.Module:
    """The model that maps token ids to logits: a multimodal checkpoint's `language_model`
    (Qwen3.5's), else `model` itself."""
    return model.language_model if hasattr(model, "language_model") else model


def activation_dtype(model: nn.Module) -> mx.Dtype:
    """The dtype of `model`'s activations (a text model): its final norm's, never quantized (LFM2
    calls that norm `embedding_norm`)."""
    norm = model.model.norm if hasattr(model.model, "norm") else model.model.embedding_norm
    dtype: mx.Dtype = norm.weight.dtype
    return dtype


@dataclass(frozen=True)
class LayerRoles:
    """The decoder layers, by index, that attend through the K/V pages and that keep a recurrent
    state; the K/V cache numbers the first from 0 and the state pool the second."""

    attention: tuple[int, ...]
    recurrent: tuple[int, ...]

    def recurrent_module(self, layer: nn.Module) -> str:
        """The attribute of a recurrent decoder layer that holds its recurrent module."""
        return next(name for name in RECURRENT_MODULES if hasattr(layer, name))


def layer_roles(model: nn.Module) -> LayerRoles:
    """Each decoder layer's role in `model` (a text model), from the caches mlx-lm makes for it."""
    layers = model.model.layers
    caches = model.make_cache() if hasattr(model, "make_cache") else [None] * len(layers)
    recurrent = tuple(i for i, cache in enumerate(caches) if isinstance(cache, ArraysCache))
    attention = tuple(i for i in range(len(layers)) if i not in recurrent)
    return LayerRoles(attention, recurrent)


def state_shapes(model: nn.Module, roles: LayerRoles) -> list[list[StateShape]]:
    """What each recurrent layer of `model` keeps per sequence, as its module leaves it after one
    token: the shapes without the sequence axis, and the dtypes (mlx-lm keeps a gated delta rule's
    state in float32 whatever the weights are)."""
    if not roles.recurrent:
        return []
    caches, layers = model.make_cache(), model.model.layers
    dtype = activation_dtype(model)
    shapes = []
    for index in roles.recurrent:
        module = getattr(layers[index], roles.recurrent_module(layers[index]))
        cache = caches[index]
        getattr(module, "inner", module)(mx.zeros((1, 1, model.args.hidden_size), dtype), mask=None, cache=cache)
        shapes.append([StateShape(tuple(array.shape[1:]), array.dtype) for array in cache.cache])
    return shapes
