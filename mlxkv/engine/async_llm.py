"""An engine thread with an asyncio face: `async for delta in llm.generate(prompt, params)`."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import AsyncIterator, Sequence

from ..errors import MlxkvError, UnknownSequenceError
from .llm_engine import LLMEngine, RequestOutput
from .sampling import SamplingParams


class AsyncLLM:
    """Runs `engine.step()` on a thread of its own, the only thread that touches MLX.

    Any thread or event loop may add and abort requests; each request's outputs are
    handed to the event loop that asked for them. Leaving an `async for` early (break,
    cancellation, an exception) aborts the request and frees its pages. If a step fails,
    the requests in flight are aborted and each of their consumers gets the error.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Condition()
        self._stopped = False
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._loop, name="mlxkv-engine", daemon=True)
        self._thread.start()

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[str]:
        """Yield the completion's text deltas as the engine produces them."""
        request_id = f"async-{next(self._ids)}" if request_id is None else str(request_id)
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = (asyncio.get_running_loop(), queue)
        try:
            self.engine.add_request(prompt, params, request_id)
        except Exception:
            del self._queues[request_id]
            raise
        with self._wake:
            self._wake.notify()
        finished = False
        try:
            while not finished:
                output = await queue.get()
                if isinstance(output, BaseException):
                    raise MlxkvError(f"engine step failed: {output}") from output
                finished = output.finished
                if output.delta:
                    yield output.delta
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                with contextlib.suppress(UnknownSequenceError):
                    self.engine.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Cancel a request from any thread; its pages are free when this returns."""
        self.engine.abort(request_id)
        self._deliver(RequestOutput(request_id, "", True, "abort"), request_id)

    def shutdown(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join()

    def _loop(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._stopped or self.engine.has_unfinished())
                if self._stopped:
                    return
            try:
                outputs = self.engine.step()
            except Exception as exc:  # handed to every consumer in flight, not lost with the thread
                for request_id in list(self.engine.requests):
                    self.engine.abort(request_id)
                    self._deliver(exc, request_id)
                continue
            for output in outputs:
                self._deliver(output, output.request_id)

    def _deliver(self, item: RequestOutput | BaseException, request_id: str) -> None:
        target = self._queues.get(request_id)
        if target is not None:
            loop, queue = target
            loop.call_soon_threadsafe(queue.put_nowait, item)
