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
from ...engine.sampling.sampler import TokenLogprob as TokenScore
from ..core import ServingCore
from ..errors import ServingError
from ..replies import Waiting
from ..tool_calls import Piece
from .protocol import TokenLogprob, token_logprobs
from .responses_protocol import (
    Deleted,
    Event,
    FunctionCallItem,
    IncompleteDetails,
    InputDetails,
    MessageItem,
    NamedFunction,
    OutputDetails,
    OutputItem,
    OutputText,
    ReasoningItem,
    ReasoningText,
    Response,
    ResponsesBody,
    ResponseUsage,
    SummaryText,
    template_inputs,
)

STORE_SIZE = 1024  # responses kept for previous_response_id, the least recently used dropped first


class ResponseStore:
    """The kept responses by id, each with its conversation (its messages, the reply's included);
    the `STORE_SIZE` most recently used are kept."""

    def __init__(self) -> None:
        self._kept: OrderedDict[str, tuple[Response, list[dict[str, Any]]]] = OrderedDict()
        self._lock = threading.Lock()

    def conversation(self, ident: str) -> list[dict[str, Any]]:
        """The messages of response `ident`'s conversation, for a `previous_response_id`."""
        try:
            return list(self._get(ident)[1])
        except ServingError:
            raise ServingError(400, f"previous response {ident!r} is not kept here", "previous_response_id") from None

    def response(self, ident: str) -> Response:
        return self._get(ident)[0]

    def delete(self, ident: str) -> Deleted:
        with self._lock:
            if self._kept.pop(ident, None) is None:
                raise _not_kept(ident)
        return Deleted(id=ident)

    def put(self, response: Response, messages: list[dict[str, Any]]) -> None:
        with self._lock:
            self._kept[response.id] = (response, messages)
            while len(self._kept) > STORE_SIZE:
                self._kept.popitem(last=False)

    def _get(self, ident: str) -> tuple[Response, list[dict[str, Any]]]:
        with self._lock:
            if ident not in self._kept:
                raise _not_kept(ident)
            self._kept.move_to_end(ident)
            return self._kept[ident]


def _not_kept(ident: str) -> ServingError:
    return ServingError(404, f"response {ident!r} is not kept here", None, "not_found", "not_found_error")


def stream_failed(error: ServingError, sequence: int = 0) -> list[str]:
    """How a Responses stream ends on an error: its `error` event, numbered `sequence`."""
    event = Event(type="error", sequence_number=sequence, code=error.code or error.kind, message=str(error))
    return [event.model_copy(update={"param": error.param}).sse()]


WAITING = Waiting("text/event-stream", lambda: ": keepalive\n\n", stream_failed)  # a stream whose model loads first


