"""The run writer: a thread that files pages on disk, so that a step never waits for the disk.

The engine hands it pages whose K/V evaluation it has started (`mx.async_eval`): reading an
array whose evaluation is under way waits for it on any thread, while starting one needs the
engine's. Its queue is bounded in bytes: past `queue_bytes`, or when the disk is nearly full,
pages are dropped (counted, and said once), never waited for. At the interpreter's exit every
writer still open writes what it has queued.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from .run_file import SUFFIX, write_run

if TYPE_CHECKING:
    from .tier import DiskTier

logger = logging.getLogger(__name__)
_OPEN: weakref.WeakSet[RunWriter] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for writer in list(_OPEN):
        writer.close()


class RunWriter:
    """Writes each submitted run of pages to one file of `tier`'s folder, in order."""

    def __init__(self, tier: DiskTier, queue_bytes: int) -> None:
        self.tier = tier
        self.queue_bytes = queue_bytes
        self._queue: deque[tuple[list[bytes], list[tuple[str, mx.array]], int]] = deque()
        self._queued = 0
        self._busy = False
        self._closed = False
        self._warned = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="mlxkv-disk-writer", daemon=True)
        self._thread.start()
        _OPEN.add(self)

    def submit(self, keys: list[bytes], arrays: list[tuple[str, mx.array]]) -> None:
        """Queue the pages `keys`: each array as `(its dtype's name, its bytes as uint8)`."""
        size = sum(a.nbytes for _, a in arrays)
        with self._changed:
            if self._closed or self._queued + size > self.queue_bytes:
                self._drop("its queue is full")
                return
            self._queue.append((keys, arrays, size))
            self._queued += size
            self._changed.notify_all()

    def _drop(self, why: str) -> None:
        self.tier.stats.writes_dropped += 1
        if not self._warned:
            logger.warning("disk cache: pages not written, as %s (said once)", why)
            self._warned = True

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._queue and not self._closed:
                    self._changed.wait()
                if not self._queue:
                    return
                keys, arrays, size = self._queue.popleft()
                self._busy = True
            try:
                self._write(keys, arrays, size)
            except Exception as exc:  # a full or failing disk must not end serving
                logger.warning("disk cache: could not write %d pages: %s", len(keys), exc)
            finally:
                with self._changed:
                    self._queued -= size
                    self._busy = False
                    self._changed.notify_all()

    def _write(self, keys: list[bytes], arrays: list[tuple[str, mx.array]], size: int) -> None:
        if not self.tier.room_for(size):
            self._drop("the disk is nearly full")
            return
        data = [(dtype, np.asarray(a)) for dtype, a in arrays]  # waits for their evaluation
        path: Path = self.tier.folder / (keys[0].hex() + SUFFIX)
        header = write_run(path, self.tier.namespace, keys, data)
        self.tier.filed(path, header, header.offset + header.payload_bytes)

    def flush(self, timeout: float | None = None) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._thread.join()
        _OPEN.discard(self)
