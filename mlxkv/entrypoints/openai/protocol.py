"""OpenAI's request bodies and error shape, as mlxkv reads them.

Sampling fields (`temperature`, `top_p`, `top_k`, `min_p`, `seed`, `stop`, `ignore_eos`) are
`SamplingParams`' own: a body keeps them as given and `sampling` hands them to `SamplingParams`,
which checks them once and names a bad one. Unknown fields are ignored, as OpenAI's clients send
some of their own.
"""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any, Literal, cast

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from ...engine.outputs import Usage
from ...engine.sampling_params import SamplingParams

# The fields of SamplingParams a body may carry as they are; max_tokens and logprobs have their own shape here.
SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams)) - {"max_tokens", "logprobs"}
OPENAI_DEFAULTS = {"temperature": 1.0}  # OpenAI's documented default; SamplingParams' own is greedy


class StreamOptions(BaseModel):
    include_usage: bool = False


class Body(BaseModel):
    """The fields chat and completions requests share."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = None
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    user: str | None = None

    def sampling(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The request's `SamplingParams`: the sampling fields it gave (null is unset), else OpenAI's
        defaults, else mlxkv's; a bad value raises ValueError naming the field."""
        given = {k: v for k, v in (self.model_extra or {}).items() if k in SAMPLING_FIELDS and v is not None}
        return SamplingParams(**{**OPENAI_DEFAULTS, **given, "max_tokens": max_tokens, "logprobs": logprobs})


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def as_template_input(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatBody(Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class CompletionBody(Body):
    prompt: str | list[int] | list[str] | list[list[int]]  # one prompt, or a batch of them
    logprobs: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts: one, or OpenAI's batch (a list of strings or of token-id lists)."""
        if isinstance(self.prompt, list) and any(isinstance(p, (str, list)) for p in self.prompt):
            return cast("list[str | list[int]]", list(self.prompt))
        return [cast("str | list[int]", self.prompt)]


class APIError(Exception):
    """An error answered as OpenAI's `{"error": {...}}` with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.kind, self.headers = status, param, code, kind, headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def usage_json(usages: list[Usage | None], per_prompt: int) -> dict[str, Any]:
    """OpenAI's `usage` for the choices of one request, `per_prompt` choices per prompt: each
    prompt is counted once, as its first choice computed it."""
    done = [u for u in usages if u is not None]
    firsts = [u for u in usages[::per_prompt] if u is not None]
    prompt, completion = sum(u.prompt_tokens for u in firsts), sum(u.completion_tokens for u in done)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(u.cached_tokens for u in firsts)},
    }


def sse(payload: dict[str, Any] | str) -> str:
    """One Server-Sent Events message."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"
