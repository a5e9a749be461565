"""The host-side page allocator: which physical KV pages are free and who holds each."""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable

from ..errors import KVCacheExhausted, positive_int


class PagePool:
    """A fixed set of `num_pages` pages of `page_size` tokens, handed out to requests.

    Pages are reference counted so that full pages can be shared between requests
    (prefix caching): a page returns to the free queue when its last holder frees it.
    The free queue is FIFO, so the least recently freed page is reused first.
    Every operation costs O(pages involved), never O(pool). Not thread-safe on its
    own: `KVCacheManager` serialises access.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.capacity = positive_int("num_pages", num_pages)
        self.page_size = positive_int("page_size", page_size)
        self._free: deque[int] = deque(range(num_pages))
        self._refs = [0] * num_pages
        self._owned: dict[Hashable, list[int]] = {}

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def used_count(self) -> int:
        return self.capacity - len(self._free)

    def alloc(self, request_id: Hashable, count: int) -> list[int]:
        """Give `request_id` `count` more pages, all or nothing."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"count must be a non-negative integer, got {count!r}")
        if count > len(self._free):
            raise KVCacheExhausted(count, len(self._free))
        pages = [self._free.popleft() for _ in range(count)]
        for page in pages:
            self._refs[page] = 1
        if pages:
            self._owned.setdefault(request_id, []).extend(pages)
        return pages

    def share(self, request_id: Hashable, pages: Iterable[int]) -> None:
        """Let `request_id` hold pages that are already in use (one more reference each)."""
        pages = list(pages)
        for page in pages:
            if not (isinstance(page, int) and 0 <= page < self.capacity) or self._refs[page] == 0:
                raise ValueError(f"page {page!r} is not an allocated page of this pool")
        for page in pages:
            self._refs[page] += 1
        if pages:
            self._owned.setdefault(request_id, []).extend(pages)

    def free(self, request_id: Hashable) -> int:
        """Drop every reference `request_id` holds; returns how many pages it held."""
        pages = self._owned.pop(request_id, [])
        for page in pages:
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free.append(page)
        return len(pages)

    def pages(self, request_id: Hashable) -> list[int]:
        """The pages `request_id` holds, in the order it got them (empty if none)."""
        return list(self._owned.get(request_id, ()))

    def ref_count(self, page: int) -> int:
        return self._refs[page]

    def owners(self) -> list[Hashable]:
        """The requests that hold at least one page."""
        return list(self._owned)
