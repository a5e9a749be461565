"""OpenAI's chat and completions endpoints over the serving core: each HTTP request becomes `n`
engine requests, their outputs one response or one stream of Server-Sent Events."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from ...cache.pins import Pin
from ...cache.prefix_cache import check_salt
from ...engine.outputs import Usage
from ...engine.sampling.params import MAX_LOGPROBS, SamplingParams
from ...engine.sampling.sampler import TokenLogprob
from ...errors import RequestFailed
from ..core import (
    Choice,
    Event,
    ServingCore,
    ServingError,
    Tools,
    pin_of,
    refused_as,
    seeded_choices,
    split,
    text_of,
    until_done,
)
from ..tool_calls import Piece, ToolCall, ToolCallStream
from .protocol import Body, ChatBody, CompletionBody, error_body, sse, usage_json


class OpenAIServing:
    """Turns chat and completions bodies into engine requests and their outputs into OpenAI's JSON."""

    def __init__(self, core: ServingCore) -> None:
        self.core = core
        self.tokenizer = core.tokenizer

    async def chat(self, body: ChatBody, request: HTTPRequest) -> Any:
        self.core.check_model(body.model)
        field = "tool_choice" if body.tool_choice else "tools"
        tools = self.core.tools(body.shown_tools(), body.forced_tools(), body.parallel_tool_calls, field)
        with refused_as("messages"):
            messages = [m.as_template_input() for m in body.messages]
        prompt = self.core.chat_prompt(messages, tools)
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
            raise ServingError(400, f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}]", "top_logprobs")
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        constraint = {"grammar": tools.grammar} if tools.grammar else None
        params = self._params(body, prompt, limit, (body.top_logprobs or 0) if body.logprobs else None, constraint)
        await self.core.compile(params, _source(body, constraint is not None))
        choices = seeded_choices([(prompt, params)], body.n)
        return await self._respond(body, choices, request, "chat.completion", self._pin(body, [prompt]), tools)

    async def completions(self, body: CompletionBody, request: HTTPRequest) -> Any:
        """One prompt, or a batch of them (OpenAI's list of strings or of token-id lists): choices
        come prompt after prompt, `n` each."""
        self.core.check_model(body.model)
        if body.logprobs is not None and not 0 <= body.logprobs <= 5:
            raise ServingError(400, "logprobs must be an integer in [0, 5]", "logprobs")
        batch = body.prompts()
        runs = []
        for index, text in enumerate(batch):
            try:
                prompt = self.core.encode(text)
            except (TypeError, ValueError) as exc:
                raise ServingError(400, str(exc) if len(batch) == 1 else f"prompt {index}: {exc}", "prompt") from None
            max_tokens = 16 if body.max_tokens is None else body.max_tokens
            runs.append((prompt, self._params(body, prompt, max_tokens, body.logprobs)))
        await self.core.compile(runs[0][1], _source(body, False))
        pin = self._pin(body, [prompt for prompt, _ in runs])
        return await self._respond(body, seeded_choices(runs, body.n), request, "text_completion", pin)

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
            return body.sampling(limit, logprobs, constraint)

    async def _respond(
        self,
        body: Body,
        choices: list[Choice],
        request: HTTPRequest,
        kind: str,
        pin: Pin | None,
        tools: Tools | None = None,
    ) -> Any:
        """The response: one JSON body, or a stream; with tools shown, each choice's text split
        into content and tool calls."""
        self.core.check_queue(len(choices))
        ident = f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}"
        head = {"id": ident, "created": int(time.time()), "model": self.core.model_id}
        events = self.core.run(choices, body.cache_salt, pin)
        splits = self.core.splitters(len(choices), tools)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            stream = self._stream(events, head, kind, splits, body.n, usage)
            return StreamingResponse(stream, media_type="text/event-stream")
        return await until_done(self._collect(events, head, kind, splits, body.n), request)

    @staticmethod
    def _pin(body: Body, prompts: list[list[int]]) -> Pin | None:
        """What an extra `cache_control` field (Anthropic's, `{"type": "ephemeral", "ttl": "5m"}`)
        pins: the whole prompt, of a request with one."""
        mark = (body.model_extra or {}).get("cache_control")
        return pin_of(mark, len(prompts[0])) if mark is not None and len(prompts) == 1 else None

    async def _collect(
        self,
        events: AsyncGenerator[Event, None],
        head: dict[str, Any],
        kind: str,
        splits: list[ToolCallStream | None],
        per_prompt: int,
    ) -> dict[str, Any]:
        n = len(splits)
        pieces: list[list[Piece]] = [[] for _ in range(n)]
        logprobs: list[list[TokenLogprob]] = [[] for _ in range(n)]
        reasons: list[str | None] = [None] * n
        usages: list[Usage | None] = [None] * n
        async with aclosing(events):
            async for event in events:
                if event is None:
                    continue
                index, output = event
                pieces[index] += split(splits[index], output)
                logprobs[index] += output.logprobs
                reasons[index], usages[index] = output.finish_reason, output.usage
        choices = []
        for i in range(n):
            text, calls = text_of(pieces[i]), [p for p in pieces[i] if isinstance(p, ToolCall)]
            choices.append(self._choice(kind, i, text, _reason(reasons[i], calls), logprobs[i], True, calls))
        return {**head, "object": kind, "choices": choices, "usage": usage_json(usages, per_prompt)}

    async def _stream(
        self,
        events: AsyncGenerator[Event, None],
        head: dict[str, Any],
        kind: str,
        splits: list[ToolCallStream | None],
        per_prompt: int,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        """Server-Sent Events: a chat choice's tool calls as OpenAI streams them (id and name,
        then the arguments), before the content that came with them."""
        n = len(splits)
        chunk = {**head, "object": "chat.completion.chunk" if kind == "chat.completion" else kind}
        usages: list[Usage | None] = [None] * n
        calls: list[list[ToolCall]] = [[] for _ in range(n)]
        async with aclosing(events):
            if kind == "chat.completion":
                for i in range(n):
                    first = {"role": "assistant", "content": ""}
                    yield sse(
                        {**chunk, "choices": [{"index": i, "delta": first, "logprobs": None, "finish_reason": None}]}
                    )
            try:
                async for event in events:
                    if event is None:
                        yield ": keepalive\n\n"
                        continue
                    index, output = event
                    usages[index] = output.usage
                    pieces = split(splits[index], output)
                    for call in (p for p in pieces if isinstance(p, ToolCall)):
                        for delta in _call_deltas(call, len(calls[index])):
                            tool_delta = {"index": index, "delta": {"tool_calls": [delta]}, "finish_reason": None}
                            yield sse({**chunk, "choices": [{**tool_delta, "logprobs": None}]})
                        calls[index].append(call)
                    text = text_of(pieces)
                    if text or output.finished or output.logprobs:
                        reason = _reason(output.finish_reason, calls[index])
                        choice = self._choice(kind, index, text, reason, list(output.logprobs))
                        yield sse({**chunk, "choices": [choice]})
            except RequestFailed as exc:  # the status line has gone: the error travels as an event
                yield sse(error_body(ServingError(500, str(exc), kind="server_error")))
                return
        if include_usage:
            yield sse({**chunk, "choices": [], "usage": usage_json(usages, per_prompt)})
        yield sse("[DONE]")

    def _choice(
        self,
        kind: str,
        index: int,
        text: str,
        reason: str | None,
        scores: list[TokenLogprob],
        final: bool = False,
        calls: list[ToolCall] | None = None,
    ) -> dict[str, Any]:
        wanted = bool(scores)
        if kind == "chat.completion":
            part: dict[str, Any] = {"content": text}
            if final:
                part = {"role": "assistant", "content": text or (None if calls else "")}
                if calls:
                    part["tool_calls"] = [call.as_json() for call in calls]
            return {
                "index": index,
                "message" if final else "delta": part,
                "finish_reason": reason,
                "logprobs": {"content": [self._chat_logprob(s) for s in scores]} if wanted else None,
            }
        return {
            "index": index,
            "text": text,
            "finish_reason": reason,
            "logprobs": self._legacy_logprobs(scores) if wanted else None,
        }

    def _token_text(self, token: int) -> str:
        text: str = self.tokenizer.decode([token])
        return text

    def _chat_logprob(self, score: TokenLogprob) -> dict[str, Any]:
        top = [
            {"token": self._token_text(t), "logprob": lp, "bytes": list(self._token_text(t).encode())}
            for t, lp in score.top
        ]
        text = self._token_text(score.token)
        return {"token": text, "logprob": score.logprob, "bytes": list(text.encode()), "top_logprobs": top}

    def _legacy_logprobs(self, scores: list[TokenLogprob]) -> dict[str, Any]:
        tokens = [self._token_text(s.token) for s in scores]
        offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        return {
            "tokens": tokens,
            "token_logprobs": [s.logprob for s in scores],
            "top_logprobs": [{self._token_text(t): lp for t, lp in s.top} for s in scores],
            "text_offset": offsets,
        }


def _reason(reason: str | None, calls: list[ToolCall]) -> str | None:
    """OpenAI's finish reason: a reply that ended by itself after calling tools ends in "tool_calls"."""
    return "tool_calls" if calls and reason == "stop" else reason


def _call_deltas(call: ToolCall, index: int) -> list[dict[str, Any]]:
    """A tool call as OpenAI streams it: its id and name first, then its arguments."""
    head = call.as_json(index)
    return [
        {**head, "function": {"name": call.name, "arguments": ""}},
        {"index": index, "function": {"arguments": call.arguments}},
    ]


def _source(body: Body, tools_forced: bool) -> str | None:
    """Where a request's constraint came from, to name in an error: `response_format`,
    `structured_outputs` or `tool_choice` (None: a field of its own)."""
    sources = (
        ("response_format", body.response_format is not None and body.response_format.constraint()),
        ("structured_outputs", body.structured_outputs is not None),
        ("tool_choice", tools_forced),
    )
    return next((name for name, given in sources if given), None)
