"""Pinned prefixes: the pages of a prompt's prefix kept from eviction for a while (what Anthropic's
`cache_control` asks for), so that an agent's next turn finds them even after other traffic has
filled the pool.

A pin holds one reference on each of its pages, so they count as in use and are never evicted.
It lapses when its time is up, when a newer pin needs its place under the bound on pinned pages
(oldest first), or when a request needs pages the pool has not got free (oldest first, before
any request is preempted or kept waiting). A lapsed pin's pages stay cached, as any freed page
with content does, until evicted.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from ..settings import POSITIVE, number, require
from .pool import PagePool


@dataclass(frozen=True)
class Pin:
    """Keep a prompt's first `tokens` tokens cached (whole pages of them) for `ttl_s` seconds."""

    tokens: int
    ttl_s: float = 300.0

    def __post_init__(self) -> None:
        require("tokens", self.tokens, POSITIVE)
        require("ttl_s", self.ttl_s, number(0, low_open=True))


@dataclass
class _Pinned:
    pages: list[int]
    expires: float


class PrefixPins:
    """The pins of one page pool, by the content key of their last page (a prefix pinned again is
    the same pin, its time renewed), holding at most `max_pages` distinct pages together."""

    def __init__(self, pool: PagePool, max_pages: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        self.max_pages = max_pages
        self.clock = clock
        self._pins: OrderedDict[bytes, _Pinned] = OrderedDict()  # oldest first
        self._expiries: list[tuple[float, bytes]] = []  # a heap; entries of renewed pins are stale
        self._count: Counter[int] = Counter()  # pins holding each page

    @property
    def num_pages(self) -> int:
        """Distinct pages pinned."""
        return len(self._count)

    @property
    def references(self) -> int:
        """References the pins hold (a page pinned twice counts twice), as the pool counts them."""
        return self._count.total()

    def pin(self, key: bytes, pages: list[int], ttl_s: float) -> int:
        """Pin `pages` (a prefix's, in order, each allocated) under `key` for `ttl_s` seconds;
        returns how many are pinned: the first `max_pages` at most, older pins lapsing for them."""
        self.expire()
        expires = self.clock() + ttl_s
        pinned = self._pins.get(key)
        if pinned is not None:
            pinned.expires = max(pinned.expires, expires)
            self._pins.move_to_end(key)
            heapq.heappush(self._expiries, (pinned.expires, key))
            return len(pinned.pages)
        pages = pages[: self.max_pages]
        while self._pins and self.num_pages + sum(self._count[p] == 0 for p in pages) > self.max_pages:
            self._lapse(next(iter(self._pins)))
        if not pages:
            return 0
        self.pool.share(("pin", key), pages)
        self._count.update(pages)
        self._pins[key] = _Pinned(pages, expires)
        heapq.heappush(self._expiries, (expires, key))
        return len(pages)

    def expire(self) -> None:
        """Lapse every pin whose time is up."""
        now = self.clock()
        while self._expiries and self._expiries[0][0] <= now:
            expires, key = heapq.heappop(self._expiries)
            pinned = self._pins.get(key)
            if pinned is not None and pinned.expires == expires:
                self._lapse(key)

    def make_room(self, free_pages: int) -> None:
        """Lapse the oldest pins until the pool has `free_pages` free, or no pin is left."""
        while self._pins and self.pool.free_count < free_pages:
            self._lapse(next(iter(self._pins)))

    def clear(self) -> None:
        for key in list(self._pins):
            self._lapse(key)
        self._expiries.clear()

    def _lapse(self, key: bytes) -> None:
        pinned = self._pins.pop(key)
        self.pool.free(("pin", key))
        self._count.subtract(pinned.pages)
        for page in pinned.pages:
            if self._count[page] == 0:
                del self._count[page]
