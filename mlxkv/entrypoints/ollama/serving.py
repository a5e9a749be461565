"""Ollama's API over the serving core: `/api/chat` and `/api/generate` (newline-delimited JSON
streams by default, one object with `"stream": false`), and `/api/tags`, `/api/show` and
`/api/version`, so that apps set up for Ollama work against `mlxkv serve --port 11434`.

Model names: the server's model id, with or without Ollama's `:latest` tag.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from datetime import datetime, timezone
from hashlib import sha256
from importlib.metadata import version
from typing import Any, cast

import mlx.core as mx
from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse
from mlx.utils import tree_flatten

from ...engine.outputs import RequestOutput
from ...engine.sampling.params import SamplingParams
from ...errors import RequestFailed
from ...models.structure import text_model
from ..core import Event, ServingCore, ServingError, Tools, refused_as, split, until_done
from ..tool_calls import Piece, ToolCall, ToolCallStream
from .protocol import OLLAMA_DEFAULTS, Body, ChatBody, GenerateBody, ShowBody


class OllamaServing:
    """Turns Ollama's bodies into engine requests and their outputs into its JSON lines."""

    def __init__(self, core: ServingCore) -> None:
        self.core = core
        self.created = datetime.now(timezone.utc)
        self.model = text_model(core.llm.engine.runner.model)
        weights = cast("list[tuple[str, mx.array]]", tree_flatten(self.model.parameters()))
        self.parameters = sum(array.size for _, array in weights)
        self.size = sum(array.nbytes for _, array in weights)

    def _check_model(self, name: str | None) -> None:
        self.core.check_model(None if name is None else name.removesuffix(":latest"))

    async def chat(self, body: ChatBody, request: HTTPRequest) -> Any:
        self._check_model(body.model)
        tools = self.core.tools(body.tools or [], [], True, "tools")
        prompt = self.core.chat_prompt(body.template_inputs(), tools)
        return await self._respond(body, prompt, request, "message", tools)

    async def generate(self, body: GenerateBody, request: HTTPRequest) -> Any:
        self._check_model(body.model)
        if body.raw or not self.core.tokenizer.has_chat_template:
            prompt = self.core.encode((body.system + "\n" if body.system else "") + body.prompt)
        else:
            system = [{"role": "system", "content": body.system}] if body.system else []
            prompt = self.core.chat_prompt(system + [{"role": "user", "content": body.prompt}])
        return await self._respond(body, prompt, request, "response", None)

    async def _respond(self, body: Body, prompt: list[int], request: HTTPRequest, key: str, tools: Tools | None) -> Any:
        options = body.options
        wanted = options.num_predict if options is not None and options.num_predict not in (None, -1) else None
        fields = OLLAMA_DEFAULTS | (options.sampling_fields() if options else {}) | body.constraint()
        with refused_as():
            params = SamplingParams(**fields, max_tokens=self.core.room(prompt, wanted))
        await self.core.compile(params, "format" if body.format is not None else None)
        self.core.check_queue(1)
        events = self.core.run([(prompt, params)], None)
        splitter = self.core.splitters(1, tools)[0]
        lines = self._lines(events, key, splitter, time.perf_counter_ns())
        if body.stream:
            return StreamingResponse(_ndjson(lines), media_type="application/x-ndjson")
        return await until_done(self._whole(lines, key), request)

    async def _lines(
        self, events: AsyncGenerator[Event, None], key: str, splitter: ToolCallStream | None, started: int
    ) -> AsyncIterator[dict[str, Any]]:
        """Ollama's objects: one per piece of new text or tool call, then the last with the counts."""
        first = None
        last: RequestOutput | None = None
        async with aclosing(events):
            async for event in events:
                if event is None:
                    continue
                last = event[1]
                first = first or time.perf_counter_ns()
                for piece in _grouped(split(splitter, last)):
                    yield self._chunk(key, piece)
        assert last is not None and last.usage is not None
        now = time.perf_counter_ns()
        yield self._chunk(key, "") | {
            "done": True,
            "done_reason": last.finish_reason,
            "total_duration": now - started,
            "load_duration": 0,
            "prompt_eval_count": last.usage.prompt_tokens,
            "prompt_eval_duration": (first or now) - started,
            "eval_count": last.usage.completion_tokens,
            "eval_duration": now - (first or now),
        }

    def _chunk(self, key: str, piece: str | list[ToolCall]) -> dict[str, Any]:
        head = {"model": self.core.model_id, "created_at": _now(), "done": False}
        if key == "response":
            return head | {"response": piece if isinstance(piece, str) else ""}
        message: dict[str, Any] = {"role": "assistant", "content": piece if isinstance(piece, str) else ""}
        if not isinstance(piece, str):
            message["tool_calls"] = [
                {"function": {"name": c.name, "arguments": json.loads(c.arguments)}} for c in piece
            ]
        return head | {"message": message}

    async def _whole(self, lines: AsyncIterator[dict[str, Any]], key: str) -> dict[str, Any]:
        """The reply as one object: the last line, with every line's text (and calls) in it."""
        text, last = "", {}
        calls: list[Any] = []
        try:
            async for line in lines:
                part = line.get(key)
                text += part["content"] if isinstance(part, dict) else part or ""
                calls += part.get("tool_calls", []) if isinstance(part, dict) else []
                last = line
        except RequestFailed as exc:
            raise ServingError(500, str(exc), kind="server_error") from None
        if key == "response":
            return last | {"response": text}
        return last | {"message": {"role": "assistant", "content": text} | ({"tool_calls": calls} if calls else {})}

    def tags(self) -> dict[str, Any]:
        return {"models": [self._description() | {"name": self.core.model_id}]}

    def show(self, body: ShowBody) -> dict[str, Any]:
        self._check_model(body.model or body.name)
        tokenizer = self.core.tokenizer
        architecture = self.model.args.model_type
        capabilities = ["completion"] + (["tools"] if tokenizer.has_tool_calling else [])
        return {
            "modelfile": "",
            "parameters": "",
            "template": (tokenizer.chat_template or "") if tokenizer.has_chat_template else "",
            "details": self._description()["details"],
            "model_info": {
                "general.architecture": architecture,
                "general.parameter_count": self.parameters,
                f"{architecture}.context_length": self.core.llm.engine.max_request_tokens,
            },
            "capabilities": capabilities,
            "modified_at": self.created.isoformat(),
        }

    def _description(self) -> dict[str, Any]:
        count, family = self.parameters, self.model.args.model_type
        return {
            "model": self.core.model_id,
            "modified_at": self.created.isoformat(),
            "size": self.size,
            "digest": sha256(self.core.model_id.encode()).hexdigest(),
            "details": {
                "format": "mlx",
                "family": family,
                "families": [family],
                "parameter_size": f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.1f}M",
                "quantization_level": "",
            },
        }

    @staticmethod
    def version() -> dict[str, str]:
        return {"version": version("mlxkv")}


def _grouped(pieces: list[Piece]) -> list[str | list[ToolCall]]:
    """Consecutive calls of one output together, as Ollama sends them; text as it is."""
    grouped: list[str | list[ToolCall]] = []
    for piece in pieces:
        if isinstance(piece, ToolCall) and grouped and isinstance(grouped[-1], list):
            grouped[-1].append(piece)
        else:
            grouped.append([piece] if isinstance(piece, ToolCall) else piece)
    return grouped


async def _ndjson(lines: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """Newline-delimited JSON; a failure after the status line has gone travels as an error line."""
    try:
        async for line in lines:
            yield json.dumps(line) + "\n"
    except RequestFailed as exc:
        yield json.dumps({"error": str(exc)}) + "\n"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")
