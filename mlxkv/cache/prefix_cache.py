"""Content addresses for full KV pages, so that sequences with a common prefix share its pages.

Page i of a sequence is named by a chain: its key hashes page i-1's key and page i's token
ids, and page 0's parent is a root made from the sequence's `cache_salt`. A page also hashes the
marks that start in it: digests of content its token ids do not tell (an image's pixels, whose
placeholder tokens are alike for every image of a size). Equal keys mean equal salts, equal tokens
and equal marks from the start of the sequence up to the end of the page, so equal K/V.
The hash is sha256 (as vLLM's after its collision advisory): a collision would
show one request another's context, so Python's `hash()` will not do.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

_DOMAIN = b"mlxkv/prefix-cache/v1"


def root_key(salt: str | None) -> bytes:
    """The parent of a sequence's first page: requests with different salts share nothing."""
    tag = b"\x00" if salt is None else b"\x01" + salt.encode("utf-8", "surrogatepass")
    return hashlib.sha256(_DOMAIN + tag).digest()


Marks = tuple[tuple[int, bytes], ...]
"""`(position, digest)` pairs, by position: what the tokens from `position` on depend on besides their ids."""


def page_key(parent: bytes, tokens: Sequence[int], marks: bytes = b"") -> bytes:
    """The key of a page holding `tokens`, after the page keyed `parent`, with the digests of the
    marks starting in it (`marks_in`)."""
    return hashlib.sha256(parent + np.asarray(tokens, dtype="<i8").tobytes() + marks).digest()


def chain_keys(parent: bytes, tokens: Sequence[int], marks: Marks, first: int, count: int, size: int) -> list[bytes]:
    """The keys of full pages `first` to `first + count - 1` of `tokens` (pages of `size`), page
    `first`'s parent being `parent`."""
    keys = []
    for index in range(first, first + count):
        start = index * size
        parent = page_key(parent, tokens[start : start + size], marks_in(marks, start, start + size))
        keys.append(parent)
    return keys


def marks_in(marks: Marks, start: int, stop: int) -> bytes:
    """The digests of `marks` at positions `start` to `stop` (exclusive), joined."""
    return b"".join(digest for position, digest in marks if start <= position < stop)


def check_salt(salt: object) -> str | None:
    """`salt` if it is None or a non-empty string (an empty salt would look like a mistake)."""
    if salt is None or (isinstance(salt, str) and salt):
        return salt
    raise ValueError(f"cache_salt must be None or a non-empty string, got {salt!r}")


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache when requests were first admitted, and
    how many of them were found there instead of computed."""

    prompt_tokens: int = 0
    cached_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def record(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens
