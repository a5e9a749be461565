"""A page group: layers that keep pages of their own, in a pool of their own, with a page table per
sequence. The full-attention layers are one; in the paged layout the layers of each sliding window
are another, where a sequence holds only the pages its window reaches."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .batch import KVBatch
from .layout import KVLayout
from .page_table import PageTable
from .pool import PagePool
from .storage import KVStorage
from .usage import KVUsage


@dataclass
class PageGroup:
    """The layers of one window (`window` None: full attention): their pool, their K/V storage, a
    page table per sequence, and the tables' pages as a matrix, a line per sequence index (the
    manager's)."""

    window: int | None
    layers: list[int]
    pool: PagePool
    storage: KVStorage
    tables: dict[int, PageTable]
    matrix: np.ndarray

    @property
    def kind(self) -> str:
        """What its pages are called in an error: the full-attention layers' are just pages."""
        return "pages" if self.window is None else f"pages of window-{self.window} layers"

    def reach(self, end: int) -> int:
        """The first of a prefix's `end` full pages that the token after them still sees (0 for
        full attention): a window group needs only those to continue the prefix."""
        if self.window is None:
            return 0
        return max(0, end * self.pool.page_size - self.window + 1) // self.pool.page_size

    def disk_key(self, key: bytes) -> bytes:
        """The key its page of content `key` is filed under on disk: the full-attention pages'
        own; a window group's qualified by its window, as its pages hold other layers' K/V."""
        if self.window is None:
            return key
        return hashlib.sha256(b"mlxkv/window/%d/" % self.window + key).digest()

    def batch(
        self,
        seq_ids: Sequence[int],
        indices: list[int],
        query_lens: np.ndarray,
        max_pages: int,
        states: np.ndarray | None,
        by_window: dict[int, KVBatch] | None = None,
    ) -> KVBatch:
        """The sequences' batch in this group's pages (`indices`: theirs in the manager), their page
        tables padded to a power of two pages (at most `max_pages`), so that kernels see few shapes."""
        tables = [self.tables[seq_id] for seq_id in seq_ids]
        width = min(max_pages, 1 << max(0, max((t.num_pages for t in tables), default=1) - 1).bit_length())
        context_lens = np.array([t.num_tokens for t in tables], np.int32)
        page_size = self.pool.page_size
        return KVBatch(
            tuple(seq_ids), query_lens, context_lens, self.matrix[indices, :width], page_size, by_window, states
        )

    def usage(self, layout: KVLayout) -> KVUsage:
        """A sliding-window group's use: its tokens are those its pages still hold (a page that
        several sequences share counts once)."""
        pool, page_size = self.pool, self.pool.page_size
        tokens = sum(t.num_tokens - t.dropped * page_size for t in self.tables.values()) - pool.extra_refs * page_size
        return KVUsage(layout, pool.used_count, pool.capacity, page_size, tokens, self.storage.bytes_per_token)


def window_pool_pages(window: int, page_size: int, max_num_seqs: int, step_tokens: int) -> int:
    """Pages a window group needs so that it never runs out: each sequence's window plus a page
    on either side, and the new tokens of one step of at most `step_tokens`."""
    return max_num_seqs * (-(-window // page_size) + 2) + -(-step_tokens // page_size)
