"""Ollama's API: the request bodies as mlxkv reads them, and the response bodies and error shape it sends.

`options` maps to `SamplingParams` (`temperature`, `top_p`, `top_k`, `min_p`, `seed`, `stop`,
`num_predict`); the options that tune Ollama's own runner (`num_ctx`, `num_gpu`, `repeat_penalty`,
...) and `keep_alive`, `think` and `images` are accepted and ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from ..errors import ServingError

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


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str = ""
    tool_calls: list[OllamaToolCall] | None = None


class Chunk(BaseModel):
    """One line of `/api/chat` (`message`) or `/api/generate` (`response`): a piece of the reply,
    or the last (`done`), with the reason and the counts and durations in nanoseconds."""

    model: str
    created_at: str
    response: str | None = None
    message: ResponseMessage | None = None
    done: bool = False
    done_reason: str | None = None
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None

    def line(self) -> str:
        """The chunk as a line of newline-delimited JSON (fields Ollama would not send left out)."""
        return self.model_dump_json(exclude_none=True) + "\n"


class ModelDetails(BaseModel):
    format: str = "mlx"
    family: str
    families: list[str]
    parameter_size: str
    quantization_level: str = ""


class ModelEntry(BaseModel):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: ModelDetails


class Tags(BaseModel):
    models: list[ModelEntry]


class ModelInfo(BaseModel):
    modelfile: str = ""
    parameters: str = ""
    template: str
    details: ModelDetails
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str


class Version(BaseModel):
    version: str


def error_response(error: ServingError) -> JSONResponse:
    """Ollama's error shape: `{"error": "<message>"}`."""
    return JSONResponse({"error": str(error)}, status_code=error.status, headers=error.headers)
