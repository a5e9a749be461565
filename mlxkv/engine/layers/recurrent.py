"""A hybrid model's recurrent layer run over a packed step, each row's state read from and written
back to its entry in the state pool."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache

from ...cache.state_batch import RowGroup
from ...cache.state_pool import StatePool
from ...models.structure import run_recurrent
from .step_context import StepContext


class RecurrentLayer(nn.Module):
    """An mlx-lm recurrent module (gated delta rule, Mamba, short convolution) run over a step's
    row groups: one call of the module per group, the decodes of every sequence in one and the
    prefill chunks in the other, never a loop over sequences. Called with any other cache
    (mlx-lm's own), it is the original module."""

    def __init__(self, inner: nn.Module, index: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # nn.Module's __init__ has no annotations
        self.inner = inner
        self.index = index  # its number among the model's recurrent layers, as the state pool counts them

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        context = StepContext.of(args, kwargs)
        if context is None:
            original: mx.array = self.inner(x, *args, **kwargs)
            return original
        assert context.states is not None and context.cache.states is not None
        packed = x[0]
        outputs = [self._run(context.cache.states, group, packed) for group in context.states.groups]
        out = outputs[0] if len(outputs) == 1 else mx.concatenate(outputs)
        order = context.states.order
        return (out if order is None else out[order])[None]

    def _run(self, pool: StatePool, group: RowGroup, packed: mx.array) -> mx.array:
        """The module's output for `group`'s tokens, in packed order within the group."""
        tokens = packed if group.gather is None else packed[group.gather]
        cache: Any = ArraysCache(pool.num_arrays(self.index))  # mlx-lm's class, not annotated
        cache.cache = pool.read(self.index, group.indices, group.fresh)
        if group.lengths is not None:  # a fresh array per call: mlx-lm's layers count it down in place
            cache.lengths = mx.array(group.lengths)
        out = run_recurrent(self.inner, tokens.reshape(group.rows, group.length, -1), group.mask, cache)
        pool.write(self.index, group.indices, cache.cache)
        out = out.reshape(group.rows * group.length, -1)
        return out if group.valid is None else out[group.valid]
