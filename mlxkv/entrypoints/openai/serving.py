"""OpenAI's chat and completions endpoints over the serving core: each HTTP request becomes `n`
engine requests, their outputs one response or one stream of Server-Sent Events."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from typing import Any, Literal

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from ...cache.pins import Pin
from ...cache.prefix_cache import check_salt
from ...engine.outputs import RequestOutput, Usage
from ...engine.sampling import sampler
from ...engine.sampling.params import MAX_LOGPROBS, SamplingParams
from ..core import Choice, ServingCore, Tools, pin_of, seeded_choices
from ..errors import ServingError, refused_as
from ..replies import Run, Waiting, text_of
from ..tool_calls import Piece, ToolCall
from .protocol import (
    AssistantMessage,
    Body,
    CalledFunction,
    ChatBody,
    ChatChoice,
    ChatLogprobs,
    ChunkChoice,
    CompletionBody,
    CompletionChoice,
    CompletionLogprobs,
    Delta,
    FunctionDelta,
    MessageToolCall,
    OpenAIUsage,
    Reply,
    ToolCallDelta,
    error_body,
    sse,
    token_logprobs,
    usage_of,
)

Kind = Literal["chat.completion", "text_completion"]
CHAT: Kind = "chat.completion"
COMPLETION: Kind = "text_completion"


KEEPALIVE = ": keepalive\n\n"  # an SSE comment, which clients skip


def stream_failed(error: ServingError) -> list[str]:
    """How a chat or completions stream ends on an error: OpenAI's error object, then `[DONE]`."""
    return [sse(error_body(error).model_dump()), sse("[DONE]")]


WAITING = Waiting("text/event-stream", lambda: KEEPALIVE, stream_failed)  # a stream whose model loads first


