"""An engine thread with an asyncio face: `async for delta in llm.generate(prompt, params)`."""

from __future__ import annotations

import asyncio
import atexit
import threading
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from functools import partial

import mlx.core as mx

from ..cache.pins import Pin
from ..errors import RequestFailed
from .inputs import request_key
from .llm_engine import LLMEngine
from .outputs import RequestOutput
from .sampling.params import SamplingParams


class AsyncLLM:
    """Runs `engine.step()` on a thread of its own, the only thread that touches MLX.

    Any thread or event loop may add and abort requests; each request's outputs are
    handed to the event loop that asked for them. Leaving an `async for` early (break,
    cancellation, an exception) aborts the request and frees its pages. A request that
    fails raises `RequestFailed` in its own consumer only. Nothing a consumer does (closing
    its event loop, aborting at any moment) stops the engine thread; `shutdown()` does,
    and is called at interpreter exit if the caller did not.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput]]] = {}
        self._wake = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="mlxkv-engine", daemon=True)
        self._thread.start()
        atexit.register(self.shutdown)

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | int | None = None,
        cache_salt: str | None = None,
    ) -> AsyncGenerator[str, None]:
        """Yield the completion's text deltas as the engine produces them: text that continues the
        prompt's exactly."""
        async with aclosing(self.outputs(prompt, params, request_id, cache_salt, continuation=True)) as outputs:
            async for output in outputs:  # leaving early closes `outputs` at once, which aborts
                if output.delta:
                    yield output.delta

    async def outputs(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | int | None = None,
        cache_salt: str | None = None,
        pin: Pin | None = None,
        continuation: bool = False,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield every `RequestOutput` of one request (text, tokens, log-probabilities, usage),
        the last one with `finished` set (`continuation`: see `LLMEngine.add_request`)."""
        added = partial(
            self.engine.add_request, prompt, params, cache_salt=cache_salt, pin=pin, continuation=continuation
        )
        async with aclosing(self._run(request_id, added)) as outputs:
            async for output in outputs:
                yield output

    async def embed(
        self, prompt: str | Sequence[int], request_id: str | int | None = None, cache_salt: str | None = None
    ) -> RequestOutput:
        """The last output of an embedding request (see `LLMEngine.add_embedding`): its vector
        (`embedding`) and usage."""
        added = partial(self.engine.add_embedding, prompt, cache_salt=cache_salt)
        async with aclosing(self._run(request_id, added)) as outputs:
            async for output in outputs:
                last = output
        return last

    async def _run(
        self, request_id: str | int | None, add: Callable[..., object]
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the outputs of the request `add(request_id=...)` queues in the engine; leaving early aborts it."""
        request_id = self.engine.new_request_id() if request_id is None else request_key(request_id)
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[request_id] = (asyncio.get_running_loop(), queue)
        try:
            add(request_id=request_id)
        except Exception:
            del self._queues[request_id]
            raise
        with self._wake:
            self._wake.notify()
        finished = False
        try:
            while not finished:
                output = await queue.get()
                if output.error is not None:
                    raise RequestFailed(request_id, output.error) from output.error
                finished = output.finished
                yield output
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self.engine.abort(request_id, missing_ok=True)

    def abort(self, request_id: str | int) -> None:
        """Cancel a request from any thread; its pages are free when this returns."""
        self.engine.abort(request_id)
        self._deliver(RequestOutput(request_key(request_id), "", True, "abort"))

    def abort_all(self) -> int:
        """Cancel every request that has a consumer (each gets its last output, finish reason
        "abort"), as a server does before it exits; how many there were."""
        live = list(self._queues)
        for request_id in live:
            self.engine.abort(request_id, missing_ok=True)
            self._deliver(RequestOutput(request_id, "", True, "abort"))
        return len(live)

    def shutdown(self) -> None:
        """Stop the engine thread (requests in flight stay unfinished)."""
        atexit.unregister(self.shutdown)
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join()

    def _loop(self) -> None:
        try:
            while self._await_work():
                try:
                    outputs = self.engine.step()
                except Exception as exc:  # outside any one request (the engine's own steps fail requests)
                    outputs = self.engine.fail_all(exc)
                for output in outputs:
                    self._deliver(output)
        finally:
            mx.clear_streams()  # MLX aborts the process if a thread that used it ends without this

    def _await_work(self) -> bool:
        """Wait until there is a step to run (True) or the engine thread must stop (False); while
        idle the engine rests (a tensor-parallel group's other ranks nap) between waits."""
        while True:
            with self._wake:
                if self._stopped or self.engine.has_unfinished():
                    return not self._stopped
            wait = self.engine.rest()
            with self._wake:
                self._wake.wait_for(lambda: self._stopped or self.engine.has_unfinished(), timeout=wait)

    def _deliver(self, output: RequestOutput) -> None:
        target = self._queues.get(output.request_id)
        if target is None:
            return
        loop, queue = target
        try:
            loop.call_soon_threadsafe(queue.put_nowait, output)
        except RuntimeError:  # the consumer's event loop is closed: nobody will read this request
            self._queues.pop(output.request_id, None)
            self.engine.abort(output.request_id, missing_ok=True)
