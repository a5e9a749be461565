"""OpenAI's chat and completions endpoints over the async engine: each HTTP request becomes `n`
engine requests, their outputs one response or one stream of Server-Sent Events.

A client that goes away (mid-prefill or mid-stream) is aborted at once and its pages freed:
Starlette cancels a streaming response when its client disconnects, and `until_done` does the
same for the others.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from contextlib import aclosing
from dataclasses import replace
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import Response, StreamingResponse

from ...cache.prefix_cache import check_salt
from ...engine.async_llm import AsyncLLM
from ...engine.outputs import RequestOutput, Usage
from ...engine.sampling import TokenLogprob
from ...engine.sampling_params import MAX_LOGPROBS, SamplingParams
from ...errors import RequestFailed
from ..metrics import Metrics
from ..prompts import prompt_ids
from .protocol import APIError, Body, ChatBody, CompletionBody, sse, usage_json
from .tool_calls import Piece, ToolCall, ToolCallStream, tool_grammar

Event = tuple[int, RequestOutput] | None  # (choice index, output), or None for a keepalive
Choice = tuple[list[int], SamplingParams]  # one choice's prompt and sampling


def _choices(runs: list[Choice], n: int) -> list[Choice]:
    """`n` choices of each prompt, in OpenAI's index order. With a seed, choice j of a prompt
    draws with seed + j, so that each choice is its own reproducible stream (as OpenAI's and
    vLLM's are), and choice 0 is what the same request with n=1 gives."""
    return [
        (prompt, params if params.seed is None or j == 0 else replace(params, seed=(params.seed + j) % 2**64))
        for prompt, params in runs
        for j in range(n)
    ]


class OpenAIServing:
    """Turns chat and completions bodies into engine requests and their outputs into OpenAI's JSON."""

    def __init__(self, llm: AsyncLLM, model_id: str, metrics: Metrics, max_queue: int, keepalive_s: float) -> None:
        self.llm, self.model_id, self.metrics = llm, model_id, metrics
        self.max_queue, self.keepalive_s = max_queue, keepalive_s
        self.tokenizer = llm.engine.tokenizer

    async def chat(self, body: ChatBody, request: HTTPRequest) -> Any:
        self._check_model(body)
        tools, constraint = self._tools(body)
        try:
            messages = [m.as_template_input() for m in body.messages]
            prompt = prompt_ids(self.tokenizer, messages, tools=tools)
        except Exception as exc:
            raise APIError(400, f"the messages do not fit the model's chat template: {exc}", "messages") from None
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}]", "top_logprobs")
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = self._params(body, prompt, limit, (body.top_logprobs or 0) if body.logprobs else None, constraint)
        await self._compile(params, body, constraint is not None)
        return await self._respond(body, _choices([(prompt, params)], body.n), request, "chat.completion", tools)

    def _tools(self, body: ChatBody) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
        """The functions the template shows, and the constraint that holds the reply to calls
        when `tool_choice` is 'required' or names one."""
        try:
            tools, forced = body.offered_tools(), body.forced_tools()
            if tools and not self.tokenizer.has_tool_calling:
                raise ValueError("this model's chat template has no tool calls (mlx-lm finds no tool-call format)")
            grammar = tool_grammar(self.tokenizer, forced, body.parallel_tool_calls) if forced else None
        except ValueError as exc:
            raise APIError(400, str(exc), "tool_choice" if body.tool_choice else "tools") from None
        return tools, {"grammar": grammar} if grammar else None

    async def _compile(self, params: SamplingParams, body: Body, tools_forced: bool = False) -> None:
        """Compile the request's constraint before any reply starts (on a worker thread: a large
        schema takes a while), so that one llguidance refuses is a 400 naming where it came from."""
        try:
            await asyncio.to_thread(self.llm.engine.structured.matcher, params)
        except ValueError as exc:
            sources = (
                ("response_format", body.response_format is not None and body.response_format.constraint()),
                ("structured_outputs", body.structured_outputs is not None),
                ("tool_choice", tools_forced),
            )
            field = str(exc).split()[0]  # the SamplingParams field named at the start of the message
            source = next((name for name, given in sources if given), field)
            raise APIError(400, str(exc) if source == field else f"{source}: {exc}", source) from None

    async def completions(self, body: CompletionBody, request: HTTPRequest) -> Any:
        """One prompt, or a batch of them (OpenAI's list of strings or of token-id lists): choices
        come prompt after prompt, `n` each."""
        self._check_model(body)
        if body.logprobs is not None and not 0 <= body.logprobs <= 5:
            raise APIError(400, "logprobs must be an integer in [0, 5]", "logprobs")
        batch = body.prompts()
        runs = []
        for index, text in enumerate(batch):
            try:
                prompt = self.llm.engine.encode(text)
            except (TypeError, ValueError) as exc:
                raise APIError(400, str(exc) if len(batch) == 1 else f"prompt {index}: {exc}", "prompt") from None
            max_tokens = 16 if body.max_tokens is None else body.max_tokens
            runs.append((prompt, self._params(body, prompt, max_tokens, body.logprobs)))
        await self._compile(runs[0][1], body)
        return await self._respond(body, _choices(runs, body.n), request, "text_completion")

    def _check_model(self, body: Body) -> None:
        if body.model is not None and body.model != self.model_id:
            raise APIError(
                404,
                f"model {body.model!r} does not exist; this server runs {self.model_id!r}",
                "model",
                "model_not_found",
            )

    def _check_queue(self, choices: int) -> None:
        if self.llm.engine.num_waiting + choices > self.max_queue:
            raise APIError(
                503,
                f"the server is busy ({self.max_queue} requests waiting); retry shortly",
                code="queue_full",
                kind="server_error",
                headers={"Retry-After": "1"},
            )

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
        most = self.llm.engine.max_request_tokens
        room = most - len(prompt)  # what the context leaves for the reply
        if room < 1:
            raise APIError(
                400,
                f"the prompt has {len(prompt)} tokens; this server holds at most {most} per request, prompt and reply",
                None,
                "context_length_exceeded",
            )
        limit = room if max_tokens is None else min(room, max_tokens) if max_tokens >= 1 else max_tokens
        try:
            check_salt(body.cache_salt)
            return body.sampling(limit, logprobs, constraint)
        except ValueError as exc:
            raise APIError(400, str(exc), str(exc).split()[0]) from None

    async def _respond(
        self, body: Body, choices: list[Choice], request: HTTPRequest, kind: str, tools: Sequence[dict[str, Any]] = ()
    ) -> Any:
        """The response: one JSON body, or a stream; with `tools`, each choice's text split into
        content and tool calls."""
        self._check_queue(len(choices))
        ident = f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}"
        head = {"id": ident, "created": int(time.time()), "model": self.model_id}
        events = self._run(choices, body.cache_salt)
        n = len(choices)
        splits = [ToolCallStream(self.tokenizer, list(tools)) if tools else None for _ in range(n)]
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            stream = self._stream(events, head, kind, splits, body.n, usage)
            return StreamingResponse(stream, media_type="text/event-stream")
        return await until_done(self._collect(events, head, kind, splits, body.n), request)

    async def _run(self, choices: list[Choice], salt: str | None) -> AsyncGenerator[Event, None]:
        """The outputs of every choice as they come, tagged by choice index; None every
        `keepalive_s` without any. Leaving early aborts every choice still running."""
        queue: asyncio.Queue[tuple[int, RequestOutput | None, Exception | None]] = asyncio.Queue()
        n = len(choices)
        timer = self.metrics.timer(n)

        async def pump(index: int) -> None:
            prompt, params = choices[index]
            try:
                async with aclosing(self.llm.outputs(prompt, params, cache_salt=salt)) as outputs:
                    async for output in outputs:
                        timer.observe(index, output)
                        await queue.put((index, output, None))
            except Exception as exc:  # handed to the consumer, which raises it
                await queue.put((index, None, exc))

        tasks = [asyncio.create_task(pump(i)) for i in range(n)]
        try:
            finished = 0
            while finished < n:
                try:
                    index, output, error = await asyncio.wait_for(queue.get(), self.keepalive_s)
                except asyncio.TimeoutError:
                    yield None
                    continue
                if error is not None:
                    raise error
                assert output is not None
                finished += output.finished
                yield index, output
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

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
                pieces[index] += _split(splits[index], output)
                logprobs[index] += output.logprobs
                reasons[index], usages[index] = output.finish_reason, output.usage
        choices = []
        for i in range(n):
            text, calls = _text(pieces[i]), [p for p in pieces[i] if isinstance(p, ToolCall)]
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
                    pieces = _split(splits[index], output)
                    for call in (p for p in pieces if isinstance(p, ToolCall)):
                        for delta in _call_deltas(call, len(calls[index])):
                            tool_delta = {"index": index, "delta": {"tool_calls": [delta]}, "finish_reason": None}
                            yield sse({**chunk, "choices": [{**tool_delta, "logprobs": None}]})
                        calls[index].append(call)
                    text = _text(pieces)
                    if text or output.finished or output.logprobs:
                        reason = _reason(output.finish_reason, calls[index])
                        choice = self._choice(kind, index, text, reason, list(output.logprobs))
                        yield sse({**chunk, "choices": [choice]})
            except RequestFailed as exc:  # the status line has gone: the error travels as an event
                yield sse(APIError(500, str(exc), kind="server_error").body())
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


def _split(split: ToolCallStream | None, output: RequestOutput) -> list[Piece]:
    """An output's new text as content and tool calls (all content when no tools were offered)."""
    if split is None:
        return [output.delta] if output.delta else []
    return split.feed(output.delta) + (split.close() if output.finished else [])


def _text(pieces: list[Piece]) -> str:
    return "".join(p for p in pieces if isinstance(p, str))


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
