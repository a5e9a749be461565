"""One sequence's page table: which physical page holds each of its logical pages."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from ..deprecation import RenamedAttribute
from ..errors import SequenceTooLong, counted
from .pool import PagePool
from .prefix_cache import Marks, chain_keys, marks_in, page_key, root_key


class PageTable:
    """Logical page i of a sequence is physical page `physical[i]` of the pool.

    Token `p` is stored at slot `physical[p // page_size] * page_size + p % page_size`. `physical` is an
    int32 array as long as the longest table, its first `num_pages` entries the pages and zeros
    after them, so a step's slots and page tables are array slices.
    The table grows from the pool as tokens are appended, up to `max_tokens`. With prefix
    caching it starts from the cached pages of its prefix (`reuse_prefix`), publishes each
    page its tokens fill (`publish`; `keys[i]` is the content key of full page i) and, on
    `release`, its partly filled last page, whose tokens it reads then from the token list
    last handed to it.
    """

    __slots__ = (
        "pool",
        "page_size",
        "owner",
        "max_tokens",
        "num_tokens",
        "physical",
        "num_pages",
        "keys",
        "num_computed",
        "dropped",
        "tokens",
        "root",
        "marks",
    )

    def __init__(self, pool: PagePool, owner: Hashable, max_tokens: int, physical: np.ndarray | None = None) -> None:
        """`physical`: where to keep the pages (a zeroed int32 line of a matrix holding many
        tables, so that a batch's tables are one slice of it), else an array of its own."""
        self.pool = pool
        self.page_size = pool.page_size
        self.owner = owner
        self.max_tokens = max_tokens
        self.num_tokens = 0
        self.physical = np.zeros(-(-max_tokens // pool.page_size), np.int32) if physical is None else physical
        self.num_pages = 0
        self.keys: list[bytes] = []
        self.num_computed = 0  # tokens whose K/V are stored, as last published
        self.dropped = 0  # leading pages given back by `slide`
        self.tokens: Sequence[int] = ()  # the sequence's tokens, the first `num_computed` stored
        self.root = root_key(None)  # the parent of page 0's key: set by the salt of `reuse_prefix`
        self.marks: Marks = ()  # folded into the keys of the pages they start in: set by `reuse_prefix`

    @property
    def pages(self) -> list[int]:
        """The pages held, in order (a copy)."""
        pages: list[int] = self.physical[: self.num_pages].tolist()
        return pages

    @property
    def position_base(self) -> int:
        """The slot of token 0 (0 while the table holds no page)."""
        return int(self.physical[0]) * self.page_size if self.num_pages else 0

    @property
    def max_context(self) -> int:
        """How many tokens the pages held now can store without growing."""
        return self.num_pages * self.page_size

    def pages_needed(self, count: int) -> int:
        """How many new pages appending `count` tokens takes; checks the length limit."""
        total = self.num_tokens + count
        if total > self.max_tokens:
            raise SequenceTooLong(self.owner, total, self.max_tokens)
        return max(0, -(-total // self.page_size) - self.num_pages)

    def reserve_pages(self, count: int) -> None:
        """Make room for `count` more tokens without appending them (all or nothing)."""
        self._grow(self.pages_needed(count))

    def append(self, count: int) -> np.ndarray:
        """Append `count` tokens, growing from the pool; returns their slots (int32)."""
        start = self.num_tokens
        self.extend(count, self.pages_needed(count))
        return self.slots(start, self.num_tokens)

    def extend(self, count: int, new_pages: int) -> None:
        """Append `count` tokens taking the `new_pages` that `pages_needed(count)` gave (a caller
        appending to many tables checks them all first, for all or nothing)."""
        self._grow(new_pages)
        self.num_tokens += count

    def _grow(self, new_pages: int) -> None:
        if new_pages:
            self.physical[self.num_pages : self.num_pages + new_pages] = self.pool.alloc(self.owner, new_pages)
            self.num_pages += new_pages

    def slide(self, first_token: int) -> int:
        """Give back the pages holding only tokens before `first_token`, which no query will
        read again (a sliding-window layer's); their entries stay, pointing at page 0, so
        later pages keep their index. Returns how many pages went back."""
        keep = min(max(0, first_token) // self.page_size, self.num_pages)
        gone = self.physical[self.dropped : keep].tolist()
        self.pool.release_pages(self.owner, gone)
        self.physical[self.dropped : keep] = 0
        self.dropped = max(self.dropped, keep)
        return len(gone)

    def slots(self, start: int, stop: int) -> np.ndarray:
        """The slots of tokens `start` .. `stop - 1` (int32), in O(stop - start)."""
        positions = np.arange(start, stop, dtype=np.int64)
        return (
            self.physical[positions // self.page_size].astype(np.int64) * self.page_size + positions % self.page_size
        ).astype(np.int32)

    @property
    def pages_in_use(self) -> int:
        """Pages holding at least one token (a reserved, still empty page is not counted)."""
        return -(-self.num_tokens // self.page_size)

    blocks_in_use = RenamedAttribute("pages_in_use")

    def page_for_token(self, token: int) -> int | None:
        """The page that holds token `token`, or None past the tokens stored."""
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"token must be a non-negative integer, got {token!r}")
        return int(self.physical[token // self.page_size]) if token < self.num_tokens else None

    def slot(self, position: int) -> int:
        if not 0 <= position < self.num_tokens:
            raise IndexError(f"position {position} is outside 0..{self.num_tokens - 1}")
        size = self.page_size
        return int(self.physical[position // size]) * size + position % size

    def reuse_prefix(
        self,
        tokens: Sequence[int],
        salt: str | None = None,
        marks: Marks = (),
        partial: bool = True,
        keys: Sequence[bytes] | None = None,
    ) -> int:
        """Start the empty table from the cache: the pages holding `tokens`' leading full pages,
        up to the first miss, then (with `partial`) the freed, partly filled page that holds the
        tokens after them if there is one (taken over, as this sequence will write into it). The
        last token is never reused, since its logits must be computed: a shared page holding it
        is not taken, a partial one is, and the token is written again. `salt` and `marks`
        (see `prefix_cache`) key every page the sequence publishes; `keys`, if given, are its full
        pages' keys before the last token, computed already. Returns the tokens now in place."""
        if self.num_pages:
            raise ValueError(
                f"sequence {self.owner} already holds pages; a prefix is reused only before its first step"
            )
        self.root, self.marks, size, last = root_key(salt), marks, self.page_size, len(tokens) - 1
        shared = []
        for first in range(0, last // size * size, size):
            key = keys[first // size] if keys is not None else self._key(tokens, first, first + size)
            page = self.pool.lookup(key)
            if page is None:
                break
            shared.append(page)
            self.keys.append(key)
        self.pool.share(self.owner, shared)
        self.physical[: len(shared)] = shared
        self.num_pages = len(shared)
        self.num_tokens = start = len(shared) * size
        for count in range(min(len(tokens) - start, size - 1) if partial else 0, 0, -1):
            page = self.pool.lookup(self._key(tokens, start, start + count))
            if page is not None:
                if last > start:  # it may hold the last token too: that one is computed again
                    self.pool.take_over(self.owner, page)
                    self.physical[self.num_pages] = page
                    self.num_pages += 1
                    self.num_tokens = min(start + count, last)
                break
        self.num_computed, self.tokens = self.num_tokens, tokens
        return self.num_tokens

    def publish(self, tokens: Sequence[int], num_computed: int) -> list[int]:
        """Offer every page filled by the first `num_computed` of `tokens` (K/V now stored) to
        the cache, and keep `tokens` (not a copy: the caller leaves those first ones as they
        are) for `release` to cache a partly filled last page. Returns the indices of the pages
        that now hold content the pool held nowhere else. O(1) unless a page filled."""
        high = min(self.num_tokens, len(tokens))
        if not self.num_computed <= num_computed <= high:
            raise ValueError(f"num_computed={num_computed} is outside {self.num_computed}..{high}")
        size, fresh = self.page_size, []
        for index in range(len(self.keys), num_computed // size):
            self.keys.append(self._key(tokens, index * size, (index + 1) * size))
            if self.pool.publish(int(self.physical[index]), self.keys[-1]):
                fresh.append(index)
        self.num_computed, self.tokens = num_computed, tokens
        return fresh

    def follow(self, keys: list[bytes], num_computed: int) -> list[int]:
        """`publish` for a window group's table, whose pages hold the same tokens as the
        full-attention table keyed `keys`: its full pages among the first `num_computed` tokens
        take those keys. A page that slid out before it was published is not (its content may be
        another's by now). Returns the indices of the pages that now hold content the pool held
        nowhere else. Only full pages are ever published here, so `release` caches no partial one."""
        fresh = []
        for index in range(len(self.keys), num_computed // self.page_size):
            self.keys.append(keys[index])
            if index >= self.dropped and self.pool.publish(int(self.physical[index]), keys[index]):
                fresh.append(index)
        self.num_computed = len(self.keys) * self.page_size
        return fresh

    def start_window(self, keys: list[bytes], first: int, pages: list[int]) -> None:
        """Start an empty window group's table as the prefix of the full pages `keys`, of which it
        holds `pages` (this sequence's already) for pages `first` on, the ones its window still
        reaches; the pages before them count as slid out."""
        end = len(keys)
        if self.num_pages or len(pages) != end - first:
            raise ValueError(f"sequence {self.owner}'s window pages cannot start from {len(pages)} of {end} pages")
        self.physical[first:end] = pages
        self.keys, self.num_pages, self.dropped = list(keys), end, first
        self.num_tokens = self.num_computed = end * self.page_size

    def next_keys(self, tokens: Sequence[int], count: int) -> list[bytes]:
        """The keys of the `count` full pages of `tokens` after the ones this table has keyed."""
        return chain_keys(self._parent, tokens, self.marks, len(self.keys), count, self.page_size)

    def adopt(self, pages: list[int], keys: list[bytes]) -> None:
        """Append full `pages` (this sequence's already, their K/V being written) holding the pages
        `keys` (`next_keys`) to a table that ends on a full, keyed page, and publish them."""
        if self.num_tokens != len(self.keys) * self.page_size or self.num_pages != len(self.keys):
            raise ValueError(f"sequence {self.owner} does not end on a full, keyed page")
        self.physical[self.num_pages : self.num_pages + len(pages)] = pages
        self.num_pages += len(pages)
        for page, key in zip(pages, keys):
            self.keys.append(key)
            self.pool.publish(page, key)
        self.num_tokens = self.num_computed = self.num_pages * self.page_size

    def truncate(self, num_pages: int) -> None:
        """Keep only the first `num_pages` full pages of a table `reuse_prefix` just started, giving
        the rest back: a hybrid model reuses a prefix only as far as it has the recurrent state."""
        if not 0 <= num_pages <= len(self.keys) or self.num_computed != self.num_tokens:
            raise ValueError(f"cannot keep {num_pages} of sequence {self.owner}'s reused pages")
        # deepest first, as `release` gives pages back, so that a prefix's end is evicted before its start
        self.pool.release_pages(self.owner, self.physical[num_pages : self.num_pages].tolist()[::-1])
        self.physical[num_pages : self.num_pages] = 0
        del self.keys[num_pages:]
        self.num_pages = num_pages
        self.num_tokens = self.num_computed = num_pages * self.page_size

    def rewind(self, num_tokens: int) -> None:
        """Forget the tokens past the first `num_tokens` (draft tokens the model rejected, never
        published) and give back the pages that held only them; a partly filled page stays."""
        if not self.num_computed <= num_tokens <= self.num_tokens:
            raise ValueError(
                f"cannot rewind sequence {self.owner} to {num_tokens} of its {counted(self.num_tokens, 'token')}"
            )
        keep = max(-(-num_tokens // self.page_size), self.dropped)
        self.pool.release_pages(self.owner, self.physical[keep : self.num_pages].tolist()[::-1])
        self.physical[keep : self.num_pages] = 0
        self.num_pages = min(self.num_pages, keep)
        self.num_tokens = num_tokens

    @property
    def _parent(self) -> bytes:
        """The key the next page's key chains from."""
        return self.keys[-1] if self.keys else self.root

    def _key(self, tokens: Sequence[int], start: int, stop: int) -> bytes:
        """The key of the page after the last keyed one, holding `tokens[start:stop]`."""
        return page_key(self._parent, tokens[start:stop], marks_in(self.marks, start, stop))

    def release(self) -> int:
        """Return the pages to the pool; returns how many the sequence held. A partly filled
        last page is cached too, under a key for every prefix of the tokens it holds, so that
        a sequence continuing this one (the next chat turn) or starting like it (the same
        prompt again) computes only what is new."""
        start = len(self.keys) * self.page_size
        for stop in range(self.num_computed, start, -1):  # every prefix: a sequence may share only the start
            self.pool.publish(int(self.physical[len(self.keys)]), self._key(self.tokens, start, stop))
        self.physical[: self.num_pages] = 0
        self.keys, self.tokens, self.marks = [], (), ()
        self.num_tokens = self.num_computed = self.dropped = self.num_pages = 0
        return self.pool.free(self.owner)
