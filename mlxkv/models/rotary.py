"""RoPE on the CPU as two tables per step, made once and shared by every layer that rotates alike.

On the GPU `mx.fast.rope` is one fused kernel. On the CPU MLX builds it from dozens of ops
(positions, frequencies, cos, sin, halves, concatenation), and each layer pays that twice,
queries and keys, for the same positions (docs/benchmarks.md). At a fixed position RoPE is
linear and pairs the dims of a head: each output dim is its own input times one coefficient
plus its partner's input times another. `Rotation` reads the pairing off the layer's own rope
module once, and `Positions` probes the module once per step for the two coefficient vectors;
rotating a head is then four ops, equal bit for bit to the module (checked when a rotation is
made; a module that fails the check, such as one that scales its input first, keeps being
called as it is).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import mlx.core as mx
import numpy as np

STRUCTURE_POSITIONS = (1, 3, 1000)  # where every rotated dim has a nonzero sine
CHECK_POSITIONS = (0, 1, 2, 5, 17, 100, 1000, 4097, 30000)

Rope = Callable[..., mx.array]


@dataclass(frozen=True, eq=False)
class Rotation:
    """How `rope` rotates heads of `head_dim` in `dtype`: `x * cos + x[..., partner] * sin`,
    with per-position `cos` and `sin` vectors read off the module by two probes."""

    rope: Rope
    partner: mx.array  # `[head_dim]`: the dim each dim is paired with (itself when not rotated)
    leads: mx.array  # `[head_dim]` bool: one dim of each pair, and every unrotated dim
    probes: mx.array  # `[2, head_dim]`: `leads` and its complement, as 0/1 in `dtype`
    key: bytes  # equal for rotations that give equal tables, so they share them

    @classmethod
    def of(cls, rope: Rope, head_dim: int, dtype: mx.Dtype) -> Rotation | None:
        """`rope`'s rotation, or None where tables would not help (off the CPU, or a module that
        rotates nothing) or would not equal the module bit for bit."""
        if mx.default_device() != mx.cpu:
            return None
        partner = _pairing(rope, head_dim)
        if partner is None or np.array_equal(partner, np.arange(head_dim)):  # not pairs, or no rotation at all
            return None
        leads = partner >= np.arange(head_dim)
        probes = mx.array(np.stack([leads, ~leads]).astype(np.float32)).astype(dtype)
        mx.eval(probes)  # kept across steps, which may run on other threads
        rotation = cls(rope, mx.array(partner.astype(np.int32)), mx.array(leads), probes, b"")
        positions = mx.array(CHECK_POSITIONS, mx.int32)
        x = mx.random.normal((len(CHECK_POSITIONS), 2, head_dim), key=mx.random.key(0)).astype(dtype)
        tables = rotation.tables(positions)
        if not mx.array_equal(rotation.apply(x, tables), rope(x[:, :, None], offset=positions)[:, :, 0]).item():
            return None
        key = str(dtype).encode() + b"".join(
            np.array(a.astype(mx.float32)).tobytes() for a in (*tables, rotation.partner)
        )
        return replace(rotation, key=key)

    def tables(self, positions: mx.array) -> tuple[mx.array, mx.array]:
        """(cos, sin), each `[tokens, 1, head_dim]`, at `positions` (lazy)."""
        probes = mx.broadcast_to(self.probes, (positions.size, *self.probes.shape))
        out = self.rope(probes[:, :, None], offset=positions)[:, :, 0]
        lead, other = out[:, :1], out[:, 1:]
        return mx.where(self.leads, lead, other), mx.where(self.leads, other, lead)

    def apply(self, x: mx.array, tables: tuple[mx.array, mx.array]) -> mx.array:
        """`x` (`[tokens, heads, head_dim]`) rotated by `tables` made at its tokens' positions."""
        cos, sin = tables
        return x * cos + mx.take(x, self.partner, axis=-1) * sin


def _pairing(rope: Rope, head_dim: int) -> np.ndarray | None:
    """Each dim's partner under `rope` (itself when it is not rotated), from the module's
    output for each basis vector; None unless every output mixes at most two dims, in pairs."""
    basis = np.eye(head_dim, dtype=np.float32)[:, None, None]
    mixes = np.zeros((head_dim, head_dim), bool)
    for position in STRUCTURE_POSITIONS:
        offsets = mx.full((head_dim,), position, mx.int32)
        mixes |= np.array(rope(mx.array(basis), offset=offsets))[:, 0, 0] != 0
    np.fill_diagonal(mixes, False)
    counts = mixes.sum(axis=0)
    if counts.max(initial=0) > 1:
        return None
    partner = np.where(counts == 1, mixes.argmax(axis=0), np.arange(head_dim))
    return partner if np.array_equal(partner[partner], np.arange(head_dim)) else None


class Positions:
    """One step's token positions, with the tables of each distinct rotation made on first use.

    For multimodal RoPE (Qwen-VL's) a token has three positions (`axes`, `[3, tokens]`: time,
    height, width) and each dim of a head turns by the one `axis_of_dim` names. RoPE turns each
    dim with its pair partner by one frequency, so a head rotated at each axis's positions, each
    dim taken from its axis's rotation, is M-RoPE exactly."""

    def __init__(self, positions: mx.array, axes: mx.array | None = None, axis_of_dim: mx.array | None = None) -> None:
        self.array = positions
        self.axes = axes
        self.axis_of_dim = axis_of_dim
        self._tables: dict[bytes, tuple[mx.array, mx.array]] = {}
        self._by_axis: list[Positions] | None = None

    def by_axis(self) -> list[Positions]:
        """One `Positions` per M-RoPE axis (made once, so that layers share their tables)."""
        assert self.axes is not None
        if self._by_axis is None:
            self._by_axis = [Positions(self.axes[axis]) for axis in range(self.axes.shape[0])]
        return self._by_axis

    def select(self, rotated: list[mx.array]) -> mx.array:
        """Each dim of a head from the rotation at its M-RoPE axis (`rotated[axis]`)."""
        assert self.axis_of_dim is not None
        head_dim, axis = rotated[0].shape[-1], self.axis_of_dim
        if axis.shape[0] < head_dim:  # dims past a partial rotation turn at no axis: any will do
            axis = mx.concatenate([axis, mx.zeros((head_dim - axis.shape[0],), axis.dtype)])
        out = rotated[0]
        for number, other in enumerate(rotated[1:], start=1):
            out = mx.where(axis == number, other, out)
        return out

    def rotate(self, rotation: Rotation, x: mx.array) -> mx.array:
        """`x` (`[tokens, heads, head_dim]`) rotated at these positions."""
        tables = self._tables.get(rotation.key)
        if tables is None:
            tables = self._tables[rotation.key] = rotation.tables(self.array)
        return rotation.apply(x, tables)
