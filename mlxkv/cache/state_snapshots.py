"""Recurrent states kept for the prefix cache: a hybrid model reuses cached pages only as far as it
also has the state of its recurrent layers at their end."""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import mlx.core as mx

State = list[list[mx.array]]  # every recurrent layer's arrays for one sequence, without the sequence axis


def state_key(page_key: bytes) -> bytes:
    """The key a state kept at the end of the page keyed `page_key` is filed under on disk."""
    return hashlib.sha256(b"mlxkv/state/" + page_key).digest()


class StateSnapshots:
    """At most `capacity` states, each the state of every recurrent layer after the tokens of a
    chain of full pages, keyed by the last page's key; the least recently used goes first. A
    snapshot whose pages have left the prefix cache is never matched again and ages out."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._kept: OrderedDict[bytes, State] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def __contains__(self, key: bytes) -> bool:
        return key in self._kept

    def get(self, key: bytes) -> State:
        self._kept.move_to_end(key)
        return self._kept[key]

    def put(self, key: bytes, state: State) -> None:
        self._kept[key] = state
        self._kept.move_to_end(key)
        while len(self._kept) > self.capacity:
            self._kept.popitem(last=False)

    def clear(self) -> None:
        self._kept.clear()
