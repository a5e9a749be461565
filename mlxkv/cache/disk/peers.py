"""The disk tiers of a tensor-parallel group: each rank files and reads back its own heads' pages,
under a namespace of its own, and rank 0 decides for all. `DiskMoves` are what rank 0's tier did
since the last step plan (the plan carries them, and the other ranks do the same with the same
pages and keys); a `PeerCheck` asks the other ranks, before a restore, which pages they lack or
are still reading, so that rank 0 restores only pages every rank holds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

READY, READING, MISSING = 0, 1, 2  # a page's state in a tier, as `DiskTier.status` gives it
KEY_WORDS = 8  # a 32-byte page key as int32 words

Move = tuple[int | None, list[int], list[bytes]]  # (the page group's window, its pages, their disk keys)
PeerCheck = Callable[[list[bytes]], tuple[list[bytes], bool]]
"""`(disk keys)`: (those some other rank lacks, whether some other rank is still reading any)."""


@dataclass
class DiskMoves:
    """Pages rank 0 handed its tier to file (`filed`, copies as the step before left them) and pages
    it read back into its pool (`restored`), in order, each a `Move`."""

    filed: list[Move] = field(default_factory=list)
    restored: list[Move] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.filed or self.restored)

    def encode(self) -> np.ndarray:
        """One int32 row a page: filed (0) or restored (1), its group's window (0: full attention), the
        page, and its key's eight words."""
        rows = [
            [kind, window or 0, page, *np.frombuffer(key, "<i4")]
            for kind, moves in enumerate((self.filed, self.restored))
            for window, pages, keys in moves
            for page, key in zip(pages, keys)
        ]
        return np.array(rows, np.int32).reshape(-1, 3 + KEY_WORDS)

    @staticmethod
    def decode(rows: np.ndarray) -> DiskMoves:
        moves = DiskMoves()
        for kind, window, page, *words in rows.reshape(-1, 3 + KEY_WORDS).tolist():
            into = (moves.filed, moves.restored)[kind]
            group = int(window) or None
            if not into or into[-1][0] != group:
                into.append((group, [], []))
            into[-1][1].append(int(page))
            into[-1][2].append(np.array(words, "<i4").tobytes())
        return moves
