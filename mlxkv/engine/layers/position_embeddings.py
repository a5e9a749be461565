"""Learned absolute position embeddings (GPT-2's `wpe`) over a packed step."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .step_context import StepContext
from .wrapped import Wrapped


class PositionEmbeddings(Wrapped):
    """A decoder's position embedding table in a step: the decoder looks positions up from one
    offset for its whole batch, but a packed step's tokens each sit at their own position, so
    while the runner has set `step`, every lookup is of the step's token positions instead (in the
    shape of the positions the decoder asked for). Without a step, it is the original table."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__(inner)
        self.step: StepContext | None = None

    def __call__(self, position_ids: mx.array) -> mx.array:
        if self.step is None:
            original: mx.array = self.inner(position_ids)
            return original
        embedded: mx.array = self.inner(self.step.positions.array)
        return embedded.reshape(*position_ids.shape, -1)
