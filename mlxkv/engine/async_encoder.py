"""An encoder embedding model on a thread of its own, with an asyncio face: `await encoder.embed(inputs)`.
Requests that arrive while a batch runs are embedded together in the next."""

from __future__ import annotations

import asyncio
import atexit
import threading
from concurrent.futures import Future

import mlx.core as mx

from ..models.encoder import Encoder
from ..models.pooling import Pooling

Job = tuple[list[list[int]], "Future[list[list[float]]]"]


class AsyncEncoder:
    """Runs `encoder` on the only thread that touches it; any event loop may ask for vectors.
    `shutdown()` stops the thread (called at interpreter exit if not before)."""

    def __init__(self, encoder: Encoder) -> None:
        self.encoder = encoder
        self._jobs: list[Job] = []
        self._wake = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="mlxkv-encoder", daemon=True)
        self._thread.start()
        atexit.register(self.shutdown)

    @property
    def pooling(self) -> Pooling:
        return self.encoder.pooling

    @property
    def max_length(self) -> int:
        return self.encoder.max_length

    @property
    def vocab_size(self) -> int:
        return self.encoder.vocab_size

    def tokenize(self, text: str) -> list[int]:
        return self.encoder.tokenize(text)

    async def vectors(self, inputs: list[list[int]]) -> list[list[float]]:
        """A vector per input (token ids, at most `encoder.max_length` each)."""
        future: Future[list[list[float]]] = Future()
        with self._wake:
            if self._stopped:
                raise RuntimeError("the encoder has been shut down")
            self._jobs.append((inputs, future))
            self._wake.notify()
        return await asyncio.wrap_future(future)

    def shutdown(self) -> None:
        """Stop the thread; requests still queued fail."""
        atexit.unregister(self.shutdown)
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join()
        for _, future in self._jobs:
            future.set_exception(RuntimeError("the encoder has been shut down"))
        self._jobs.clear()

    def _loop(self) -> None:
        try:
            while True:
                with self._wake:
                    self._wake.wait_for(lambda: self._stopped or bool(self._jobs))
                    if self._stopped:
                        return
                    jobs, self._jobs = self._jobs, []
                self._run(jobs)
        finally:
            mx.clear_streams()  # MLX aborts the process if a thread that used it ends without this

    def _run(self, jobs: list[Job]) -> None:
        """Embed every job's inputs in one call (those whose askers left are dropped); a failure
        fails every job of it."""
        jobs = [(inputs, future) for inputs, future in jobs if future.set_running_or_notify_cancel()]
        try:
            vectors = self.encoder.embed([ids for inputs, _ in jobs for ids in inputs])
        except Exception as exc:
            for _, future in jobs:
                future.set_exception(exc)
            return
        start = 0
        for inputs, future in jobs:
            future.set_result(vectors[start : start + len(inputs)])
            start += len(inputs)
