"""Anthropic's Messages API over the serving core: `/v1/messages`, whole or as Anthropic's event
stream, and `/v1/messages/count_tokens`.

A reply's text and tool calls become content blocks (`text`, `tool_use`), in the order the model
wrote them. Streamed, each block opens, grows (`text_delta`, or the call's whole input as one
`input_json_delta`) and closes; the same splitter makes whole and streamed replies, so they are
equal. Usage counts the prompt tokens read from the prefix cache as `cache_read_input_tokens`
and the rest as `input_tokens`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from ...cache.pins import Pin
from ...engine.outputs import RequestOutput, Usage
from ...engine.sampling.params import SamplingParams
from ...errors import RequestFailed
from ..core import Event, ServingCore, ServingError, Tools, pin_of, refused_as, split, until_done
from ..tool_calls import Piece, ToolCall, ToolCallStream
from .protocol import CountTokensBody, MessagesBody, error_body

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


class AnthropicServing:
    """Turns Messages bodies into engine requests and their outputs into Anthropic's JSON and events."""

    def __init__(self, core: ServingCore) -> None:
        self.core = core

    async def messages(self, body: MessagesBody, request: HTTPRequest) -> Any:
        prompt, tools = self._prompt(body)
        fields: dict[str, Any] = body.sampling_fields() | ({"grammar": tools.grammar} if tools.grammar else {})
        with refused_as(names={"stop": "stop_sequences"}):
            params = SamplingParams(**fields, max_tokens=self.core.room(prompt, body.max_tokens))
        await self.core.compile(
            params, "tool_choice" if tools.grammar else "output_config" if body.output_config else None
        )
        self.core.check_queue(1)
        ident = f"msg_{uuid.uuid4().hex[:24]}"
        events = self.core.run([(prompt, params)], None, self._pin(body, prompt, tools))
        splitter = self.core.splitters(1, tools)[0]
        if body.stream:
            return StreamingResponse(self._stream(events, ident, len(prompt), splitter), media_type="text/event-stream")
        return await until_done(self._collect(events, ident, splitter), request)

    async def count_tokens(self, body: CountTokensBody) -> dict[str, int]:
        return {"input_tokens": len(self._prompt(body)[0])}

    def _prompt(self, body: CountTokensBody) -> tuple[list[int], Tools]:
        self.core.check_model(body.model)
        parallel = body.tool_choice is None or not body.tool_choice.disable_parallel_tool_use
        field = "tool_choice" if body.tool_choice else "tools"
        tools = self.core.tools(body.shown_tools(), body.forced_tools(), parallel, field)
        return self.core.chat_prompt(body.template_inputs(), tools), tools

    def _pin(self, body: MessagesBody, prompt: list[int], tools: Tools) -> Pin | None:
        """What `cache_control` pins: the whole prompt for the request's own (top-level) mark,
        else the prompt up to the last marked block (the tokens it shares with the conversation
        cut there)."""
        top = (body.model_extra or {}).get("cache_control")
        if top is not None:
            return pin_of(top, len(prompt))
        upto = body.upto_last_cache_mark()
        if upto is None:
            return None
        cut, mark = upto
        try:
            head = self.core.chat_prompt(cut.template_inputs(), tools)
        except ServingError:  # the template will not render the conversation cut there
            return None
        shared = next((k for k, (a, b) in enumerate(zip(head, prompt)) if a != b), min(len(head), len(prompt)))
        return pin_of(mark.model_dump(exclude_none=True), shared)

    def _message(self, ident: str, content: list[dict[str, Any]], last: RequestOutput | None) -> dict[str, Any]:
        reason, stop = _stop(last, any(block["type"] == "tool_use" for block in content))
        return {
            "id": ident,
            "type": "message",
            "role": "assistant",
            "model": self.core.model_id,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": stop,
            "usage": _usage(last.usage if last else None),
        }

    async def _collect(
        self, events: AsyncGenerator[Event, None], ident: str, splitter: ToolCallStream | None
    ) -> dict[str, Any]:
        pieces: list[Piece] = []
        last = None
        async with aclosing(events):
            async for event in events:
                if event is not None:
                    last = event[1]
                    pieces += split(splitter, last)
        return self._message(ident, _blocks(pieces), last)

    async def _stream(
        self, events: AsyncGenerator[Event, None], ident: str, prompt_tokens: int, splitter: ToolCallStream | None
    ) -> AsyncIterator[str]:
        """Anthropic's events: `message_start`, each block's start, deltas and stop, `message_delta`
        with the stop reason and usage, `message_stop`; `ping` while there is nothing to send."""
        start = self._message(ident, [], None) | {"usage": _usage(Usage(prompt_tokens, 0, 0))}
        yield _event("message_start", {"message": start})
        blocks = _Blocks()
        last = None
        try:
            async with aclosing(events):
                async for event in events:
                    if event is None:
                        yield _event("ping", {})
                        continue
                    last = event[1]
                    for piece in split(splitter, last):
                        for name, data in blocks.add(piece):
                            yield _event(name, data)
        except RequestFailed as exc:  # the status line has gone: the error travels as an event
            yield _event("error", error_body(ServingError(500, str(exc), kind="server_error")))
            return
        for name, data in blocks.close():
            yield _event(name, data)
        reason, stop = _stop(last, blocks.called)
        usage = _usage(last.usage if last else None)
        yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": stop}, "usage": usage})
        yield _event("message_stop", {})


