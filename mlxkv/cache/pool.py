"""The host-side page allocator: which physical KV pages are free, who holds each, and which
free pages still hold a cached prefix page."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable

from ..errors import KVCacheExhausted
from ..settings import POSITIVE, require


class PagePool:
    """A fixed set of `num_pages` pages of `page_size` tokens, handed out to requests.

    Pages are reference counted so that full pages can be shared between requests. A full
    page can also be published under a content key (see `prefix_cache`): when its last
    holder frees it, it keeps key and content and waits among the cached free pages, where
    a later `share` can revive it. Allocation takes free pages holding nothing first
    (least recently freed first), then evicts cached ones, least recently used first, and
    drops their keys. Every operation costs O(pages involved), never O(pool). Not
    thread-safe on its own: `KVCacheManager` serialises access.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.capacity: int = require("num_pages", num_pages, POSITIVE)
        self.page_size: int = require("page_size", page_size, POSITIVE)
        self._free: deque[int] = deque(range(num_pages))
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self._refs = [0] * num_pages
        self._owned: dict[Hashable, list[int]] = {}
        self._keys_of: dict[int, list[bytes]] = {}  # a full page has one key, a partial one one per prefix
        self._page_of: dict[bytes, int] = {}
        self.num_evictions = 0
        self.extra_refs = 0  # references beyond a page's first, summed over pages

    @property
    def free_count(self) -> int:
        """Pages an allocation can take, cached ones included."""
        return len(self._free) + len(self._cached_free)

    @property
    def used_count(self) -> int:
        return self.capacity - self.free_count

    @property
    def cached_free_count(self) -> int:
        """Free pages still holding a cached page that a hit would revive."""
        return len(self._cached_free)

    def alloc(self, request_id: Hashable, count: int) -> list[int]:
        """Give `request_id` `count` more pages, all or nothing."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"count must be a non-negative integer, got {count!r}")
        if count > self.free_count:
            raise KVCacheExhausted(count, self.free_count)
        pages = [self._take_free() for _ in range(count)]
        for page in pages:
            self._refs[page] = 1
        if pages:
            self._owned.setdefault(request_id, []).extend(pages)
        return pages

    def share(self, request_id: Hashable, pages: Iterable[int]) -> None:
        """Let `request_id` hold pages that are in use or cached (one more reference each)."""
        pages = list(pages)
        for page in pages:
            if not (isinstance(page, int) and 0 <= page < self.capacity) or (
                self._refs[page] == 0 and page not in self._cached_free
            ):
                raise ValueError(f"page {page!r} is neither an allocated nor a cached page of this pool")
        for page in pages:
            if self._refs[page] == 0:
                del self._cached_free[page]
            else:
                self.extra_refs += 1
            self._refs[page] += 1
        if pages:
            self._owned.setdefault(request_id, []).extend(pages)

    def take_over(self, request_id: Hashable, page: int) -> None:
        """Give `request_id` the cached free `page` to write into: it drops its key, since its
        content is about to change, and is no one else's."""
        if page not in self._cached_free:
            raise ValueError(f"page {page!r} is not a cached free page of this pool")
        del self._cached_free[page]
        self._drop_keys(page)
        self._refs[page] = 1
        self._owned.setdefault(request_id, []).append(page)

    def free(self, request_id: Hashable) -> int:
        """Drop every reference `request_id` holds; returns how many pages it held.

        Pages go back last first, so that of a freed sequence the end of its prefix, which
        fewer requests share, is evicted before its start."""
        pages = self._owned.pop(request_id, [])
        for page in reversed(pages):
            self._unref(page)
        return len(pages)

    def release_pages(self, request_id: Hashable, pages: list[int]) -> None:
        """Drop `request_id`'s references to `pages` alone (those that slid out of a window)."""
        owned = self._owned.get(request_id, [])
        for page in pages:
            owned.remove(page)
            self._unref(page)

    def _unref(self, page: int) -> None:
        """Drop one reference; a page nobody holds goes to the free pages, cached if it has a key."""
        self.extra_refs -= self._refs[page] > 1
        self._refs[page] -= 1
        if self._refs[page] == 0:
            if page in self._keys_of:
                self._cached_free[page] = None
            else:
                self._free.append(page)

    def publish(self, page: int, key: bytes) -> bool:
        """Cache the allocated `page` under the content `key` (a page may get several: one per
        prefix of a partly filled page). Returns False, changing nothing, if a page already
        holds that content."""
        if self._refs[page] == 0:
            raise ValueError(f"page {page} must be allocated to be published")
        if key in self._page_of:
            return False
        self._keys_of.setdefault(page, []).append(key)
        self._page_of[key] = page
        return True

    def lookup(self, key: bytes) -> int | None:
        """The page holding the content `key`, in use or cached, or None."""
        return self._page_of.get(key)

    def key(self, page: int) -> bytes | None:
        """The first content key `page` was published under, or None."""
        return self._keys_of.get(page, [None])[0]

    def forget_cached(self) -> None:
        """Drop every content key (the K/V behind them is gone); cached free pages become plain free pages."""
        self._free.extend(self._cached_free)
        self._cached_free.clear()
        self._keys_of.clear()
        self._page_of.clear()

    def pages(self, request_id: Hashable) -> list[int]:
        """The pages `request_id` holds, in the order it got them (empty if none)."""
        return list(self._owned.get(request_id, ()))

    def ref_count(self, page: int) -> int:
        return self._refs[page]

    def owners(self) -> list[Hashable]:
        """The requests that hold at least one page."""
        return list(self._owned)

    def _take_free(self) -> int:
        if self._free:
            return self._free.popleft()
        page, _ = self._cached_free.popitem(last=False)
        self._drop_keys(page)
        self.num_evictions += 1
        return page

    def _drop_keys(self, page: int) -> None:
        for key in self._keys_of.pop(page):
            del self._page_of[key]
