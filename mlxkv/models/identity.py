"""A model's identity, as the disk tier names its pages: a digest that tells checkpoints apart."""

from __future__ import annotations

import hashlib

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

ENDS = 8  # values read from each end of every weight


def weights_digest(*models: nn.Module | None) -> str:
    """A hex digest of the weights of `models` (None skipped): each weight's shape and dtype and its
    first and last `ENDS` values, in an order of their own, so that a model mlxkv has wrapped (whose
    parameters then have other names) digests as it did before. Two checkpoints of one
    architecture differ there, and reading so little costs nothing beside loading them."""
    weights = list({id(a): a for model in models if model is not None for a in _parameters(model)}.values())
    ends = [mx.concatenate([a.reshape(-1)[:ENDS], a.reshape(-1)[-ENDS:]]).view(mx.uint8) for a in weights]
    mx.eval(ends)
    entries = sorted(f"{tuple(a.shape)}{a.dtype}".encode() + np.asarray(e).tobytes() for a, e in zip(weights, ends))
    return hashlib.sha256(b"".join(entries)).hexdigest()


def _parameters(model: nn.Module) -> list[mx.array]:
    flat = tree_flatten(model.parameters())
    return [value for _, value in flat if isinstance(value, mx.array)] if isinstance(flat, list) else []
