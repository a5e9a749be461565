"""One step's sequences as attention sees them: new tokens packed row after row, and their page tables."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property, lru_cache

import mlx.core as mx
import numpy as np

from ..deprecation import RenamedAttribute


@dataclass(frozen=True, eq=False)
class KVBatch:
    """What attention needs for one packed batch of sequences (host arrays are int32).

    Row b holds `query_lens[b]` new tokens (0 for a plain `fetch`) packed one after the
    other, at positions `context_lens[b] - query_lens[b]` ... `context_lens[b] - 1`; where
    their K/V go (`slot_mapping`) follows from the page tables.
    """

    seq_ids: tuple[int, ...]
    query_lens: np.ndarray
    context_lens: np.ndarray
    page_tables: np.ndarray
    page_size: int
    by_window: dict[int, KVBatch] | None = None  # the same step in each sliding-window group's pages
    state_indices: np.ndarray | None = None  # each row's place in the state pool, for recurrent layers
    blocks: np.ndarray | None = None  # `[tokens, 2]`: the block each new token sees whole, see `with_blocks`

    @cached_property
    def num_tokens(self) -> int:
        return int(self.query_lens.sum())

    @cached_property
    def fresh(self) -> np.ndarray:
        """Rows whose first tokens are in this step: they hold no earlier state."""
        fresh: np.ndarray = self.context_lens == self.query_lens
        return fresh

    @cached_property
    def query_starts(self) -> np.ndarray:
        """Where each row's new tokens begin in the packed batch."""
        starts: np.ndarray = np.cumsum(self.query_lens) - self.query_lens
        return starts

    @cached_property
    def positions(self) -> np.ndarray:
        """The position of every new token, packed like the queries: token i of the batch, in
        row b, is at `context_lens[b] - query_lens[b] + (i - query_starts[b])`."""
        first = self.context_lens - self.query_lens - self.query_starts
        return (np.repeat(first, self.query_lens) + np.arange(self.num_tokens)).astype(np.int32)

    @cached_property
    def token_rows(self) -> np.ndarray:
        """The row of every new token (int32), packed like the queries."""
        return np.repeat(np.arange(len(self.query_lens), dtype=np.int32), self.query_lens)

    @cached_property
    def token_pages(self) -> tuple[np.ndarray, np.ndarray]:
        """The page (int64) and the offset in it of every new token, packed like the queries:
        position p of row b sits in page `page_tables[b][p // page_size]` at `p % page_size`."""
        pages, offsets = np.divmod(self.positions, self.page_size)
        return self.page_tables[self.token_rows, pages].astype(np.int64), offsets

    @cached_property
    def slot_mapping(self) -> np.ndarray:
        """The slot of every new token, packed like the queries (`page * page_size + offset`)."""
        pages, offsets = self.token_pages
        slots: np.ndarray = (pages * self.page_size + offsets).astype(np.int32)
        return slots

    def head_slots(self, kv_heads: int) -> mx.array:
        """Where each new token's K/V go in one layer's K (or V) pages seen as one vector a slot and
        KV head (`[pages * kv_heads * page_size, head_dim]`): an index per token and KV head, token-major."""
        return _head_slots(self, kv_heads)

    def for_window(self, window: int | None) -> KVBatch:
        """The batch of the layers with this sliding window (their own pages), else this one."""
        return self.by_window.get(window, self) if self.by_window and window is not None else self

    def with_blocks(self, blocks: np.ndarray | None) -> KVBatch:
        """The same step in which each new token i also sees every key of its block, positions
        `blocks[i, 0]` to `blocks[i, 1] - 1` (an empty range: none), later ones included: Gemma 4
        attends both ways within an image. A step's chunk holds each block whole (`Scheduler`)."""
        if blocks is None:
            return self
        windows = {w: replace(b, blocks=blocks) for w, b in self.by_window.items()} if self.by_window else None
        return replace(self, by_window=windows, blocks=blocks)

    def select(self, rows: np.ndarray) -> KVBatch:
        """The same step for these rows only (their tokens packed in the same order)."""
        return _selected(self, tuple(np.asarray(rows).tolist()))

    block_tables = RenamedAttribute("page_tables")

    def skip(self, leading: np.ndarray) -> KVBatch:
        """The same step without each row's first `leading[b]` new tokens (its last ones stay)."""
        return _skipped(self, tuple(np.asarray(leading).tolist()))


# Cached per batch, so that every layer of a step gets the same derived batch and arrays, and what
# attention derives from a batch is made once per step rather than once per layer.
@lru_cache(maxsize=8)
def _selected(batch: KVBatch, rows: tuple[int, ...]) -> KVBatch:
    index = np.array(rows, np.int64)
    starts, lens = batch.query_starts[index], batch.query_lens[index]
    return KVBatch(
        tuple(batch.seq_ids[r] for r in rows),
        batch.query_lens[index],
        batch.context_lens[index],
        batch.page_tables[index],
        batch.page_size,
        state_indices=None if batch.state_indices is None else batch.state_indices[index],
        blocks=_blocks_of(batch, np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lens)] or [np.zeros(0)])),
    )


@lru_cache(maxsize=8)
def _skipped(batch: KVBatch, leading: tuple[int, ...]) -> KVBatch:
    kept = batch.positions >= np.repeat(batch.context_lens - batch.query_lens + np.array(leading), batch.query_lens)
    return KVBatch(
        batch.seq_ids,
        (batch.query_lens - np.array(leading)).astype(np.int32),
        batch.context_lens,
        batch.page_tables,
        batch.page_size,
        state_indices=batch.state_indices,
        blocks=_blocks_of(batch, np.flatnonzero(kept)),
    )


def _blocks_of(batch: KVBatch, tokens: np.ndarray) -> np.ndarray | None:
    """The blocks of `batch`'s new tokens `tokens` (packed indices), None where none is in one."""
    if batch.blocks is None:
        return None
    blocks = batch.blocks[tokens.astype(np.int64)]
    return blocks if (blocks[:, 1] > blocks[:, 0]).any() else None


@lru_cache(maxsize=8)
def _head_slots(batch: KVBatch, kv_heads: int) -> mx.array:
    pages, offsets = batch.token_pages
    slots = (pages[:, None] * kv_heads + np.arange(kv_heads)) * batch.page_size + offsets[:, None]
    return mx.array(slots.reshape(-1).astype(np.int32))
