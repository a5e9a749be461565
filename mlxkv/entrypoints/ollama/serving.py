"""Ollama's API over the serving core: `/api/chat` and `/api/generate` (newline-delimited JSON
streams by default, one object with `"stream": false`), and `/api/tags`, `/api/show`, `/api/ps` and
`/api/version`, so that apps set up for Ollama work against `mlxkv serve --port 11434`. A chat
without messages or a generate without a prompt is Ollama's idiom to load a model (or, with
`keep_alive` 0, unload it): the router answers it once the model host has done so.

Model names: the catalogue's, with or without Ollama's `:latest` tag. While a stream has nothing
to send (a long prefill) it sends an empty piece of reply, which clients append as nothing.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from datetime import datetime, timezone
from hashlib import sha256
from typing import Any, cast

import mlx.core as mx
from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse
from mlx.utils import tree_flatten

from ...engine.outputs import RequestOutput
from ...models.structure import model_args, text_model
from ..core import ServingCore, Tools
from ..errors import ServingError, UnsupportedContent
from ..replies import Collected, Waiting
from ..tool_calls import Piece, ToolCall
from .protocol import (
    OLLAMA_VERSION,
    Body,
    CalledFunction,
    ChatBody,
    Chunk,
    GenerateBody,
    ModelDetails,
    ModelEntry,
    ModelInfo,
    OllamaToolCall,
    ResponseMessage,
    RunningModel,
    Version,
    with_images,
)

FOREVER = datetime(2318, 1, 1, tzinfo=timezone.utc)  # when a model kept forever expires, as Ollama says it


class OllamaServing:
    """Turns Ollama's bodies into engine requests and their outputs into its JSON lines."""

    def __init__(self, core: ServingCore) -> None:
        self.core = core
        self.created = datetime.now(timezone.utc)
        self.model = text_model(core.llm.engine.runner.model)
        weights = cast("list[tuple[str, mx.array]]", tree_flatten(self.model.parameters()))
        self.parameters = sum(array.size for _, array in weights)
        self.size = sum(array.nbytes for _, array in weights)

    async def chat(self, body: ChatBody, request: HTTPRequest) -> Any:
        tools = self.core.tools(body.tools or [], [], True, "tools")
        with self.core.reading("messages"):
            messages = body.template_inputs()
        prompt = await self.core.chat_prompt(messages, tools, template_kwargs=body.template_kwargs())
        return await self._respond(body, prompt, request, "message", tools)

    async def generate(self, body: GenerateBody, request: HTTPRequest) -> Any:
        completing = body.raw or not self.core.tokenizer.has_chat_template  # the text continues the prompt
        if completing and body.images:
            with self.core.reading("images"):
                if self.core.llm.engine.vision is None:
                    raise UnsupportedContent("image", "images")
                raise ValueError("images go with the chat template; a raw prompt takes none")
        if completing:
            prompt = await self.core.encode((body.system + "\n" if body.system else "") + body.prompt)
        else:
            system = [{"role": "system", "content": body.system}] if body.system else []
            with self.core.reading("images"):
                user = [{"role": "user", "content": with_images(body.prompt, body.images)}]
            prompt = await self.core.chat_prompt(system + user, field="prompt", template_kwargs=body.template_kwargs())
        return await self._respond(body, prompt, request, "response", None, completing)

    async def _respond(
        self,
        body: Body,
        prompt: list[int],
        request: HTTPRequest,
        key: str,
        tools: Tools | None,
        continuation: bool = False,
    ) -> Any:
        options = body.options
        wanted = options.num_predict if options is not None and options.num_predict not in (None, -1) else None
        given = options.sampling_fields() if options else {}
        fields = self.core.defaults | body.think_fields() | given | body.constraint()
        fields = tools.constrain(fields) if tools else fields
        params = self.core.sampling(prompt, wanted, fields)
        source = tools.source if fields.get("grammar") and tools else "format" if body.format is not None else None
        run = await self.core.start([(prompt, params)], tools, source, continuation=continuation)
        lines = _Lines(self.core.model_id, key, time.perf_counter_ns())
        if body.stream:
            return StreamingResponse(run.stream(lines), media_type="application/x-ndjson")
        replies = await run.collect(request)
        return lines.whole(replies[0]) if isinstance(replies, list) else replies

    def running(self, expires_at: datetime, size: int) -> RunningModel:
        """This model as `/api/ps` lists it: loaded until `expires_at`, holding `size` bytes."""
        return running_model(self.entry(), expires_at, size, self.core.llm.engine.max_request_tokens)

    def show(self) -> ModelInfo:
        tokenizer = self.core.tokenizer
        architecture = model_args(self.model).model_type
        return ModelInfo(
            template=(tokenizer.chat_template or "") if tokenizer.has_chat_template else "",
            details=self.entry().details,
            model_info={
                "general.architecture": architecture,
                "general.parameter_count": self.parameters,
                f"{architecture}.context_length": self.core.llm.engine.max_request_tokens,
            },
            capabilities=["completion"]
            + (["tools"] if tokenizer.has_tool_calling else [])
            + (["vision"] if self.core.llm.engine.vision is not None else []),
            modified_at=self.created.isoformat(),
            parameters="\n".join(f"{name} {value:g}" for name, value in self.core.defaults.items()),
        )

    def entry(self) -> ModelEntry:
        """This model as `/api/tags` lists it, from its loaded weights."""
        count, family = self.parameters, model_args(self.model).model_type
        size = f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.1f}M"
        return model_entry(self.core.model_id, family, self.size, self.created, size)

    @staticmethod
    def version() -> Version:
        return Version(version=OLLAMA_VERSION)


