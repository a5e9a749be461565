"""The disk tier: full pages kept on disk under their page keys, past the pool and the process.

Pages are filed in run files (`run_file`) in a folder of their namespace, a digest of everything
their K/V depend on besides their keys: the model's weights, the cache dtype, page size,
quantization, every layer's K/V shape and the format version. The index (page key -> file and
place) lives in memory, rebuilt at start from the files' headers; a file that does not belong
(another namespace, another version, truncated) is ignored with one log line, and one whose
checksum fails when read is dropped with one, so a page from disk is the page that was written
or none at all. Files beyond `max_bytes` go least recently used first. Writing runs on a thread
of its own (`RunWriter`), and so does reading ahead (`prefetch`), so that no step waits for the disk.
"""

from __future__ import annotations

import concurrent.futures
import logging
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from .peers import MISSING, READING, READY
from .run_file import SUFFIX, RunFileError, RunHeader, read_header, read_payload
from .writer import RunWriter

logger = logging.getLogger(__name__)
FREE_FLOOR = 2**30  # bytes the disk keeps free: below them nothing more is written
ASSUMED_READ_RATE = 1e9  # bytes a second, until reads have measured it (an SSD reads several times that)
MEASURED_FROM = 2**20  # bytes read before the measured rate replaces the assumed one
READY_BYTES = 2**30  # of files read ahead and kept for requests that asked for them before the last


@dataclass
class DiskStats:
    """What the disk tier did: pages restored into the pool and the bytes read for them (and the
    seconds it took), bytes written, writes dropped (queue full, disk nearly full) and files
    ignored or dropped as not belonging or damaged."""

    pages_restored: int = 0
    bytes_read: int = 0
    restore_seconds: float = 0.0
    bytes_written: int = 0
    writes_dropped: int = 0
    files_rejected: int = 0


