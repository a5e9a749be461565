"""A hybrid model's recurrent layer run over a packed step, each row's state read from and written
back to its entry in the state pool."""

from __future__ import annotations

import inspect
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache

from ...cache.state_batch import RowGroup
from ...cache.state_pool import StatePool
from ...models.structure import run_recurrent
from .step_context import StepContext
from .wrapped import Wrapped


class RecurrentLayer(Wrapped):
    """An mlx-lm recurrent module (gated delta rule, Mamba, short convolution, a whole RWKV-7 layer)
    run over a step's row groups: one call of the module per group, the decodes of every sequence
    in one and the prefill chunks in the other, never a loop over sequences. Arrays of one entry
    per token beside `x` (RWKV-7's first layer's values) go into the groups with their tokens,
    and such arrays among the outputs come back in packed order. Called with any other cache
    (mlx-lm's own), it is the original module."""

    def __init__(self, inner: nn.Module, index: int) -> None:
        super().__init__(inner)
        self.index = index  # its number among the model's recurrent layers, as the state pool counts them
        self.signature = inspect.signature(inner.__call__)

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> Any:
        context = StepContext.of(args, kwargs)
        if context is None:
            return self.inner(x, *args, **kwargs)
        assert context.states is not None and context.cache.states is not None
        given = self.signature.bind(x, *args, **kwargs).arguments
        extra = {name: value for name, value in list(given.items())[1:] if name not in ("mask", "cache")}
        if "offset" in extra:  # Ling-Linear's linear attention rotates by it: each token's position
            extra["offset"] = context.positions.array[None]
        outputs = [self._run(context.cache.states, group, x[0], extra) for group in context.states.groups]
        return _packed(outputs, context.states.order)

    def _run(self, pool: StatePool, group: RowGroup, packed: mx.array, extra: dict[str, Any]) -> Any:
        """The module's outputs for `group`'s tokens, `[tokens, ...]` in packed order within the group."""
        cache: Any = ArraysCache(pool.num_arrays(self.index))  # mlx-lm's class, not annotated
        cache.cache = pool.read(self.index, group.indices, group.fresh)
        if group.lengths is not None:  # a fresh array per call: mlx-lm's layers count it down in place
            cache.lengths = mx.array(group.lengths)
        rows = {name: _rows(value, group, packed.shape[0]) for name, value in extra.items()}
        if "offset" in rows:
            rows["offset"] = rows["offset"][:, 0]  # each row's first position
        out = run_recurrent(self.inner, _rows(packed[None], group, packed.shape[0]), group.mask, cache, rows)
        pool.write(self.index, group.indices, cache.cache)
        outs = out if isinstance(out, tuple) else (out,)
        tokens = [_tokens(o, group) for o in outs]
        return tuple(tokens) if isinstance(out, tuple) else tokens[0]


def _per_token(value: Any, count: int) -> bool:
    """Whether `value` is an array of one entry per token of a packed step of `count` tokens."""
    return isinstance(value, mx.array) and value.ndim >= 2 and value.shape[:2] == (1, count)


def _rows(value: Any, group: RowGroup, count: int) -> Any:
    """A packed step's per-token array (`[1, count, ...]`) as `group`'s `[rows, length, ...]`;
    anything else as it is."""
    if not _per_token(value, count):
        return value
    tokens = value[0] if group.gather is None else value[0][group.gather]
    return tokens.reshape(group.rows, group.length, *value.shape[2:])


def _tokens(value: Any, group: RowGroup) -> Any:
    """A module output of `group`'s `[rows, length, ...]` as `[tokens, ...]`, padding dropped;
    anything else as it is."""
    if not isinstance(value, mx.array) or value.shape[:2] != (group.rows, group.length):
        return value
    flat = value.reshape(group.rows * group.length, *value.shape[2:])
    return flat if group.valid is None else flat[group.valid]


def _packed(outputs: list[Any], order: mx.array | None) -> Any:
    """The groups' outputs (each an array `[tokens, ...]` or a tuple of them) as one packed step's
    `[1, tokens, ...]`, in packed order."""
    if isinstance(outputs[0], tuple):
        return tuple(_packed(list(parts), order) for parts in zip(*outputs))
    if not isinstance(outputs[0], mx.array):
        return outputs[0]
    out = outputs[0] if len(outputs) == 1 else mx.concatenate(outputs)
    return (out if order is None else out[order])[None]
