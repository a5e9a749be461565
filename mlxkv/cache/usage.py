"""A snapshot of the KV cache: pages in use, and how many of their bytes hold tokens."""

from __future__ import annotations

from dataclasses import dataclass

from ..deprecation import RenamedAttribute
from ..errors import counted
from .disk.tier import DiskStats
from .layout import KVLayout


@dataclass(frozen=True)
class KVUsage:
    """How much of the cache is in use and how much of that holds tokens; `str()` is the KV line
    the CLI prints."""

    layout: KVLayout
    pages_used: int
    pages_total: int
    page_size: int
    tokens: int
    bytes_per_token: int
    pages_cached: int = 0  # free pages still holding cached prefix pages
    kv_bits: int | None = None  # quantized pages, else the cache dtype
    windowed: tuple[tuple[int, KVUsage], ...] = ()  # (window, usage) of each sliding-window group's own pages
    states_used: int = 0  # sequences holding a hybrid model's recurrent state (see StatePool)
    states_total: int = 0  # sequences the state pool has room for
    state_bytes: int = 0  # bytes of one sequence's state
    states_kept: int = 0  # states kept for the prefix cache (see StateSnapshots)
    pages_pinned: int = 0  # pages pinned for a while (see PrefixPins), in use
    disk: DiskStats | None = None  # what the disk tier did, if there is one

    block_size = RenamedAttribute("page_size")

    @property
    def bytes_allocated(self) -> int:
        """Bytes of the pages handed to sequences."""
        own = self.pages_used * self.page_size * self.bytes_per_token + self.state_bytes_used
        return own + sum(usage.bytes_allocated for _, usage in self.windowed)

    @property
    def bytes_holding_tokens(self) -> int:
        own = self.tokens * self.bytes_per_token + self.state_bytes_used  # a state in use is all state
        return own + sum(usage.bytes_holding_tokens for _, usage in self.windowed)

    @property
    def state_bytes_used(self) -> int:
        return self.states_used * self.state_bytes

    @property
    def bytes_pool(self) -> int:
        """Bytes of the whole pool, in use or not."""
        states = self.states_total * self.state_bytes
        own = self.pages_total * self.page_size * self.bytes_per_token + states
        return own + sum(usage.bytes_pool for _, usage in self.windowed)

    def __str__(self) -> str:
        pool = self.bytes_pool / 2**30
        size = f"{pool:.2f} GiB" if pool >= 1 else f"{self.bytes_pool / 2**20:.2f} MiB"
        cached = f", {self.pages_cached} more cached" if self.pages_cached else ""
        cached = (f", {self.pages_pinned} pinned" if self.pages_pinned else "") + cached
        bits = f", {self.kv_bits}-bit" if self.kv_bits else ""
        windows = "".join(f", window-{w} layers {u.pages_used}/{u.pages_total}" for w, u in self.windowed)
        kept = f", {self.states_kept} kept for prefix hits" if self.states_kept else ""
        states = (
            f", recurrent state {self.states_used}/{self.states_total} sequences of "
            f"{self.state_bytes / 2**20:.2f} MiB{kept}"
            if self.states_total
            else ""
        )
        return (
            f"{self.layout.value}{bits}, {self.pages_used}/{self.pages_total} pages of "
            f"{counted(self.page_size, 'token')} in use{cached}{windows}{states} (pool {size}), "
            f"{self.bytes_holding_tokens / 2**20:.2f} of {self.bytes_allocated / 2**20:.2f} MiB in use holding tokens"
            f"{_disk_line(self.disk)}"
        )


def _disk_line(disk: DiskStats | None) -> str:
    """The disk tier's part of the KV line: pages restored (bytes read, seconds), bytes written."""
    if disk is None:
        return ""
    return (
        f"; disk: {counted(disk.pages_restored, 'page')} restored ({disk.bytes_read / 2**20:.2f} MiB in "
        f"{disk.restore_seconds:.2f} s), {disk.bytes_written / 2**20:.2f} MiB written"
    )
