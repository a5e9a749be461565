"""Anthropic's Messages API over the serving core: `/v1/messages`, whole or as Anthropic's event
stream, and `/v1/messages/count_tokens`.

A reply's text and tool calls become content blocks (`text`, `tool_use`), in the order the model
wrote them, after a thinking model's reasoning as a signed `thinking` block. Streamed, each block
opens, grows (`thinking_delta` then its `signature_delta`, `text_delta`, or the call's whole input
as one `input_json_delta`) and closes; the same splitter makes whole and streamed replies, so they
are equal. A thinking block sent back with a signature this server did not give it is left out of
the prompt. Usage counts the prompt tokens read from the prefix cache as `cache_read_input_tokens`
and the rest as `input_tokens`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from ...cache.pins import Pin
from ...engine import outputs
from ...engine.outputs import RequestOutput
from ..core import ServingCore, Tools, pin_of
from ..errors import ServingError
from ..replies import Waiting
from ..tool_calls import Piece, ToolCall
from .protocol import (
    Content,
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    CountTokensBody,
    InputJsonDelta,
    Message,
    MessageDelta,
    MessagesBody,
    MessageStart,
    MessageStop,
    Ping,
    SignatureDelta,
    Stop,
    TextContent,
    TextDelta,
    ThinkingBlock,
    ThinkingContent,
    ThinkingDelta,
    TokenCount,
    ToolUseContent,
    Usage,
    error_body,
    event,
)
from .signatures import ThinkingSignatures

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


WAITING = Waiting("text/event-stream", lambda: event(Ping()), lambda error: [event(error_body(error))])


class AnthropicServing:
    """Turns Messages bodies into engine requests and their outputs into Anthropic's JSON and events."""

    def __init__(self, core: ServingCore, signatures: ThinkingSignatures | None = None) -> None:
        self.core = core
        self.signatures = signatures or ThinkingSignatures()

    async def messages(self, body: MessagesBody, request: HTTPRequest) -> Any:
        prompt, tools = await self._prompt(body)
        fields = tools.constrain(self.core.defaults | body.sampling_fields())
        params = self.core.sampling(prompt, body.max_tokens, fields, {"stop": "stop_sequences"})
        source = tools.source if fields.get("grammar") else "output_config" if body.output_config else None
        run = await self.core.start([(prompt, params)], tools, source, pin=await self._pin(body, prompt, tools))
        ident = f"msg_{uuid.uuid4().hex[:24]}"
        if body.stream:
            framer = _Events(self._message(ident, [], None, Usage(input_tokens=len(prompt))), self.signatures)
            return StreamingResponse(run.stream(framer), media_type="text/event-stream")
        replies = await run.collect(request)
        if not isinstance(replies, list):
            return replies
        (reply,) = replies
        thought = [self._thinking(reply.reasoning)] if reply.reasoning else []
        return self._message(ident, thought + _blocks(reply.pieces), reply.last, _usage(reply.usage)).model_dump()

    async def count_tokens(self, body: CountTokensBody) -> TokenCount:
        return TokenCount(input_tokens=len((await self._prompt(body))[0]))

    async def _prompt(self, body: CountTokensBody) -> tuple[list[int], Tools]:
        parallel = body.tool_choice is None or not body.tool_choice.disable_parallel_tool_use
        field = "tool_choice" if body.tool_choice else "tools"
        tools = self.core.tools(body.shown_tools(), body.forced_tools(), parallel, field)
        with self.core.reading("messages"):
            messages = body.template_inputs(self._ours)
        return await self.core.chat_prompt(messages, tools, template_kwargs=body.template_kwargs()), tools

    def _ours(self, block: ThinkingBlock) -> bool:
        """Whether a thinking block passed back is one this server wrote, unchanged: only those go
        back into the prompt (another model's, or an edited one, is left out as redacted thinking is)."""
        return block.signature is not None and self.signatures.check(block.thinking, block.signature)

    def _thinking(self, reasoning: str) -> ThinkingContent:
        return ThinkingContent(thinking=reasoning, signature=self.signatures.sign(reasoning))

    async def _pin(self, body: MessagesBody, prompt: list[int], tools: Tools) -> Pin | None:
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
            head = await self.core.chat_prompt(cut.template_inputs(self._ours), tools)
        except ServingError:  # the template will not render the conversation cut there
            return None
        shared = next((k for k, (a, b) in enumerate(zip(head, prompt)) if a != b), min(len(head), len(prompt)))
        return pin_of(mark.model_dump(exclude_none=True), shared)

    def _message(self, ident: str, content: list[Content], last: RequestOutput | None, usage: Usage) -> Message:
        reason, stop = _stop(last, any(isinstance(block, ToolUseContent) for block in content))
        return Message(
            id=ident, model=self.core.model_id, content=content, stop_reason=reason, stop_sequence=stop, usage=usage
        )


