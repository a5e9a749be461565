"""Ollama's API request bodies and error shape, as mlxkv reads them.

`options` maps to `SamplingParams` (`temperature`, `top_p`, `top_k`, `min_p`, `seed`, `stop`,
`num_predict`); the options that tune Ollama's own runner (`num_ctx`, `num_gpu`, `repeat_penalty`,
...) and `keep_alive`, `think` and `images` are accepted and ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from ..core import ServingError

# Ollama's documented defaults where a Modelfile sets none; SamplingParams' own are greedy and unfiltered.
OLLAMA_DEFAULTS = {"temperature": 0.8, "top_p": 0.9, "top_k": 40}


class Options(BaseModel):
    model_config = ConfigDict(extra="allow")
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    num_predict: int | None = None  # -1 or unset: as many as fit

    def sampling_fields(self) -> dict[str, Any]:
        given = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "stop": self.stop,
        }
        return {k: v for k, v in given.items() if v is not None}


class CalledFunction(BaseModel):
    name: str
    arguments: dict[str, Any]


class OllamaToolCall(BaseModel):
    function: CalledFunction


class OllamaMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None  # a tool's answer: from which function

    def as_template_input(self, index: int) -> dict[str, Any]:
        """The message as chat templates read it; calls get ids (Ollama's have none), a tool's
        answer the id of the call before it of that function."""
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": f"call_{index}_{i}", "type": "function", "function": call.function.model_dump()}
                for i, call in enumerate(self.tool_calls)
            ]
        if self.tool_name is not None:
            message["name"] = self.tool_name
        return message


class Body(BaseModel):
    """The fields `/api/chat` and `/api/generate` share."""

    model_config = ConfigDict(extra="allow")
    model: str
    format: Literal["json"] | dict[str, Any] | None = None
    options: Options | None = None
    stream: bool = True

    def constraint(self) -> dict[str, Any]:
        if self.format is None:
            return {}
        return {"json_schema": {"type": "object"} if self.format == "json" else self.format}


class ChatBody(Body):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None  # OpenAI's function entries, as Ollama takes them

    def template_inputs(self) -> list[dict[str, Any]]:
        return [message.as_template_input(i) for i, message in enumerate(self.messages)]


class GenerateBody(Body):
    prompt: str = ""
    system: str | None = None
    raw: bool = False  # True: the prompt as is, without the chat template


class ShowBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    name: str | None = None  # Ollama's older name for `model`


def error_response(error: ServingError) -> JSONResponse:
    """Ollama's error shape: `{"error": "<message>"}`."""
    return JSONResponse({"error": str(error)}, status_code=error.status, headers=error.headers)
