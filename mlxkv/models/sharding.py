"""Tensor parallel: a model's layers split across the processes `mlx.launch` started, by mlx-lm's own
`model.shard(group)` (attention heads and MLP columns per rank, two all-reduces per layer)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..errors import ModelLoadError
from .structure import decoder_layers, text_model


def world() -> mx.distributed.Group:
    """The group of every process `mlx.launch` started (a group of one when run on its own)."""
    return mx.distributed.init()


def check_shardable(model: nn.Module, model_type: str, size: int) -> None:
    """Raise `ModelLoadError` unless mlx-lm can split `model` (of `model_type`) over `size` ranks: its
    family must have mlx-lm's tensor-parallel sharding, and every layer's query and KV heads must
    divide by `size` (mlx-lm's split would silently drop the remainder)."""
    if not hasattr(_sharded(model), "shard"):
        raise ModelLoadError(
            f"model_type {model_type!r} has no tensor-parallel sharding in mlx-lm, so it cannot run over "
            f"{size} processes; run it in one process (without mlx.launch)"
        )
    for number, layer in enumerate(decoder_layers(text_model(model))):
        attn = getattr(layer, "self_attn", None)
        for name in (
            "n_heads",
            "n_kv_heads",
            "num_heads",
            "num_kv_heads",
            "num_attention_heads",
            "num_key_value_heads",
        ):
            heads = getattr(attn, name, None)
            if isinstance(heads, int) and heads % size:
                raise ModelLoadError(
                    f"layer {number} of this {model_type!r} model has {heads} {_kind(name)} heads, which do not "
                    f"divide by the {size} processes of the tensor-parallel group; launch a number of processes "
                    "that divides them"
                )


def shard(model: nn.Module, model_type: str, group: mx.distributed.Group) -> None:
    """Split `model` (lazily loaded) across `group` in place, after `check_shardable`."""
    check_shardable(model, model_type, group.size())
    _sharded(model).shard(group)


def _sharded(model: nn.Module) -> nn.Module:
    """What mlx-lm's `shard` splits: the model, or a multimodal wrapper's text model (Mistral 3's)."""
    return model if hasattr(model, "shard") else text_model(model)


def _kind(name: str) -> str:
    return "KV" if "kv" in name or "key_value" in name else "query"