class _Blocks:
    """The content blocks of a streamed reply, opened and closed as its pieces come."""

    def __init__(self) -> None:
        self.count = 0
        self.text_open = False
        self.called = False

    def add(self, piece: Piece) -> list[tuple[str, dict[str, Any]]]:
        if isinstance(piece, str):
            opened = [] if self.text_open else self._start({"type": "text", "text": ""})
            self.text_open = True
            return opened + [_delta(self.count - 1, {"type": "text_delta", "text": piece})]
        self.called = True
        events = self._stop_text() + self._start(_tool_use(piece) | {"input": {}})
        delta = _delta(self.count - 1, {"type": "input_json_delta", "partial_json": piece.arguments})
        return events + [delta, ("content_block_stop", {"index": self.count - 1})]

    def close(self) -> list[tuple[str, dict[str, Any]]]:
        """The last block's stop; a reply with no blocks at all gets one empty text block."""
        if self.count == 0:
            return self._start({"type": "text", "text": ""}) + [("content_block_stop", {"index": 0})]
        return self._stop_text()

    def _start(self, block: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        self.count += 1
        return [("content_block_start", {"index": self.count - 1, "content_block": block})]

    def _stop_text(self) -> list[tuple[str, dict[str, Any]]]:
        if not self.text_open:
            return []
        self.text_open = False
        return [("content_block_stop", {"index": self.count - 1})]


def _blocks(pieces: list[Piece]) -> list[dict[str, Any]]:
    """A whole reply's content blocks: consecutive text as one block, each call as a `tool_use`."""
    blocks: list[dict[str, Any]] = []
    for piece in pieces:
        if isinstance(piece, ToolCall):
            blocks.append(_tool_use(piece))
        elif blocks and blocks[-1]["type"] == "text":
            blocks[-1]["text"] += piece
        else:
            blocks.append({"type": "text", "text": piece})
    return blocks or [{"type": "text", "text": ""}]


def _tool_use(call: ToolCall) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": "toolu_" + call.id.removeprefix("call_"),
        "name": call.name,
        "input": json.loads(call.arguments),
    }


def _delta(index: int, delta: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return "content_block_delta", {"index": index, "delta": delta}


def _stop(last: RequestOutput | None, called: bool) -> tuple[str | None, str | None]:
    """Anthropic's stop reason and the stop sequence that ended the reply, if one did."""
    if last is None or last.finish_reason is None:
        return None, None
    if last.stop_string is not None:
        return "stop_sequence", last.stop_string
    if called and last.finish_reason == "stop":
        return "tool_use", None
    return STOP_REASONS.get(last.finish_reason, last.finish_reason), None


def _usage(usage: Usage | None) -> dict[str, int]:
    """Anthropic's usage: prompt tokens read from the cache, those written to it for a pin (its
    `cache_control`), and the rest."""
    if usage is None:
        return {"input_tokens": 0, "output_tokens": 0, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
    written = max(0, usage.pinned_tokens - usage.cached_tokens)
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens - written,
        "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "cache_creation_input_tokens": written,
    }


def _event(name: str, data: dict[str, Any]) -> str:
    """One Server-Sent Event as Anthropic sends them: its type named twice, as `event` and `type`."""
    return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n"