class OpenAIServing:
    """Turns chat and completions bodies into engine requests and their outputs into OpenAI's JSON."""

    def __init__(self, core: ServingCore) -> None:
        self.core = core
        self.tokenizer = core.tokenizer

    async def chat(self, body: ChatBody, request: HTTPRequest) -> Any:
        field = "tool_choice" if body.tool_choice else "tools"
        tools = self.core.tools(body.shown_tools(), body.forced_tools(), body.parallel_tool_calls, field)
        with self.core.reading("messages"):
            messages = [m.as_template_input() for m in body.messages]
        with self.core.reading("chat_template_kwargs"):
            kwargs = body.template_kwargs()
        prompt = await self.core.chat_prompt(messages, tools, salt=body.cache_salt, template_kwargs=kwargs)
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
            raise ServingError(400, f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}]", "top_logprobs")
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        constraint = tools.constrain({}) if tools.forced or _source(body, None) is None else None
        params = self._params(body, prompt, limit, (body.top_logprobs or 0) if body.logprobs else None, constraint)
        choices = seeded_choices([(prompt, params)], body.n)
        return await self._respond(body, choices, request, CHAT, self._pin(body, [prompt]), tools)

    async def completions(self, body: CompletionBody, request: HTTPRequest) -> Any:
        """One prompt, or a batch of them (OpenAI's list of strings or of token-id lists): choices
        come prompt after prompt, `n` each."""
        field = body.unsupported()
        if field is not None:
            raise ServingError(400, f"{field} is not supported by mlxkv's completions", field)
        if body.logprobs is not None and not 0 <= body.logprobs <= 5:
            raise ServingError(400, "logprobs must be an integer in [0, 5]", "logprobs")
        batch = body.prompts()
        runs = []
        for index, text in enumerate(batch):
            try:
                prompt = await self.core.encode(text, salt=body.cache_salt)
            except ServingError as exc:
                raise ServingError(400, f"prompt {index}: {exc}", "prompt") if len(batch) > 1 else exc from None
            max_tokens = 16 if body.max_tokens is None else body.max_tokens
            runs.append((prompt, self._params(body, prompt, max_tokens, body.logprobs)))
        pin = self._pin(body, [prompt for prompt, _ in runs])
        return await self._respond(body, seeded_choices(runs, body.n), request, COMPLETION, pin)

    def _params(
        self,
        body: Body,
        prompt: list[int],
        max_tokens: int | None,
        logprobs: int | None,
        constraint: dict[str, Any] | None = None,
    ) -> SamplingParams:
        """The engine's sampling parameters for `body` (with the server's `constraint` for tool
        calls); `max_tokens` is cut to the room the prompt leaves."""
        limit = self.core.room(prompt, max_tokens)
        with refused_as():
            check_salt(body.cache_salt)
            defaults = self.core.defaults | (body.effort_fields() if isinstance(body, ChatBody) else {})
            return body.sampling(limit, logprobs, defaults, constraint)

    async def _respond(
        self,
        body: Body,
        choices: list[Choice],
        request: HTTPRequest,
        kind: Kind,
        pin: Pin | None,
        tools: Tools | None = None,
    ) -> Any:
        """The response: one JSON body, or a stream; with tools shown, each choice's text split
        into content and tool calls."""
        source = _source(body, tools)
        run = await self.core.start(choices, tools, source, body.cache_salt, pin, continuation=kind == COMPLETION)
        ident = f"{'chatcmpl' if kind == CHAT else 'cmpl'}-{uuid.uuid4().hex}"
        reply = _Reply(self, ident, kind, len(choices), body.n)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(run.stream(_Chunks(reply, usage)), media_type="text/event-stream")
        return await self._whole(run, reply, request)

    async def _whole(self, run: Run, reply: _Reply, request: HTTPRequest) -> Any:
        replies = await run.collect(request)
        if not isinstance(replies, list):
            return replies
        choices = [
            reply.choice(i, r.text, _reason(r.finish_reason, r.calls), r.logprobs, r.calls, r.reasoning)
            for i, r in enumerate(replies)
        ]
        return reply.body(choices, usage_of([r.usage for r in replies], reply.per_prompt)).model_dump(
            exclude_unset=True
        )

    @staticmethod
    def _pin(body: Body, prompts: list[list[int]]) -> Pin | None:
        """What an extra `cache_control` field (Anthropic's, `{"type": "ephemeral", "ttl": "5m"}`)
        pins: the whole prompt, of a request with one."""
        mark = (body.model_extra or {}).get("cache_control")
        return pin_of(mark, len(prompts[0])) if mark is not None and len(prompts) == 1 else None

    def token_text(self, token: int) -> str:
        text: str = self.tokenizer.decode([token])
        return text

    def chat_logprobs(self, scores: list[sampler.TokenLogprob]) -> ChatLogprobs:
        return ChatLogprobs(content=token_logprobs(self.tokenizer.decode, scores))

    def completion_logprobs(self, scores: list[sampler.TokenLogprob]) -> CompletionLogprobs:
        tokens = [self.token_text(s.token) for s in scores]
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[s.logprob for s in scores],
            top_logprobs=[{self.token_text(t): lp for t, lp in s.top} for s in scores],
            text_offset=[sum(len(t) for t in tokens[:i]) for i in range(len(tokens))],
        )


class _Reply:
    """One response's head and choices: `kind` (chat or completion), `n` choices, `per_prompt` each."""

    def __init__(
        self,
        serving: OpenAIServing,
        ident: str,
        kind: Literal["chat.completion", "text_completion"],
        n: int,
        per_prompt: int,
    ) -> None:
        self.serving, self.ident, self.kind, self.n, self.per_prompt = serving, ident, kind, n, per_prompt
        self.created = int(time.time())

    def body(self, choices: list[Any], usage: OpenAIUsage | None = None, chunk: bool = False) -> Reply:
        """The response, or one chunk of the stream, holding `choices` (and `usage`, if given)."""
        kind = "chat.completion.chunk" if chunk and self.kind == CHAT else self.kind
        reply = Reply(
            id=self.ident, object=kind, created=self.created, model=self.serving.core.model_id, choices=choices
        )
        if usage is not None:
            reply.usage = usage
        return reply

    def choice(
        self,
        index: int,
        text: str,
        reason: str | None,
        scores: list[sampler.TokenLogprob],
        calls: list[ToolCall] | None = None,
        reasoning: str = "",
        final: bool = True,
    ) -> Any:
        """A choice of a whole reply (`final`) or of a chunk, with the log-probabilities asked for
        and a thinking model's `reasoning` under both the names clients read."""
        serving = self.serving
        if self.kind == COMPLETION:
            logprobs = serving.completion_logprobs(scores) if scores else None
            return CompletionChoice(index=index, text=text, finish_reason=reason, logprobs=logprobs)
        chat_logprobs = serving.chat_logprobs(scores) if scores else None
        if not final:
            delta = Delta(content=text)
            if reasoning:
                delta.reasoning_content = delta.reasoning = reasoning
            return ChunkChoice(index=index, delta=delta, logprobs=chat_logprobs, finish_reason=reason)
        message = AssistantMessage(role="assistant", content=text or (None if calls else ""))
        if reasoning:
            message.reasoning_content = message.reasoning = reasoning
        if calls:
            message.tool_calls = [
                MessageToolCall(id=c.id, type="function", function=CalledFunction(name=c.name, arguments=c.arguments))
                for c in calls
            ]
        return ChatChoice(index=index, message=message, finish_reason=reason, logprobs=chat_logprobs)