class ResponsesServing:
    """Turns Responses bodies into engine requests and their outputs into response objects and events."""

    def __init__(self, core: ServingCore, store: ResponseStore) -> None:
        """`store`: the responses kept, which every model's serving shares (a conversation may
        go on with another model)."""
        self.core, self.store = core, store

    async def create(self, body: ResponsesBody, request: HTTPRequest) -> Any:
        history = self.store.conversation(body.previous_response_id) if body.previous_response_id else []
        with self.core.reading("input"):
            messages = history + template_inputs(body.input)
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        field = "tool_choice" if body.tool_choice else "tools"
        tools = self.core.tools(body.shown_tools(), body.forced_tools(), body.parallel_tool_calls, field)
        misplaced = body.misplaced_constraints()  # before the prompt is built: a bad body costs nothing
        if misplaced:
            message = f"{misplaced[0]} is not a Responses field: this API constrains its output through text.format"
            raise ServingError(400, message, misplaced[0])
        with self.core.reading("chat_template_kwargs"):
            kwargs = body.template_kwargs()
        prompt = await self.core.chat_prompt(system + messages, tools, "input", template_kwargs=kwargs)
        fields: dict[str, Any] = self.core.defaults | body.effort_fields() | body.sampling_fields()
        fields = tools.constrain(fields | body.constraint())
        params = self.core.sampling(
            prompt, body.max_output_tokens, fields | {"logprobs": body.logprobs}, {"logprobs": "top_logprobs"}
        )
        source = tools.source if fields.get("grammar") else "text.format" if body.constraint() else None
        run = await self.core.start([(prompt, params)], tools, source)
        reply = _Reply(self, body, messages, f"resp_{uuid.uuid4().hex}")
        if body.stream:
            return StreamingResponse(run.stream(reply), media_type="text/event-stream")
        replies = await run.collect(request)
        if not isinstance(replies, list):
            return replies
        reply.last = replies[0].last
        reply.pending = list(replies[0].logprobs)
        if replies[0].reasoning:
            reply.think(replies[0].reasoning)
        for piece in replies[0].pieces:
            reply.add(piece)
        reply.close_reasoning()
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
        self.pending: list[TokenScore] = []  # log-probabilities of tokens whose text has not gone yet
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
        """The pieces' events; the log-probabilities of tokens so far go with the next text."""
        self.last = output
        self.pending += output.logprobs
        thought = self.think(output.reasoning) if output.reasoning else []
        return thought + [event for piece in pieces for event in self.add(piece)]

    def failed(self, error: ServingError) -> Iterable[str]:
        self.sequence += 1
        return stream_failed(error, self.sequence - 1)

    def closing(self) -> Iterable[str]:
        events = self.close_reasoning() + self.close_message()
        self.keep()
        final = self.response("completed")
        done = "response.incomplete" if final.status == "incomplete" else "response.completed"
        return events + [self._event(done, response=final)]

    def think(self, text: str) -> list[str]:
        """The events of reasoning text: it grows the reasoning item (opened first, if need be)."""
        events = []
        if not self.items or not isinstance(self.items[-1], ReasoningItem):
            item = ReasoningItem(
                type="reasoning", id=f"rs_{uuid.uuid4().hex}", summary=[], content=[], status="in_progress"
            )
            self.items.append(item)
            empty = SummaryText(type="summary_text", text="")
            events += [
                self._at("response.output_item.added", item=item.model_copy(deep=True)),
                self._at("response.reasoning_summary_part.added", item_id=item.id, summary_index=0, part=empty),
            ]
            item.summary, item.content = (
                [SummaryText(type="summary_text", text="")],
                [ReasoningText(type="reasoning_text", text="")],
            )
        reasoning = self.items[-1]
        assert isinstance(reasoning, ReasoningItem)
        reasoning.summary[0].text += text
        reasoning.content[0].text += text
        return events + [
            self._at("response.reasoning_summary_text.delta", item_id=reasoning.id, summary_index=0, delta=text)
        ]

    def close_reasoning(self) -> list[str]:
        """Complete the open reasoning item, if any: its summary's text, part and item done events."""
        item = self.items[-1] if self.items else None
        if not isinstance(item, ReasoningItem) or item.status == "completed":
            return []
        item.status = "completed"
        summary = item.summary[0]
        return [
            self._at("response.reasoning_summary_text.done", item_id=item.id, summary_index=0, text=summary.text),
            self._at("response.reasoning_summary_part.done", item_id=item.id, summary_index=0, part=summary),
            self._at("response.output_item.done", item=item),
        ]

    def add(self, piece: Piece) -> list[str]:
        """The events of one piece: text grows the open message item (with the log-probabilities
        of the tokens since the last text, where they were asked for), a call is an item of its own."""
        if isinstance(piece, str):
            events = self.close_reasoning()
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
            logprobs, self.pending = self.scored(self.pending), []
            delta = self._at(
                "response.output_text.delta", item_id=message.id, content_index=0, delta=piece, logprobs=logprobs
            )
            return events + [delta]
        events = self.close_reasoning() + self.close_message()
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
        self.scored(self.pending)  # those of tokens that made no text (yet): the message's all the same
        self.pending = []
        part = item.content[0]
        return [
            self._at(
                "response.output_text.done", item_id=item.id, content_index=0, text=part.text, logprobs=part.logprobs
            ),
            self._at("response.content_part.done", item_id=item.id, content_index=0, part=part),
            self._at("response.output_item.done", item=item),
        ]

    def scored(self, scores: list[TokenScore]) -> list[TokenLogprob]:
        """`scores` as the Responses API sends them, added to the open message's text part."""
        logprobs = token_logprobs(self.serving.core.tokenizer.decode, scores)
        message = next((item for item in reversed(self.items) if isinstance(item, MessageItem)), None)
        if message is not None:
            part = message.content[0]
            part.logprobs = part.logprobs + logprobs  # assigned, so that a dump with exclude_unset has it
        return logprobs

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
                input_tokens_details=InputDetails(
                    cached_tokens=usage.cached_tokens,
                    cache_write_tokens=max(0, usage.pinned_tokens - usage.cached_tokens),
                ),
                output_tokens=usage.completion_tokens,
                output_tokens_details=OutputDetails(reasoning_tokens=usage.reasoning_tokens),
                total_tokens=usage.prompt_tokens + usage.completion_tokens,
            ),
        )

    def keep(self) -> None:
        """Keep the conversation with this reply in it, for a later `previous_response_id`."""
        if not self.body.store:
            return
        reply: dict[str, Any] = {"role": "assistant", "content": ""}
        for item in self.items:
            if isinstance(item, ReasoningItem):
                reply["reasoning_content"] = item.content[0].text
            elif isinstance(item, MessageItem):
                reply["content"] += item.content[0].text
            else:
                call = {"name": item.name, "arguments": json.loads(item.arguments)}
                reply.setdefault("tool_calls", []).append({"id": item.call_id, "type": "function", "function": call})
        self.serving.store.put(self.response("completed"), self.messages + [reply])

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
