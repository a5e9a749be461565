"""A model's identity, as the disk tier names its pages: a digest that tells checkpoints apart."""

from __future__ import annotations

import hashlib

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

ENDS = 8  # values read from each end of every weight


def weights_digest(*models: nn.Module | None) -> str:
    """A hex digest of every weight of `models` (None skipped): its name, shape and dtype, and its
    first and last `ENDS` values. Two checkpoints of one architecture differ there, and reading
    so little costs nothing beside loading them."""
    named: list[tuple[str, mx.array]] = []
    for i, model in enumerate(models):
        if model is not None:
            weights = tree_flatten(model.parameters())
            assert isinstance(weights, list)
            named += sorted((f"{i}.{name}", array) for name, array in weights)
    ends = [mx.concatenate([array.reshape(-1)[:ENDS], array.reshape(-1)[-ENDS:]]).view(mx.uint8) for _, array in named]
    mx.eval(ends)
    digest = hashlib.sha256()
    for (name, array), values in zip(named, ends):
        digest.update(f"{name}{tuple(array.shape)}{array.dtype}".encode() + np.asarray(values).tobytes())
    return digest.hexdigest()