class _Chunks:
    """OpenAI's Server-Sent Events: a chat choice's tool calls as OpenAI streams them (id and name,
    then the arguments), before the content that came with them; a comment line as keepalive."""

    def __init__(self, reply: _Reply, include_usage: bool) -> None:
        self.reply, self.include_usage = reply, include_usage
        self.usages: list[Usage | None] = [None] * reply.n
        self.calls: list[list[ToolCall]] = [[] for _ in range(reply.n)]

    def opening(self) -> Iterable[str]:
        if self.reply.kind != CHAT:
            return []
        first = Delta(role="assistant", content="")
        starts = [ChunkChoice(index=i, delta=first, logprobs=None, finish_reason=None) for i in range(self.reply.n)]
        return [self.reply.body([start], chunk=True).sse() for start in starts]

    def keepalive(self) -> str:
        return KEEPALIVE

    def output(self, index: int, output: RequestOutput, pieces: list[Piece]) -> Iterable[str]:
        self.usages[index] = output.usage
        chunks = []
        for call in (p for p in pieces if isinstance(p, ToolCall)):
            for delta in _call_deltas(call, len(self.calls[index])):
                choice = ChunkChoice(index=index, delta=Delta(tool_calls=[delta]), logprobs=None, finish_reason=None)
                chunks.append(self.reply.body([choice], chunk=True).sse())
            self.calls[index].append(call)
        text = text_of(pieces)
        if text or output.reasoning or output.finished or output.logprobs:
            reason = _reason(output.finish_reason, self.calls[index])
            choice = self.reply.choice(
                index, text, reason, list(output.logprobs), reasoning=output.reasoning, final=False
            )
            chunks.append(self.reply.body([choice], chunk=True).sse())
        return chunks

    def failed(self, error: ServingError) -> Iterable[str]:
        return stream_failed(error)

    def closing(self) -> Iterable[str]:
        usage = [self.reply.body([], usage_of(self.usages, self.reply.per_prompt), chunk=True).sse()]
        return (usage if self.include_usage else []) + [sse("[DONE]")]


def _reason(reason: str | None, calls: list[ToolCall]) -> str | None:
    """OpenAI's finish reason: a reply that ended by itself after calling tools ends in "tool_calls"."""
    return "tool_calls" if calls and reason == "stop" else reason


def _call_deltas(call: ToolCall, index: int) -> list[ToolCallDelta]:
    """A tool call as OpenAI streams it: its id and name first, then its arguments."""
    return [
        ToolCallDelta(index=index, id=call.id, type="function", function=FunctionDelta(name=call.name, arguments="")),
        ToolCallDelta(index=index, function=FunctionDelta(arguments=call.arguments)),
    ]


def _source(body: Body, tools: Tools | None) -> str | None:
    """Where a request's constraint came from, to name in an error: `response_format`,
    `structured_outputs`, or the tools' (`tool_choice` or `tools`); None: a field of its own."""
    sources = (
        ("response_format", body.response_format is not None and body.response_format.constraint()),
        ("structured_outputs", body.structured_outputs is not None),
        (tools.source if tools else "", tools is not None and tools.grammar is not None),
    )
    return next((name for name, given in sources if given), None)
