"""One step's sequences as a recurrent layer sees them: rows in at most two batches, and their state indices.

Attention reads a packed step (every row's new tokens one after the other); a recurrent layer
(mlx-lm's gated delta rule, Mamba, short convolution) takes `[rows, length]` with one state per
row. A step's single-token rows (decodes) make one batch of length 1, and its longer rows
(prefill chunks) another, right-padded to the longest with a mask and per-row lengths, which
mlx-lm's layers honour: padded places leave the state as it was. Two batches, not one, so that
a 512-token chunk beside 63 decodes computes 575 places, not 64 x 512. A model whose layers do
not leave a padded row's state exact (Nemotron-H's Mamba mixer) runs each chunk on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .batch import KVBatch


@dataclass(frozen=True, eq=False)
class RowGroup:
    """Rows of one step that a recurrent layer runs as one `[rows, length]` batch.

    `gather` picks, for each of the rows x length places, its token of the packed step (None:
    the packed tokens as they are); `mask` and `lengths` say which places hold a token when rows
    are padded (None: all do); `valid` picks the outputs of those places, in order."""

    indices: mx.array  # the rows' state indices
    fresh: mx.array | None  # rows with no earlier state (None: none)
    rows: int
    length: int
    gather: mx.array | None = None
    mask: mx.array | None = None
    lengths: np.ndarray | None = None
    valid: mx.array | None = None


@dataclass(frozen=True, eq=False)
class StateBatch:
    """A step's row groups, and `order`: for each packed token, where its output sits among the
    groups' outputs taken one group after the other (None: already in packed order)."""

    groups: tuple[RowGroup, ...]
    order: mx.array | None


def state_batch(batch: KVBatch, padded: bool = True) -> StateBatch:
    """`batch`'s rows grouped for recurrent layers (its `state_indices` must be set); the prefill
    chunks in one padded batch, or with `padded` False one batch each."""
    assert batch.state_indices is not None, "a batch of a cache without recurrent state"
    counts, starts = batch.query_lens, batch.query_starts
    single, longer = np.flatnonzero(counts == 1), np.flatnonzero(counts > 1)
    groups, sources = [], []
    if single.size:
        everything = single.size == len(counts)
        gather = None if everything else mx.array(starts[single].astype(np.int32))
        groups.append(RowGroup(*_indices(batch, single), rows=int(single.size), length=1, gather=gather))
        sources.append(starts[single])
    chunks = [] if not longer.size else [longer] if padded else np.split(longer, longer.size)
    for rows in chunks:
        groups.append(_padded(batch, rows, alone=not single.size and len(chunks) == 1))
        sources.append(np.concatenate([np.arange(starts[r], starts[r] + counts[r]) for r in rows]))
    source = np.concatenate(sources) if sources else np.zeros(0, np.int64)
    in_order = bool(np.all(source[1:] > source[:-1]))
    return StateBatch(tuple(groups), None if in_order else mx.array(np.argsort(source).astype(np.int32)))


def _indices(batch: KVBatch, rows: np.ndarray) -> tuple[mx.array, mx.array | None]:
    """The state indices of `rows`, and which of them start fresh (None: none does)."""
    assert batch.state_indices is not None
    fresh = batch.fresh[rows]
    return mx.array(batch.state_indices[rows]), mx.array(fresh) if fresh.any() else None


def _padded(batch: KVBatch, rows: np.ndarray, alone: bool) -> RowGroup:
    """`rows` (of more than one token each) as one batch right-padded to the longest."""
    counts, starts = batch.query_lens[rows], batch.query_starts[rows]
    length = int(counts.max())
    if rows.size == 1:  # one chunk: its tokens as they are, no padding
        gather = None if alone else mx.array(np.arange(starts[0], starts[0] + length, dtype=np.int32))
        return RowGroup(*_indices(batch, rows), rows=1, length=length, gather=gather)
    places = np.arange(length)
    mask = places[None, :] < counts[:, None]
    tokens = starts[:, None] + np.minimum(places[None, :], counts[:, None] - 1)  # padding repeats a row's last token
    return RowGroup(
        *_indices(batch, rows),
        rows=int(rows.size),
        length=length,
        gather=mx.array(tokens.reshape(-1).astype(np.int32)),
        mask=mx.array(mask),
        lengths=counts.astype(np.int32),
        valid=mx.array(np.flatnonzero(mask.reshape(-1)).astype(np.int32)),
    )
