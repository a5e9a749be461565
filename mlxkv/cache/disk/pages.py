"""The pages a cache manager keeps on its disk tier: it files each page it publishes (a copy as the
step left it), and restores any it holds; in a tensor-parallel group's rank 0, only those every
other rank has said it holds read, and what it files and restores is kept as moves for the others
to repeat (see `peers`)."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from ...errors import MlxkvError
from ..storage import KVStorage
from .peers import DiskMoves, Move, PeerCheck
from .tier import DiskTier


class DiskPages:
    """`tier`'s pages as a cache manager files and restores them (see the module)."""

    def __init__(self, tier: DiskTier) -> None:
        self.tier = tier
        self.moves: DiskMoves | None = None  # kept for the other ranks (None: there are none)
        self._peers: PeerCheck | None = None
        self._lacking: set[bytes] = set()  # disk keys some other rank does not hold
        self._agreed: set[bytes] | None = None  # those every other rank holds read (None: not asked)

    def share(self, peers: PeerCheck) -> None:
        """Keep moves for a tensor-parallel group's other ranks, and restore only what `peers` says
        they all hold read."""
        self.moves, self._peers = DiskMoves(), peers

    def take_moves(self) -> DiskMoves | None:
        """The moves since the last call (None without other ranks)."""
        moves = self.moves
        if moves is not None:
            self.moves = DiskMoves()
        return moves

    def weigh(self) -> None:
        """Start weighing a request: what may be restored is what this tier holds, until `ready` asks."""
        self._agreed = None

    def may_restore(self, key: bytes) -> bool:
        """Whether the page filed under `key` may be restored: this tier holds it, no other rank lacks
        it, and once `ready` has asked, every other rank holds it read."""
        if self._agreed is None:
            return key in self.tier and key not in self._lacking
        return key in self._agreed

    def found(self, keys: Sequence[bytes]) -> int:
        """How many of `keys` (a chain) may be restored before the first that may not."""
        if self._agreed is None and not self._lacking:
            return self.tier.found(keys)
        return next((i for i, key in enumerate(keys) if not self.may_restore(key)), len(keys))

    def ready(self, wanted: list[bytes]) -> bool:
        """Whether the pages `wanted` are read, by this tier (a read ahead starts here) and every
        other rank's: only then, and only at the admission that follows, may they be restored.
        Those some other rank lacks are never restored (the request is weighed again without them)."""
        self._agreed = set() if self._peers is not None else None
        if not wanted:
            return True
        if not self.tier.prefetch(wanted):
            return False
        if self._peers is None:
            return True
        lacking, reading = self._peers(wanted)
        self._lacking.update(lacking)
        if lacking or reading:
            return False
        self._agreed = set(wanted)
        return True

    def admitted(self) -> None:
        """An agreement holds for the one admission it was asked for."""
        if self._peers is not None:
            self._agreed = set()

    def file(self, storage: KVStorage, window: int | None, pages: list[int], keys: list[bytes]) -> None:
        """Hand the tier copies of `pages` of `storage` (the page group of `window`), as the last step
        left them, to file under `keys` (those it does not hold)."""
        missing = self.tier.missing(keys)
        if missing:
            self.tier.put([keys[i] for i in missing], storage.page_arrays([pages[i] for i in missing]))
        self._keep(self.moves.filed if self.moves is not None else None, (window, pages, keys))

    def restored(self, window: int | None, pages: list[int], keys: list[bytes]) -> None:
        """The pages filed under `keys` were read into `pages` of the page group of `window`."""
        self._keep(self.moves.restored if self.moves is not None else None, (window, pages, keys))

    def follow(self, moves: DiskMoves, storages: dict[int | None, KVStorage]) -> None:
        """Do what rank 0's tier did (`moves`): file the same pages, read the same pages back into
        the same places. MlxkvError if a page rank 0 restored is not here: rank 0 asked first, so
        only a file lost since then does that."""
        for window, pages, keys in moves.filed:
            self.file(storages[window], window, pages, keys)
        for window, pages, keys in moves.restored:
            arrays: list[mx.array] = self.tier.read(keys)
            if not arrays or arrays[0].shape[0] != len(keys):
                raise MlxkvError(f"this rank's disk cache lost {len(keys)} pages that rank 0 restored")
            storages[window].put_pages(pages, arrays)

    @staticmethod
    def _keep(into: list[Move] | None, move: Move) -> None:
        if into is not None and move[1]:
            into.append(move)