class DiskTier:
    """Pages on disk in `directory`/`namespace`, at most `max_bytes` of them (see the module)."""

    def __init__(
        self, directory: Path, namespace: str, max_bytes: int, queue_bytes: int = 256 * 2**20, floor: int = FREE_FLOOR
    ) -> None:
        self.folder = Path(directory).expanduser() / namespace[:32]
        self.folder.mkdir(parents=True, exist_ok=True)
        self.namespace = namespace
        self.max_bytes = max_bytes
        self.floor = floor
        self.stats = DiskStats()
        self._lock = threading.Lock()
        self._where: dict[bytes, tuple[Path, int]] = {}  # page key: its file and its place there
        self._files: OrderedDict[Path, tuple[RunHeader, int]] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="mlxkv-disk-reader")
        self._reading: dict[Path, Future[list[np.ndarray] | None]] = {}  # files `prefetch` is reading
        self._ready: OrderedDict[Path, list[np.ndarray] | None] = OrderedDict()  # and those it has read
        self._scan()
        self.writer = RunWriter(self, queue_bytes)

    def _scan(self) -> None:
        """Rebuild the index from the files' headers, oldest first."""
        for path in sorted(self.folder.glob("*" + SUFFIX), key=lambda p: p.stat().st_mtime):
            try:
                header = read_header(path)
                if header.namespace != self.namespace:
                    raise RunFileError("it belongs to another model or cache (namespace)")
            except RunFileError as exc:
                self._reject(path, exc)
                continue
            self._add(path, header, path.stat().st_size)
        self._evict()

    def _reject(self, path: Path, why: Exception) -> None:
        logger.warning("disk cache: ignoring %s: %s", path.name, why)
        self.stats.files_rejected += 1

    def _add(self, path: Path, header: RunHeader, size: int) -> None:
        self._files[path] = (header, size)
        self._bytes += size
        for place, key in enumerate(header.keys):
            self._where.setdefault(key, (path, place))

    def _drop(self, path: Path) -> None:
        header, size = self._files.pop(path)
        self._bytes -= size
        for key in header.keys:
            if self._where.get(key, (None,))[0] == path:
                del self._where[key]
        path.unlink(missing_ok=True)

    def _evict(self) -> None:
        while self._bytes > self.max_bytes and self._files:
            self._drop(next(iter(self._files)))

    @property
    def bytes_stored(self) -> int:
        return self._bytes

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._where

    def found(self, keys: Sequence[bytes]) -> int:
        """How many of `keys` (a chain, in order) are on disk before the first that is not."""
        with self._lock:
            return next((i for i, key in enumerate(keys) if key not in self._where), len(keys))

    def prefetch(self, keys: Sequence[bytes]) -> bool:
        """Whether the files holding the pages `keys` are read and checked, in memory for `read`;
        those that are not are read on the reader thread from now on. Files read for other calls
        are let go beyond `READY_BYTES`, the longest unasked first; this call's never are."""
        with self._lock:
            paths = list(dict.fromkeys(self._where[key][0] for key in keys if key in self._where))
        self._harvest()
        for path in paths:
            if path in self._ready:
                self._ready.move_to_end(path)
            elif path not in self._reading:
                self._reading[path] = self._reader.submit(self._load, path)
        asked = set(paths)
        held = sum(self._held(arrays) for arrays in self._ready.values())
        for path in [p for p in self._ready if p not in asked]:  # the longest unasked first
            if held <= READY_BYTES:
                break
            held -= self._held(self._ready.pop(path))
        return all(path in self._ready for path in paths)

    def _harvest(self) -> None:
        """Move the files the reader has finished into `_ready`, whoever asked for them."""
        for path, reading in list(self._reading.items()):
            if reading.done():
                self._ready[path] = reading.result()
                del self._reading[path]

    @staticmethod
    def _held(arrays: list[np.ndarray] | None) -> int:
        return sum(a.nbytes for a in arrays) if arrays is not None else 0

    def wait(self, timeout: float) -> None:
        """Wait until a read ahead finishes, at most `timeout` seconds (none running: return at once)."""
        reading = [future for future in self._reading.values() if not future.done()]
        if reading:
            concurrent.futures.wait(reading, timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def status(self, keys: Sequence[bytes]) -> list[int]:
        """Each of `keys` as `prefetch` left it: `READY` (its file read and checked), `READING`, or
        `MISSING` (not on disk, or its file damaged)."""
        with self._lock:
            places = [self._where.get(key) for key in keys]
        return [self._status(place) for place in places]

    def _status(self, place: tuple[Path, int] | None) -> int:
        if place is None:
            return MISSING
        if place[0] not in self._ready:
            return READING
        return READY if self._ready[place[0]] is not None else MISSING

    def read(self, keys: Sequence[bytes]) -> list[mx.array]:
        """The stored arrays of the pages `keys` (in order), each `[pages, ...]` in its dtype, for
        as many leading pages as are on disk and their files give back whole (a damaged file is
        dropped, with one line). Files `prefetch` read are taken from memory, the others read now."""
        places: list[tuple[Path, int]] = []
        with self._lock:
            for key in keys:
                place = self._where.get(key)
                if place is None:  # gone since it was found (the writer dropped its file): stop there
                    break
                places.append(place)
            dtypes = [dtype for dtype, _ in self._files[places[0][0]][0].arrays] if places else []
        loaded: dict[Path, list[np.ndarray] | None] = {}
        runs: list[tuple[list[np.ndarray], int, int]] = []  # a file's arrays, and which of its pages in a row
        for path, index in places:
            if path not in loaded:
                loaded[path] = self._ready.pop(path) if path in self._ready else self._load(path)
            arrays = loaded[path]
            if arrays is None:
                break
            if runs and runs[-1][0] is arrays and runs[-1][2] == index:
                runs[-1] = (arrays, runs[-1][1], index + 1)
            else:
                runs.append((arrays, index, index + 1))
        if not runs:
            return []
        out = []
        for i, dtype in enumerate(dtypes):
            parts = [arrays[i][start:stop] for arrays, start, stop in runs]  # views: one copy, into MLX
            out.append(mx.array(parts[0] if len(parts) == 1 else np.concatenate(parts)).view(getattr(mx, dtype)))
        self.stats.pages_restored += out[0].shape[0]
        self.stats.bytes_read += sum(a.nbytes for a in out)
        return out

    def read_seconds(self, nbytes: int) -> float:
        """About how long reading `nbytes` of pages takes, at the rate reads so far have measured."""
        stats = self.stats
        measured = stats.bytes_read >= MEASURED_FROM and stats.restore_seconds > 0
        return nbytes / (stats.bytes_read / stats.restore_seconds if measured else ASSUMED_READ_RATE)

    def _load(self, path: Path) -> list[np.ndarray] | None:
        """A file's arrays, checked (timed into `stats.restore_seconds`); None (the file dropped,
        with one line) if it is damaged or gone. Any thread may call it."""
        with self._lock:
            entry = self._files.get(path)
            if entry is None:
                return None
            self._files.move_to_end(path)
        started = time.perf_counter()
        try:
            arrays = read_payload(path, entry[0])
        except RunFileError as exc:
            with self._lock:
                self._reject(path, exc)
                if path in self._files:
                    self._drop(path)
            return None
        with self._lock:
            self.stats.restore_seconds += time.perf_counter() - started
        return arrays

    def missing(self, keys: Sequence[bytes]) -> list[int]:
        """Which of `keys` are not on disk (their indices)."""
        with self._lock:
            return [i for i, key in enumerate(keys) if key not in self._where]

    def put(self, keys: Sequence[bytes], arrays: Sequence[mx.array]) -> None:
        """File the pages `keys`, whose K/V `arrays` (`[pages, ...]` each, as the storage keeps them)
        the writer reads once computed: their evaluation starts here. Never waits: a full queue
        drops them."""
        raw = [(str(a.dtype).removeprefix("mlx.core."), a.view(mx.uint8)) for a in arrays]
        mx.async_eval([a for _, a in raw])
        self.writer.submit(list(keys), raw)

    def room_for(self, size: int) -> bool:
        """Whether `size` more bytes may be written: the disk keeps its free floor."""
        return shutil.disk_usage(self.folder).free - size >= self.floor

    def filed(self, path: Path, header: RunHeader, size: int) -> None:
        """A run file the writer finished: index it, then keep within `max_bytes`."""
        with self._lock:
            self._add(path, header, size)
            self.stats.bytes_written += size
            self._evict()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything submitted is on disk (or `timeout` seconds); whether it is."""
        return self.writer.flush(timeout)

    def close(self) -> None:
        """Write what is queued, then stop the writer and the reader."""
        self.writer.close()
        self._reader.shutdown(wait=True)
