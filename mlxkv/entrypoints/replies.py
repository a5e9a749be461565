"""A started request's engine outputs as every API answers them: one stream skeleton that each API
plugs its framing into, or one whole reply per choice.

The stream skeleton is the same for every API, so no API drifts: while a choice has nothing to send
(a long prefill, a queue) the client gets the API's keepalive every `keepalive_s`; each output's new
text comes split into content and tool calls; a request that fails after the status line has gone
ends the stream with the API's error event, whatever went wrong; and a client that goes away is aborted at once, its
pages freed (Starlette cancels a streaming response when its client disconnects; `collect` watches
for the disconnect itself).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from fastapi import Request as HTTPRequest
from fastapi.responses import Response

from ..engine.outputs import RequestOutput, Usage
from ..engine.sampling.sampler import TokenLogprob
from ..errors import RequestFailed, RequestTooLong
from .errors import ServingError
from .tool_calls import Piece, ToolCall, ToolCallStream

Event = tuple[int, RequestOutput] | None  # (choice index, output), or None for a keepalive


class Framer(Protocol):
    """How one API writes a stream: what opens it, its keepalive, an output's pieces, a failure, its end."""

    def opening(self) -> Iterable[str]: ...

    def keepalive(self) -> str: ...

    def output(self, index: int, output: RequestOutput, pieces: list[Piece]) -> Iterable[str]: ...

    def failed(self, error: ServingError) -> Iterable[str]: ...

    def closing(self) -> Iterable[str]: ...


@dataclass(frozen=True)
class Waiting:
    """How an API's stream reads before its request has started (while its model loads): the
    stream's media type, the API's keepalive, and its error event for a request refused after the
    status line has gone."""

    media_type: str
    keepalive: Callable[[], str]
    failed: Callable[[ServingError], Iterable[str]]


@dataclass
class Collected:
    """One choice's whole reply: its pieces (content and tool calls), reasoning, log-probabilities,
    last output, and when its first output came (`time.perf_counter_ns()`)."""

    pieces: list[Piece] = field(default_factory=list)
    reasoning: str = ""  # a thinking model's
    logprobs: list[TokenLogprob] = field(default_factory=list)
    last: RequestOutput | None = None
    first_ns: int | None = None

    @property
    def text(self) -> str:
        return text_of(self.pieces)

    @property
    def calls(self) -> list[ToolCall]:
        return [p for p in self.pieces if isinstance(p, ToolCall)]

    @property
    def finish_reason(self) -> str | None:
        return self.last.finish_reason if self.last is not None else None

    @property
    def usage(self) -> Usage | None:
        return self.last.usage if self.last is not None else None


@dataclass
class Run:
    """A started request: its choices' engine outputs as events, and a splitter of content and tool
    calls per choice (None where no tools were shown)."""

    events: AsyncGenerator[Event, None]
    splitters: list[ToolCallStream | None]

    async def stream(self, framer: Framer) -> AsyncIterator[str]:
        """The response body of a stream, as `framer` writes it."""
        async with aclosing(self.events):
            for chunk in framer.opening():
                yield chunk
            try:
                async for event in self.events:
                    if event is None:
                        yield framer.keepalive()
                        continue
                    index, output = event
                    for chunk in framer.output(index, output, split(self.splitters[index], output)):
                        yield chunk
            except Exception as exc:  # the status line has gone: the error travels as an event
                for chunk in framer.failed(failure(exc)):
                    yield chunk
                return
        for chunk in framer.closing():
            yield chunk

    async def collect(self, request: HTTPRequest) -> list[Collected] | Response:
        """Every choice's whole reply; a 499 response if the client went away first (its requests
        are aborted); a failed request as a 500 `ServingError`."""
        return cast("list[Collected] | Response", await until_done(self._collect(), request))

    async def _collect(self) -> list[Collected]:
        replies = [Collected() for _ in self.splitters]
        try:
            async with aclosing(self.events):
                async for event in self.events:
                    if event is not None:
                        index, output = event
                        reply = replies[index]
                        reply.first_ns = reply.first_ns or time.perf_counter_ns()
                        reply.pieces += split(self.splitters[index], output)
                        reply.reasoning += output.reasoning
                        reply.logprobs += output.logprobs
                        reply.last = output
        except RequestFailed as exc:
            raise failure(exc) from None
        return replies


def failure(exc: Exception) -> ServingError:
    """What a client is told of a request that failed once started: a refusal as it is, a prompt
    too long for the context as a 400, a failed request (`RequestFailed`) as a 500 with its
    reason, anything else as a 500 naming it."""
    if isinstance(exc, ServingError):
        return exc
    if isinstance(exc, RequestTooLong):
        return ServingError(400, str(exc), None, "context_length_exceeded")
    return ServingError(
        500, str(exc) if isinstance(exc, RequestFailed) else f"the server failed: {exc!r}", kind="server_error"
    )


def split(splitter: ToolCallStream | None, output: RequestOutput) -> list[Piece]:
    """An output's new text as content and tool calls (all content when no tools were shown)."""
    if splitter is None:
        return [output.delta] if output.delta else []
    return splitter.feed(output.delta) + (splitter.close() if output.finished else [])


def text_of(pieces: Sequence[Piece]) -> str:
    return "".join(p for p in pieces if isinstance(p, str))


async def until_done(work: Awaitable[Any], request: HTTPRequest) -> Any:
    """Run `work`, cancelling it (which aborts its requests) the moment the client disconnects."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, watcher):
            pending.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    return task.result() if not task.cancelled() else Response(status_code=499)
