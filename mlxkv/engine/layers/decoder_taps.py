"""Modules a decoder calls without a cache, wrapped to take part in a step (`StepContext.current`).

GPT-2-style decoders add learned absolute position embeddings, looked up from one offset for the
whole batch; a step packs several sequences' tokens into one row, so each needs its own position
(`PositionEmbeddings`). GPT-NeoX's and Lille's decoders apply the head themselves; the runner
wants their final hidden states, to apply the head to the rows that sample alone (`FinalNorm`).
Qwen3-VL adds vision features into its first layers' outputs at the image's rows, which mlx-lm's
text decoder does not know of (`Deepstack`), and turns an image's tokens by three positions each,
where mlx-lm's attention modules, run as they are, turn them by one (`AxisRope`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

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


class Deepstack(Wrapped):
    """A decoder layer among the first ones of a family with deepstack vision features: in a step
    with images, its output takes its `level` of them added at the image's rows."""

    def __init__(self, inner: nn.Module, level: int) -> None:
        super().__init__(inner)
        self.level = level

    def __call__(self, *args: Any, **kwargs: Any) -> mx.array:
        out: mx.array = self.inner(*args, **kwargs)
        step = StepContext.current()
        media = step.media if step is not None else None
        if media is None or len(media.deepstack) <= self.level or not media.rows.size:
            return out
        return out.at[:, media.rows].add(media.deepstack[self.level][None].astype(out.dtype))


class AxisRope(Wrapped):
    """An attention module's RoPE, for a family with multimodal RoPE: in a step whose tokens have
    three positions, each dim turned at its axis's (see `rotary.Positions`); else the original."""

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        step = StepContext.current()
        if step is None or step.positions.axes is None:
            original: mx.array = self.inner(x, offset=offset)
            return original
        return step.positions.select([self.inner(x, offset=axis.array) for axis in step.positions.by_axis()])


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