class _Events:
    """Anthropic's event stream: `message_start`, each block's start, deltas and stop, `message_delta`
    with the stop reason and usage, `message_stop`; `ping` while there is nothing to send."""

    def __init__(self, start: Message, signatures: ThinkingSignatures) -> None:
        self.start, self.signatures = start, signatures
        self.count = 0  # blocks opened
        self.thinking: str | None = None  # the reasoning so far, while its block is open
        self.answered = False  # a text or tool_use block has opened
        self.text_open = False
        self.called = False
        self.last: RequestOutput | None = None

    def opening(self) -> Iterable[str]:
        return [event(MessageStart(message=self.start))]

    def keepalive(self) -> str:
        return event(Ping())

    def output(self, index: int, output: RequestOutput, pieces: list[Piece]) -> Iterable[str]:
        self.last = output
        thought = self._think(output.reasoning) if output.reasoning else []
        return [event(e) for e in thought] + [event(e) for piece in pieces for e in self._add(piece)]

    def failed(self, error: ServingError) -> Iterable[str]:
        return [event(error_body(error))]

    def closing(self) -> Iterable[str]:
        """The last block's stop (a reply with no blocks at all gets one empty text block), the stop
        reason and usage, and the end."""
        events = self._stop_thinking()
        if not self.answered:
            events += self._start(TextContent(text="")) + [ContentBlockStop(index=self.count - 1)]
        else:
            events += self._stop_text()
        reason, stop = _stop(self.last, self.called)
        usage = _usage(self.last.usage if self.last else None)
        ending = [MessageDelta(delta=Stop(stop_reason=reason, stop_sequence=stop), usage=usage), MessageStop()]
        return [event(e) for e in events + ending]

    def _think(self, reasoning: str) -> list[Any]:
        opened = [] if self.thinking is not None else self._start(ThinkingContent(thinking="", signature=""))
        self.thinking = (self.thinking or "") + reasoning
        return opened + [ContentBlockDelta(index=self.count - 1, delta=ThinkingDelta(thinking=reasoning))]

    def _stop_thinking(self) -> list[Any]:
        """The thinking block's end: its signature, then its stop."""
        if self.thinking is None:
            return []
        signature = SignatureDelta(signature=self.signatures.sign(self.thinking))
        self.thinking = None
        return [ContentBlockDelta(index=self.count - 1, delta=signature), ContentBlockStop(index=self.count - 1)]

    def _add(self, piece: Piece) -> list[Any]:
        if self.thinking is not None:
            return self._stop_thinking() + self._add(piece)
        self.answered = True
        if isinstance(piece, str):
            opened = [] if self.text_open else self._start(TextContent(text=""))
            self.text_open = True
            return opened + [ContentBlockDelta(index=self.count - 1, delta=TextDelta(text=piece))]
        self.called = True
        events = self._stop_text() + self._start(_tool_use(piece).model_copy(update={"input": {}}))
        delta = ContentBlockDelta(index=self.count - 1, delta=InputJsonDelta(partial_json=piece.arguments))
        return events + [delta, ContentBlockStop(index=self.count - 1)]

    def _start(self, block: Content) -> list[Any]:
        self.count += 1
        return [ContentBlockStart(index=self.count - 1, content_block=block)]

    def _stop_text(self) -> list[Any]:
        if not self.text_open:
            return []
        self.text_open = False
        return [ContentBlockStop(index=self.count - 1)]


def _blocks(pieces: list[Piece]) -> list[Content]:
    """A whole reply's content blocks: consecutive text as one block, each call as a `tool_use`."""
    blocks: list[Content] = []
    for piece in pieces:
        if isinstance(piece, ToolCall):
            blocks.append(_tool_use(piece))
        elif blocks and isinstance(blocks[-1], TextContent):
            blocks[-1].text += piece
        else:
            blocks.append(TextContent(text=piece))
    return blocks or [TextContent(text="")]


def _tool_use(call: ToolCall) -> ToolUseContent:
    return ToolUseContent(id="toolu_" + call.id.removeprefix("call_"), name=call.name, input=json.loads(call.arguments))


def _stop(last: RequestOutput | None, called: bool) -> tuple[str | None, str | None]:
    """Anthropic's stop reason and the stop sequence that ended the reply, if one did."""
    if last is None or last.finish_reason is None:
        return None, None
    if last.stop_string is not None:
        return "stop_sequence", last.stop_string
    if called and last.finish_reason == "stop":
        return "tool_use", None
    return STOP_REASONS.get(last.finish_reason, last.finish_reason), None


def _usage(usage: outputs.Usage | None) -> Usage:
    """Anthropic's usage: prompt tokens read from the cache, those written to it for a pin (its
    `cache_control`), and the rest."""
    if usage is None:
        return Usage()
    written = max(0, usage.pinned_tokens - usage.cached_tokens)
    return Usage(
        input_tokens=usage.prompt_tokens - usage.cached_tokens - written,
        output_tokens=usage.completion_tokens,
        cache_read_input_tokens=usage.cached_tokens,
        cache_creation_input_tokens=written,
    )
