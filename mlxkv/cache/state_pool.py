"""The recurrent state of a hybrid model's non-attention layers: one entry per sequence, at its state index."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class StateShape:
    """One array a recurrent layer keeps for each sequence (a convolution's tail, a recurrent
    state): its shape without the sequence axis, and its dtype."""

    shape: tuple[int, ...]
    dtype: mx.Dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.size


def state_bytes(layers: Sequence[Sequence[StateShape]]) -> int:
    """Bytes one sequence's state takes across every recurrent layer."""
    return sum(s.nbytes for layer in layers for s in layer)


class StatePool:
    """Every recurrent layer's arrays, `[size, *shape]` each: entry r holds the state of the
    sequence whose state index is r, its row in the KV cache manager.

    An entry therefore has a sequence's lifecycle: taken at admission with the row (all or
    nothing), given back on finish, abort or preemption, never shared. It is not cleared when
    given back; a sequence's first step reads zeros instead (`fresh`), as mlx-lm's layers start
    from no state."""

    def __init__(self, size: int, layers: Sequence[Sequence[StateShape]]) -> None:
        self.size = size
        self.shapes = [tuple(layer) for layer in layers]
        self.arrays = self._zeros()

    def num_arrays(self, layer: int) -> int:
        return len(self.shapes[layer])

    @property
    def bytes_per_sequence(self) -> int:
        """Bytes one sequence's state takes across every recurrent layer."""
        return state_bytes(self.shapes)

    @property
    def nbytes(self) -> int:
        return self.size * self.bytes_per_sequence

    @property
    def tensors(self) -> list[mx.array]:
        """Every array, to evaluate at the end of a step with the K/V pages."""
        return [array for layer in self.arrays for array in layer]

    def read(self, layer: int, indices: mx.array, fresh: mx.array | None) -> list[mx.array]:
        """`layer`'s state of the sequences at `indices`, zeros where `fresh` (their first step)."""
        states = [array[indices] for array in self.arrays[layer]]
        if fresh is None:
            return states
        return [mx.where(fresh.reshape(-1, *([1] * (s.ndim - 1))), 0, s) for s in states]

    def write(self, layer: int, indices: mx.array, values: Sequence[mx.array]) -> None:
        """Store `layer`'s new state of the sequences at `indices`, in the pool's dtypes."""
        for array, value, shape in zip(self.arrays[layer], values, self.shapes[layer]):
            array[indices] = value.astype(shape.dtype)

    def reset(self) -> None:
        """Start every array afresh (no sequence may be open)."""
        self.arrays = self._zeros()

    def _zeros(self) -> list[list[mx.array]]:
        """Zeroed arrays, evaluated: a lazy one could be evaluated only on the thread that made it."""
        arrays = [[mx.zeros((self.size, *s.shape), s.dtype) for s in layer] for layer in self.shapes]
        mx.eval(arrays)
        return arrays