class _Lines:
    """Ollama's objects for one reply (`key`: "message" for chat, "response" for generate), started at
    `started` (ns): one per piece of new text or group of tool calls, then the last with the counts."""

    def __init__(self, model: str, key: str, started: int) -> None:
        self.model, self.key, self.started = model, key, started
        self.first: int | None = None  # when the first output came (ns)
        self.last: RequestOutput | None = None

    def opening(self) -> Iterable[str]:
        return []

    def keepalive(self) -> str:
        return self._chunk("").line()

    def output(self, index: int, output: RequestOutput, pieces: list[Piece]) -> Iterable[str]:
        self.first = self.first or time.perf_counter_ns()
        self.last = output
        thought = [self._chunk("", thinking=output.reasoning).line()] if output.reasoning else []
        return thought + [self._chunk(piece).line() for piece in _grouped(pieces)]

    def failed(self, error: ServingError) -> Iterable[str]:
        return stream_failed(error)

    def closing(self) -> Iterable[str]:
        return [self._done(self._chunk("")).line()]

    def whole(self, reply: Collected) -> dict[str, Any]:
        """The reply as one object: the last line, with all the reply's text (and calls) in it."""
        self.last, self.first = reply.last, reply.first_ns
        whole = self._chunk(reply.text, reply.calls, reply.reasoning)
        return self._done(whole).model_dump(exclude_none=True)

    def _chunk(self, piece: str | list[ToolCall], calls: list[ToolCall] | None = None, thinking: str = "") -> Chunk:
        """A line with `piece` of the reply (text, or as a list, tool calls), and `calls` and a
        thinking model's reasoning (`thinking`) besides."""
        text, calls = (piece, calls) if isinstance(piece, str) else ("", piece)
        if self.key == "response":
            return Chunk(model=self.model, created_at=_now(), response=text, thinking=thinking or None)
        made = [
            OllamaToolCall(function=CalledFunction(name=c.name, arguments=json.loads(c.arguments))) for c in calls or []
        ]
        message = ResponseMessage(content=text, thinking=thinking or None, tool_calls=made or None)
        return Chunk(model=self.model, created_at=_now(), message=message)

    def _done(self, chunk: Chunk) -> Chunk:
        """`chunk` as the last line: why the reply ended, its counts and durations."""
        assert self.last is not None and self.last.usage is not None
        now = time.perf_counter_ns()
        first = self.first or now
        return chunk.model_copy(
            update={
                "done": True,
                "done_reason": self.last.finish_reason,
                "total_duration": now - self.started,
                "load_duration": 0,
                "prompt_eval_count": self.last.usage.prompt_tokens,
                "prompt_eval_duration": first - self.started,
                "eval_count": self.last.usage.completion_tokens,
                "eval_duration": now - first,
            }
        )


def running_model(entry: ModelEntry, expires_at: datetime, size: int, context: int) -> RunningModel:
    """A model as `/api/ps` lists it: `entry`, loaded until `expires_at`, holding `size` bytes,
    taking `context` tokens."""
    return RunningModel(
        **entry.model_dump() | {"size": size}, expires_at=expires_at, size_vram=size, context_length=context
    )


def model_entry(name: str, family: str | None, size: int, modified: datetime, parameters: str = "") -> ModelEntry:
    """A model as `/api/tags` lists it (`parameters`: its count as Ollama writes it, "8.0B")."""
    details = ModelDetails(family=family or "", families=[family] if family else [], parameter_size=parameters)
    digest = sha256(name.encode()).hexdigest()
    when = modified.isoformat()
    return ModelEntry(name=name, model=name, modified_at=when, size=size, digest=digest, details=details)


def loaded(body: Body, key: str) -> Any:
    """The answer to Ollama's load or unload idiom (`key`: "message" for chat, "response" for
    generate): done, with "load" or "unload" as the reason, and nothing generated."""
    empty: dict[str, Any] = {"response": ""} if key == "response" else {"message": ResponseMessage()}
    reason = "unload" if body.unloads else "load"
    chunk = Chunk(model=body.model, created_at=_now(), done=True, done_reason=reason, **empty)
    if body.stream:
        return StreamingResponse(iter([chunk.line()]), media_type="application/x-ndjson")
    return chunk.model_dump(exclude_none=True)


def stream_failed(error: ServingError) -> list[str]:
    """How an Ollama stream ends on an error: a line with the error."""
    return [json.dumps({"error": str(error)}) + "\n"]


def waiting(model: str, key: str) -> Waiting:
    """How a stream of `model` (`key`: "message" for chat, "response" for generate) reads while
    its model loads: an empty piece of reply as keepalive, Ollama's error line for a failure."""
    return Waiting("application/x-ndjson", lambda: _Lines(model, key, 0).keepalive(), stream_failed)


def _now() -> str:
    """The time now as Ollama writes it (RFC 3339, UTC, with a Z)."""
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _grouped(pieces: list[Piece]) -> list[str | list[ToolCall]]:
    """Consecutive calls of one output together, as Ollama sends them; text as it is."""
    grouped: list[str | list[ToolCall]] = []
    for piece in pieces:
        if isinstance(piece, ToolCall) and grouped and isinstance(grouped[-1], list):
            grouped[-1].append(piece)
        else:
            grouped.append([piece] if isinstance(piece, ToolCall) else piece)
    return grouped
