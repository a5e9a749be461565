"""Modules a decoder calls without a cache, wrapped to take part in a step (`StepContext.current`).

GPT-2-style decoders add learned absolute position embeddings, looked up from one offset for the
whole batch; a step packs several sequences' tokens into one row, so each needs its own position
(`PositionEmbeddings`). GPT-NeoX's and Lille's decoders apply the head themselves; the runner
wants their final hidden states, to apply the head to the rows that sample alone (`FinalNorm`).
"""

from __future__ import annotations

import mlx.core as mx

from .step_context import StepContext
from .wrapped import Wrapped


class PositionEmbeddings(Wrapped):
    """A decoder's position embedding table: in a step, every lookup is of the step's token
    positions (in the shape of the positions the decoder asked for); outside one, the original."""

    def __call__(self, position_ids: mx.array) -> mx.array:
        step = StepContext.current()
        if step is None:
            original: mx.array = self.inner(position_ids)
            return original
        embedded: mx.array = self.inner(step.positions.array)
        return embedded.reshape(*position_ids.shape, -1)


class FinalNorm(Wrapped):
    """The final norm of a decoder that computes the logits itself: in a step, its output (the
    final hidden states) is left in the step's `final`. The decoder's logits for every token, built
    from it, are then never evaluated (MLX computes lazily)."""

    def __call__(self, x: mx.array) -> mx.array:
        out: mx.array = self.inner(x)
        step = StepContext.current()
        if step is not None:
            step.final.append(out)
        return out
