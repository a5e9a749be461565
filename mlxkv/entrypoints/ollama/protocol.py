"""Ollama's API: the request bodies as mlxkv reads them, and the response bodies and error shape it sends.

`options` maps to `SamplingParams` (`temperature`, `top_p`, `top_k`, `min_p`, `seed`, `stop`,
`num_predict`); the options that tune Ollama's own runner (`num_ctx`, `num_gpu`, `repeat_penalty`,
...) are accepted and ignored. `think` (true, false or a level) turns a thinking model's thinking
on or off through its template's `enable_thinking`; the reasoning comes back as `thinking`.
`keep_alive` (a duration such as "5m", or seconds; negative: forever; 0: unload) is how long the
model stays loaded idle after the request. `/api/embed` and `/api/embeddings` take embedding models.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool

from ..durations import KeepAlive
from ..errors import ServingError
from ..images import from_base64, template_content
from ..sampling_defaults import effort_fields, effort_kwargs

OLLAMA_VERSION = "0.12.0"  # the Ollama release whose API these routes follow, for apps that check it


class Options(BaseModel):
    model_config = ConfigDict(extra="allow")
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    num_predict: int | None = None  # -1 or unset: as many as fit
    thinking_token_budget: int | None = None  # mlxkv's: most tokens a thinking model reasons

    def sampling_fields(self) -> dict[str, Any]:
        given = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "stop": self.stop,
            "thinking_token_budget": self.thinking_token_budget,
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
    images: list[str] | None = None
    thinking: str | None = None  # an earlier reply's reasoning, sent back

    def as_template_input(self, index: int) -> dict[str, Any]:
        """The message as chat templates read it (its images, base64, before its text); calls get ids
        (Ollama's have none), a tool's answer the id of the call before it of that function."""
        message: dict[str, Any] = {"role": self.role, "content": with_images(self.content, self.images)}
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": f"call_{index}_{i}", "type": "function", "function": call.function.model_dump()}
                for i, call in enumerate(self.tool_calls)
            ]
        if self.tool_name is not None:
            message["name"] = self.tool_name
        if self.thinking:
            message["reasoning_content"] = self.thinking  # the name chat templates read
        return message


def with_images(text: str, images: list[str] | None) -> str | list[dict[str, Any]]:
    """Content as chat templates read it: `text` after the base64 `images`, as Ollama places them."""
    return template_content([*(from_base64(image, "images") for image in images or []), text])


class Named(BaseModel):
    """The fields of every body that names a model: the model, and how long it stays loaded idle after."""

    model_config = ConfigDict(extra="allow")  # `options` and the like, where a body does not read them
    model: str
    keep_alive: KeepAlive = None  # seconds; negative: forever


class Body(Named):
    """The fields `/api/chat` and `/api/generate` share."""

    format: Literal["json"] | dict[str, Any] | None = None
    options: Options | None = None
    stream: StrictBool = True
    think: StrictBool | Literal["low", "medium", "high"] | None = None

    def _effort(self) -> str | None:
        """`think` as a reasoning effort: its level, or "none" for false (None for true or unset)."""
        return "none" if self.think is False else self.think if isinstance(self.think, str) else None

    def template_kwargs(self) -> dict[str, Any]:
        """What the chat template reads of `think`: thinking on, or what its effort says (see
        `effort_kwargs`: off for false)."""
        effort = self._effort()
        return effort_kwargs(effort) if effort else {"enable_thinking": True} if self.think else {}

    def think_fields(self) -> dict[str, Any]:
        """The thinking budget `think`'s effort stands for (OpenAI's `reasoning_effort` budgets); 0
        for false, for a template that thinks regardless (gpt-oss's)."""
        return effort_fields(self._effort())

    @property
    def unloads(self) -> bool:
        """Whether `keep_alive` asks for the model to be unloaded now (0)."""
        return self.keep_alive == 0

    def constraint(self) -> dict[str, Any]:
        if self.format is None:
            return {}
        return {"json_schema": {"type": "object"} if self.format == "json" else self.format}


def _texts(value: Any) -> Any:
    """`/api/embed`'s `input` as it is, if it is a text or a list of texts; else a ValueError."""
    if isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        return value
    raise ValueError("input must be a text or a list of texts")


class EmbedBody(Named):
    """`/api/embed`'s: `truncate` (true unless said) cuts an input to what the model takes instead of refusing it."""

    input: Annotated[str | list[str], BeforeValidator(_texts)]
    truncate: StrictBool = True
    dimensions: int | None = Field(None, ge=1)


class EmbeddingsBody(Named):
    """The older `/api/embeddings`' body: one `prompt`."""

    prompt: str


class ChatBody(Body):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None  # OpenAI's function entries, as Ollama takes them

    @property
    def loads_only(self) -> bool:
        """Ollama's idiom to load (or, with `keep_alive` 0, unload) a model: a chat of no messages."""
        return not self.messages

    def template_inputs(self) -> list[dict[str, Any]]:
        return [message.as_template_input(i) for i, message in enumerate(self.messages)]


class GenerateBody(Body):
    prompt: str = ""
    system: str | None = None
    raw: StrictBool = False  # True: the prompt as is, without the chat template
    images: list[str] | None = None

    @property
    def loads_only(self) -> bool:
        """Ollama's idiom to load (or, with `keep_alive` 0, unload) a model: no prompt."""
        return not self.prompt and not self.images


class ShowBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    name: str | None = None  # Ollama's older name for `model`


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str = ""
    thinking: str | None = None  # a thinking model's reasoning
    tool_calls: list[OllamaToolCall] | None = None


class Chunk(BaseModel):
    """One line of `/api/chat` (`message`) or `/api/generate` (`response`): a piece of the reply,
    or the last (`done`), with the reason and the counts and durations in nanoseconds."""

    model: str
    created_at: str
    response: str | None = None
    thinking: str | None = None  # `/api/generate`'s reasoning of a thinking model
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


class RunningModel(ModelEntry):
    """A loaded model, as `/api/ps` lists it: all in memory the GPU reads (Apple's unified memory)."""

    expires_at: datetime
    size_vram: int
    context_length: int


class Running(BaseModel):
    models: list[RunningModel]


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
