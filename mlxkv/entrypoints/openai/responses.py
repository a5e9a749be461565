"""OpenAI's Responses API (`/v1/responses`) over the serving core: `input` as text or items,
`instructions`, function tools, `text.format`, typed stream events, and `previous_response_id`
from a bounded in-memory store of the responses asked to be kept (`store`, true by default).

A reply's text and calls become output items (`message` with `output_text`, `function_call`) in
the order the model wrote them; streamed and whole replies come from the same splitter.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any, Literal

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ...engine.outputs import RequestOutput
from ...engine.sampling.params import SamplingParams
from ...errors import RequestFailed
from ..core import Event, ServingCore, ServingError, forced_tools, refused_as, split, until_done
from ..tool_calls import Piece, ToolCallStream
from .protocol import error_body

TEXT = {"type": "text"}
STORE_SIZE = 1024  # responses kept for previous_response_id, the least recently used dropped first


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None

    def as_chat(self) -> dict[str, Any]:
        """The tool as chat templates and mlx-lm's parsers read it: Chat Completions' entry."""
        function = {"name": self.name, "parameters": self.parameters or {"type": "object"}}
        return {
            "type": "function",
            "function": function | ({"description": self.description} if self.description else {}),
        }


class NamedFunction(BaseModel):
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]
    schema_: dict[str, Any] | None = Field(None, alias="schema")


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    format: TextFormat | None = None


class ResponsesBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None

    def shown_tools(self) -> list[dict[str, Any]]:
        return [] if self.tool_choice == "none" else [t.as_chat() for t in self.tools or []]

    def forced_tools(self) -> list[dict[str, Any]]:
        choice = self.tool_choice
        if isinstance(choice, NamedFunction):
            return forced_tools(self.shown_tools(), None, choice.name)
        return forced_tools(self.shown_tools(), choice)

    def constraint(self) -> dict[str, Any]:
        kind = self.text.format if self.text is not None else None
        if kind is None or kind.type == "text":
            return {}
        return {"json_schema": kind.schema_ if kind.type == "json_schema" and kind.schema_ else {"type": "object"}}


def template_inputs(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat templates read them: messages, and calls with their outputs (mlx-lm's
    way: an assistant's calls with object arguments, each output a `tool` message)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            content = item.get("content", "")
            text = content if isinstance(content, str) else "".join(part.get("text", "") for part in content)
            role = "system" if item.get("role") == "developer" else item.get("role", "user")
            messages.append({"role": role, "content": text})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function"}
            call["function"] = {"name": item["name"], "arguments": json.loads(item.get("arguments") or "{}")}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": str(item.get("output", ""))})
        else:
            raise ValueError(
                f"input items of type {kind!r} are not supported; use message, function_call, function_call_output"
            )
    return messages


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
        with refused_as():
            params = SamplingParams(**fields, max_tokens=self.core.room(prompt, body.max_output_tokens))
        await self.core.compile(
            params, "tool_choice" if tools.grammar else "text.format" if body.constraint() else None
        )
        self.core.check_queue(1)
        reply = _Reply(self, body, messages, f"resp_{uuid.uuid4().hex}", self.core.splitters(1, tools)[0])
        events = self.core.run([(prompt, params)], None)
        if body.stream:
            return StreamingResponse(reply.stream(events), media_type="text/event-stream")
        return await until_done(reply.whole(events), request)


class _Reply:
    """One response being made: its output items as the engine's outputs arrive."""

    def __init__(
        self,
        serving: ResponsesServing,
        body: ResponsesBody,
        messages: list[dict[str, Any]],
        ident: str,
        splitter: ToolCallStream | None,
    ) -> None:
        self.serving, self.body, self.messages, self.ident, self.splitter = serving, body, messages, ident, splitter
        self.created = int(time.time())
        self.items: list[dict[str, Any]] = []
        self.last: RequestOutput | None = None
        self.sequence = 0

    def add(self, piece: Piece) -> list[tuple[str, dict[str, Any]]]:
        """The events of one piece: text grows the open message item, a call is an item of its own."""
        if isinstance(piece, str):
            events = []
            if not self.items or self.items[-1]["type"] != "message":
                part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": []}
                item: dict[str, Any] = {
                    "type": "message",
                    "id": f"msg_{uuid.uuid4().hex}",
                    "status": "in_progress",
                    "role": "assistant",
                    "content": [part],
                }
                self.items.append(item)
                events += [
                    self._at("response.output_item.added", {"item": item}),
                    self._at("response.content_part.added", {"item_id": item["id"], "content_index": 0, "part": part}),
                ]
            item = self.items[-1]
            item["content"][0]["text"] += piece
            delta = {"item_id": item["id"], "content_index": 0, "delta": piece}
            return events + [self._at("response.output_text.delta", delta)]
        events = self._close_message()
        call = {
            "type": "function_call",
            "id": f"fc_{uuid.uuid4().hex}",
            "call_id": piece.id,
            "name": piece.name,
            "arguments": piece.arguments,
            "status": "completed",
        }
        self.items.append(call)
        added = call | {"arguments": "", "status": "in_progress"}
        return events + [
            self._at("response.output_item.added", {"item": added}),
            self._at("response.function_call_arguments.delta", {"item_id": call["id"], "delta": piece.arguments}),
            self._at("response.function_call_arguments.done", {"item_id": call["id"], "arguments": piece.arguments}),
            self._at("response.output_item.done", {"item": call}),
        ]

    def _at(self, name: str, data: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """An event of the last output item, with that item's index in the response's output."""
        return name, {**data, "output_index": len(self.items) - 1}

    def _close_message(self) -> list[tuple[str, dict[str, Any]]]:
        if not self.items or self.items[-1]["type"] != "message" or self.items[-1]["status"] == "completed":
            return []
        item = self.items[-1]
        item["status"] = "completed"
        part = item["content"][0]
        return [
            self._at("response.output_text.done", {"item_id": item["id"], "content_index": 0, "text": part["text"]}),
            self._at("response.content_part.done", {"item_id": item["id"], "content_index": 0, "part": part}),
            self._at("response.output_item.done", {"item": item}),
        ]

    def response(self, status: str) -> dict[str, Any]:
        usage = self.last.usage if self.last else None
        body = self.body
        done = self.last is not None and self.last.finished
        cut = done and self.last is not None and self.last.finish_reason == "length"
        final = "incomplete" if cut else "completed" if done else status
        return {
            "id": self.ident,
            "object": "response",
            "created_at": self.created,
            "status": final,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "error": None,
            "model": self.serving.core.model_id,
            "instructions": body.instructions,
            "output": self.items if done else [],
            "parallel_tool_calls": body.parallel_tool_calls,
            "tool_choice": _tool_choice(body.tool_choice),
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "temperature": body.temperature,
            "top_p": body.top_p,
            "max_output_tokens": body.max_output_tokens,
            "previous_response_id": body.previous_response_id,
            "store": body.store,
            "text": body.text.model_dump(by_alias=True, exclude_none=True)
            if body.text
            else {"format": {"type": "text"}},
            "metadata": {},
            "usage": None
            if usage is None or not done
            else {
                "input_tokens": usage.prompt_tokens,
                "input_tokens_details": {"cached_tokens": usage.cached_tokens},
                "output_tokens": usage.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            },
        }

    def _keep(self) -> None:
        """Keep the conversation with this reply in it, for a later `previous_response_id`."""
        if not self.body.store:
            return
        reply: dict[str, Any] = {"role": "assistant", "content": ""}
        for item in self.items:
            if item["type"] == "message":
                reply["content"] += item["content"][0]["text"]
            else:
                call = {"name": item["name"], "arguments": json.loads(item["arguments"])}
                reply.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": call})
        self.serving.store.put(self.ident, self.messages + [reply])

    def _pieces(self, output: RequestOutput) -> list[Piece]:
        self.last = output
        return split(self.splitter, output)

    async def whole(self, events: AsyncGenerator[Event, None]) -> dict[str, Any]:
        async with aclosing(events):
            async for event in events:
                if event is not None:
                    for piece in self._pieces(event[1]):
                        self.add(piece)
        self._close_message()
        self._keep()
        return self.response("completed")

    async def stream(self, events: AsyncGenerator[Event, None]) -> AsyncIterator[str]:
        yield self._event("response.created", {"response": self.response("in_progress")})
        yield self._event("response.in_progress", {"response": self.response("in_progress")})
        try:
            async with aclosing(events):
                async for event in events:
                    if event is None:
                        continue
                    for piece in self._pieces(event[1]):
                        for name, data in self.add(piece):
                            yield self._event(name, data)
        except RequestFailed as exc:
            yield self._event("error", error_body(ServingError(500, str(exc), kind="server_error"))["error"])
            return
        for name, data in self._close_message():
            yield self._event(name, data)
        self._keep()
        final = self.response("completed")
        yield self._event(
            "response.incomplete" if final["status"] == "incomplete" else "response.completed", {"response": final}
        )

    def _event(self, name: str, data: dict[str, Any]) -> str:
        """One typed event, numbered in the stream."""
        payload = {"type": name, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return f"event: {name}\ndata: {json.dumps(payload)}\n\n"


def _tool_choice(choice: str | NamedFunction | None) -> str | dict[str, Any]:
    """The request's tool choice as a response echoes it: `auto` unless it gave one."""
    return choice.model_dump() if isinstance(choice, NamedFunction) else choice or "auto"
