"""OpenAI's Responses API (`/v1/responses`) over the serving core, with `previous_response_id` from a
bounded in-memory store of the responses asked to be kept (`store`, true by default).

A reply's text and calls become output items (`message` with `output_text`, `function_call`) in
the order the model wrote them; streamed and whole replies come from the same splitter, and a
stream sends a comment line while there is nothing to send.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any, Literal

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from ...engine.outputs import RequestOutput
from ..core import ServingCore
from ..errors import ServingError, refused_as
from ..tool_calls import Piece
from .responses_protocol import (
    Event,
    FunctionCallItem,
    IncompleteDetails,
    InputDetails,
    MessageItem,
    NamedFunction,
    OutputDetails,
    OutputItem,
    OutputText,
    Response,
    ResponsesBody,
    ResponseUsage,
    template_inputs,
)

STORE_SIZE = 1024  # responses kept for previous_response_id, the least recently used dropped first


class ResponseStore:
    """The conversations of kept responses (their messages, the reply's included), by id; the
    `STORE_SIZE` most recently used are kept."""

    def __init__(self) -> None:
        self._kept: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, ident: str) -> list[dict[str, Any]]:
        with self._lock:
            if ident not in self._kept:
                raise ServingError(400, f"previous response {ident!r} is not kept here", "previous_response_id")
            self._kept.move_to_end(ident)
            return list(self._kept[ident])

    def put(self, ident: str, messages: list[dict[str, Any]]) -> None:
        with self._lock:
            self._kept[ident] = messages
            while len(self._kept) > STORE_SIZE:
                self._kept.popitem(last=False)


class ResponsesServing:
    """Turns Responses bodies into engine requests and their outputs into response objects and events."""

    def __init__(self, core: ServingCore) -> None:
        self.core = core
        self.store = ResponseStore()

    async def create(self, body: ResponsesBody, request: HTTPRequest) -> Any:
        self.core.check_model(body.model)
        history = self.store.get(body.previous_response_id) if body.previous_response_id else []
        with refused_as("input"):
            messages = history + template_inputs(body.input)
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        field = "tool_choice" if body.tool_choice else "tools"
        tools = self.core.tools(body.shown_tools(), body.forced_tools(), body.parallel_tool_calls, field)
        prompt = self.core.chat_prompt(system + messages, tools)
        given = {"temperature": body.temperature, "top_p": body.top_p}
        fields: dict[str, Any] = {"temperature": 1.0} | {k: v for k, v in given.items() if v is not None}
        fields |= {"grammar": tools.grammar} if tools.grammar else body.constraint()
        params = self.core.sampling(prompt, body.max_output_tokens, fields)
        source = "tool_choice" if tools.grammar else "text.format" if body.constraint() else None
        run = await self.core.start([(prompt, params)], tools, source)
        reply = _Reply(self, body, messages, f"resp_{uuid.uuid4().hex}")
        if body.stream:
            return StreamingResponse(run.stream(reply), media_type="text/event-stream")
        replies = await run.collect(request)
        if not isinstance(replies, list):
            return replies
        reply.last = replies[0].last
        for piece in replies[0].pieces:
            reply.add(piece)
        reply.close_message()
        reply.keep()
        return reply.response("completed").model_dump(exclude_unset=True)


class _Reply:
    """One response being made: its output items as the engine's outputs arrive, and its events."""

    def __init__(
        self, serving: ResponsesServing, body: ResponsesBody, messages: list[dict[str, Any]], ident: str
    ) -> None:
        self.serving, self.body, self.messages, self.ident = serving, body, messages, ident
        self.created = int(time.time())
        self.items: list[OutputItem] = []
        self.last: RequestOutput | None = None
        self.sequence = 0

    def opening(self) -> Iterable[str]:
        running = self.response("in_progress")
        return [
            self._event("response.created", response=running),
            self._event("response.in_progress", response=running),
        ]

    def keepalive(self) -> str:
        return ": keepalive\n\n"

    def output(self, index: int, output: RequestOutput, pieces: list[Piece]) -> Iterable[str]:
        self.last = output
        return [event for piece in pieces for event in self.add(piece)]

    def failed(self, error: ServingError) -> Iterable[str]:
        return [self._event("error", code=error.code or error.kind, message=str(error), param=error.param)]

    def closing(self) -> Iterable[str]:
        events = self.close_message()
        self.keep()
        final = self.response("completed")
        done = "response.incomplete" if final.status == "incomplete" else "response.completed"
        return events + [self._event(done, response=final)]

    def add(self, piece: Piece) -> list[str]:
        """The events of one piece: text grows the open message item, a call is an item of its own."""
        if isinstance(piece, str):
            events = []
            if not self.items or not isinstance(self.items[-1], MessageItem):
                part = OutputText(type="output_text", text="", annotations=[])
                item = MessageItem(
                    type="message", id=f"msg_{uuid.uuid4().hex}", status="in_progress", role="assistant", content=[part]
                )
                self.items.append(item)
                events += [
                    self._at("response.output_item.added", item=item.model_copy(deep=True)),
                    self._at("response.content_part.added", item_id=item.id, content_index=0, part=part.model_copy()),
                ]
            message = self.items[-1]
            assert isinstance(message, MessageItem)
            message.content[0].text += piece
            return events + [self._at("response.output_text.delta", item_id=message.id, content_index=0, delta=piece)]
        events = self.close_message()
        call = FunctionCallItem(
            type="function_call",
            id=f"fc_{uuid.uuid4().hex}",
            call_id=piece.id,
            name=piece.name,
            arguments=piece.arguments,
            status="completed",
        )
        self.items.append(call)
        added = call.model_copy(update={"arguments": "", "status": "in_progress"})
        return events + [
            self._at("response.output_item.added", item=added),
            self._at("response.function_call_arguments.delta", item_id=call.id, delta=piece.arguments),
            self._at("response.function_call_arguments.done", item_id=call.id, arguments=piece.arguments),
            self._at("response.output_item.done", item=call),
        ]

    def close_message(self) -> list[str]:
        """Complete the open message item, if any: its text's, part's and item's done events."""
        item = self.items[-1] if self.items else None
        if not isinstance(item, MessageItem) or item.status == "completed":
            return []
        item.status = "completed"
        part = item.content[0]
        return [
            self._at("response.output_text.done", item_id=item.id, content_index=0, text=part.text),
            self._at("response.content_part.done", item_id=item.id, content_index=0, part=part),
            self._at("response.output_item.done", item=item),
        ]

    def response(self, status: Literal["in_progress", "completed"]) -> Response:
        body, last = self.body, self.last
        done = last is not None and last.finished
        cut = done and last is not None and last.finish_reason == "length"
        usage = last.usage if last is not None and done else None
        return Response(
            id=self.ident,
            object="response",
            created_at=self.created,
            status="incomplete" if cut else "completed" if done else status,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if cut else None,
            error=None,
            model=self.serving.core.model_id,
            instructions=body.instructions,
            output=self.items if done else [],
            parallel_tool_calls=body.parallel_tool_calls,
            tool_choice=_tool_choice(body.tool_choice),
            tools=[t.model_dump(exclude_none=True) for t in body.tools or []],
            temperature=body.temperature,
            top_p=body.top_p,
            max_output_tokens=body.max_output_tokens,
            previous_response_id=body.previous_response_id,
            store=body.store,
            text=body.text.model_dump(by_alias=True, exclude_none=True) if body.text else {"format": {"type": "text"}},
            metadata={},
            usage=None
            if usage is None
            else ResponseUsage(
                input_tokens=usage.prompt_tokens,
                input_tokens_details=InputDetails(cached_tokens=usage.cached_tokens),
                output_tokens=usage.completion_tokens,
                output_tokens_details=OutputDetails(reasoning_tokens=0),
                total_tokens=usage.prompt_tokens + usage.completion_tokens,
            ),
        )

    def keep(self) -> None:
        """Keep the conversation with this reply in it, for a later `previous_response_id`."""
        if not self.body.store:
            return
        reply: dict[str, Any] = {"role": "assistant", "content": ""}
        for item in self.items:
            if isinstance(item, MessageItem):
                reply["content"] += item.content[0].text
            else:
                call = {"name": item.name, "arguments": json.loads(item.arguments)}
                reply.setdefault("tool_calls", []).append({"id": item.call_id, "type": "function", "function": call})
        self.serving.store.put(self.ident, self.messages + [reply])

    def _at(self, name: str, **data: Any) -> str:
        """An event of the last output item, with that item's index in the response's output."""
        return self._event(name, output_index=len(self.items) - 1, **data)

    def _event(self, name: str, **data: Any) -> str:
        """One typed event, numbered in the stream."""
        event = Event(type=name, sequence_number=self.sequence, **data)
        self.sequence += 1
        return event.sse()


def _tool_choice(choice: str | NamedFunction | None) -> str | dict[str, Any]:
    """The request's tool choice as a response echoes it: `auto` unless it gave one."""
    return choice.model_dump() if isinstance(choice, NamedFunction) else choice or "auto"
