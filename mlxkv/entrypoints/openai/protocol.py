"""OpenAI's chat and completions: the request bodies as mlxkv reads them, and the response bodies,
stream chunks and error shape it sends (those dumped with `exclude_unset`, so that a field is sent
exactly where it is given, as null where that is set).

Sampling fields (`temperature`, `top_p`, `top_k`, `min_p`, `seed`, `stop`, `ignore_eos`, and the
constraints `json_schema`, `regex`, `choice`, `grammar`) are `SamplingParams`' own: a body keeps
them as given and `sampling` hands them to `SamplingParams`, which checks them once and names a
bad one. A constraint may also come as OpenAI's `response_format` or vLLM's `structured_outputs`.
Unknown fields are ignored, as OpenAI's clients send some of their own.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Annotated, Any, Literal, cast

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from ...engine.outputs import Usage
from ...engine.sampling.params import CONSTRAINTS, SamplingParams
from ...engine.sampling.sampler import TokenLogprob as TokenScore
from ..core import forced_tools
from ..errors import ServingError, UnsupportedContent
from ..images import ImageRef, from_url, template_content
from ..prompts import request_template_kwargs
from ..sampling_defaults import effort_fields

# The fields of SamplingParams a body may carry as they are; max_tokens and logprobs have their own shape here.
SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams)) - {"max_tokens", "logprobs"}


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class JsonSchemaFormat(BaseModel):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON under a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def constraint(self) -> dict[str, Any]:
        if self.type == "json_schema":
            if self.json_schema is None:
                raise ValueError("response_format of type json_schema needs a json_schema object")
            return {"json_schema": self.json_schema.schema_ or {"type": "object"}}
        return {"json_schema": {"type": "object"}} if self.type == "json_object" else {}


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: one of a JSON schema, any JSON object, a regex, a choice or a grammar."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: StrictBool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def constraint(self) -> dict[str, Any]:
        given = {"json_schema": self.json_, "regex": self.regex, "choice": self.choice, "grammar": self.grammar}
        if self.json_object:
            given["json_schema"] = given["json_schema"] or {"type": "object"}
        return {k: v for k, v in given.items() if v is not None}


class Body(BaseModel):
    """The fields chat and completions requests share."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = None
    n: int = Field(1, ge=1, le=16)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    ttl: float | None = None  # LM Studio's: seconds the model stays loaded idle after this request

    def sampling(
        self,
        max_tokens: int,
        logprobs: int | None,
        defaults: dict[str, Any],
        constraint: dict[str, Any] | None = None,
    ) -> SamplingParams:
        """The request's `SamplingParams`: the sampling fields it gave (null is unset), else the
        server's `defaults`, else `SamplingParams`' own, with the constraint of `response_format`,
        `structured_outputs` or `constraint` (the server's own, for tool calls); a bad value raises
        ValueError naming the field."""
        given = {k: v for k, v in (self.model_extra or {}).items() if k in SAMPLING_FIELDS and v is not None}
        sources = [
            (name, part)
            for name, part in (
                ("response_format", self.response_format.constraint() if self.response_format else {}),
                ("structured_outputs", self.structured_outputs.constraint() if self.structured_outputs else {}),
                ("tool_choice", constraint or {}),
                ("the body", {k: v for k, v in given.items() if k in CONSTRAINTS}),
            )
            if part
        ]
        if sum(k in CONSTRAINTS for _, part in sources for k in part) > 1:  # a grammar's trigger is not one
            named = ", ".join(f"{k} ({name})" for name, part in sources for k in part if k in CONSTRAINTS)
            raise ValueError(f"constraints: give at most one; got {named}")
        given.update(sources[0][1] if sources else {})
        return SamplingParams(**{**defaults, **given, "max_tokens": max_tokens, "logprobs": logprobs})


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="allow")  # `detail`: the processor sizes images by its own settings
    url: str


class ImagePart(BaseModel):
    """An image: a base64 data URL, or an http(s) URL the server fetches."""

    type: Literal["image_url"]
    image_url: ImageURL


class MediaPart(BaseModel):
    """An audio or file part: read only to be refused, as mlxkv's models read text and images."""

    model_config = ConfigDict(extra="allow")
    type: Literal["input_audio", "file"]


MEDIA = {"input_audio": "audio", "file": "file"}
Part = Annotated[TextPart | ImagePart | MediaPart, Field(discriminator="type")]


class CalledFunction(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class MessageToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Part] | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's answer: to which call
    reasoning_content: str | None = None  # an assistant's reasoning, passed back (or as `reasoning`)
    reasoning: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        """The message as chat templates read it (mlx-lm's way): an assistant's calls with their
        arguments as objects, its reasoning as `reasoning_content`, a tool's answer with the id of
        its call."""
        content = self.content or ""
        media = next((p.type for p in content if isinstance(p, MediaPart)), None) if isinstance(content, list) else None
        if media is not None:
            raise UnsupportedContent(MEDIA[media], media)
        pieces = [content] if isinstance(content, str) else [_piece(p) for p in content]
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": template_content(pieces)}
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": c.type, "function": {"name": c.function.name, "arguments": _object(c)}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        thought = self.reasoning_content or self.reasoning
        if thought:
            message["reasoning_content"] = thought
        return message


def _piece(part: TextPart | ImagePart | MediaPart) -> str | ImageRef:
    """A content part as `template_content` reads it: its text, or its image."""
    if isinstance(part, ImagePart):
        return from_url(part.image_url.url, "image_url")
    assert isinstance(part, TextPart)
    return part.text


def _object(call: MessageToolCall) -> Any:
    try:
        return json.loads(call.function.arguments)
    except json.JSONDecodeError:
        raise ValueError(f"the arguments of tool call {call.id!r} are not JSON: {call.function.arguments!r}") from None


class Function(BaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: Function


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatBody(Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: StrictBool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: what the template reads besides
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None

    def effort_fields(self) -> dict[str, Any]:
        """The thinking budget `reasoning_effort` stands for (`EFFORT_BUDGETS`), as a default."""
        return effort_fields(self.reasoning_effort)

    def template_kwargs(self) -> dict[str, Any]:
        """`chat_template_kwargs`, with what the template reads of `reasoning_effort` (see
        `effort_kwargs`) unless the kwargs say it themselves; ValueError for a name the server
        sets itself."""
        return request_template_kwargs(self.chat_template_kwargs, self.reasoning_effort)

    def shown_tools(self) -> list[dict[str, Any]]:
        """The tools the chat template shows the model, as OpenAI's entries (which templates and
        mlx-lm's tool parsers read): every one, or none with `tool_choice` 'none'."""
        if self.tool_choice == "none":
            return []
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

    def forced_tools(self) -> list[dict[str, Any]]:
        """The tools the reply must call one of: all with `tool_choice` 'required', the named one
        with a named choice, none otherwise (the model decides, and its calls are parsed)."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return forced_tools(self.shown_tools(), None, choice.function.name)
        return forced_tools(self.shown_tools(), choice)


class CompletionBody(Body):
    prompt: str | list[int] | list[str] | list[list[int]]  # one prompt, or a batch of them
    logprobs: int | None = None
    echo: StrictBool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> str | None:
        """The first of OpenAI's fields given that would change the text in a way mlxkv does not
        (refused, not ignored), if any."""
        given = {"echo": self.echo, "suffix": bool(self.suffix), "best_of": self.best_of not in (None, 1, self.n)}
        return next((name for name, value in given.items() if value), None)

    def prompts(self) -> list[str | list[int]]:
        """The prompts: one, or OpenAI's batch (a list of strings or of token-id lists)."""
        if isinstance(self.prompt, list) and any(isinstance(p, (str, list)) for p in self.prompt):
            return cast("list[str | list[int]]", list(self.prompt))
        return [cast("str | list[int]", self.prompt)]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


def token_logprobs(decode: Callable[[list[int]], str], scores: Sequence[TokenScore]) -> list[TokenLogprob]:
    """Each token's log-probability and its alternatives', as Chat Completions and Responses send
    them: the token's text (`decode`) and bytes beside each."""

    def top(token: int, logprob: float) -> TopLogprob:
        text = decode([token])
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    return [
        TokenLogprob(**top(s.token, s.logprob).model_dump(), top_logprobs=[top(t, lp) for t, lp in s.top])
        for s in scores
    ]


class AssistantMessage(BaseModel):
    """A reply; a thinking model's reasoning goes as `reasoning_content` (DeepSeek's name, read by
    LiteLLM and LM Studio's clients) and `reasoning` (vLLM's and OpenRouter's), both the same."""

    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[MessageToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None


class FunctionDelta(BaseModel):
    name: str | None = None
    arguments: str


class ToolCallDelta(BaseModel):
    """A tool call as OpenAI streams it: its id, type and name first, then its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None  # as in `AssistantMessage`
    reasoning: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None


class PromptDetails(BaseModel):
    cached_tokens: int


class CompletionDetails(BaseModel):
    reasoning_tokens: int


class OpenAIUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptDetails
    completion_tokens_details: CompletionDetails


class Reply(BaseModel):
    """A response or one chunk of a stream: `chat.completion`, `chat.completion.chunk` or
    `text_completion`, its choices of the kind that object holds, and usage where given."""

    id: str
    object: Literal["chat.completion", "chat.completion.chunk", "text_completion"]
    created: int
    model: str
    choices: list[ChatChoice] | list[ChunkChoice] | list[CompletionChoice]
    usage: OpenAIUsage | None = None

    def sse(self) -> str:
        return sse(self.model_dump(exclude_unset=True))


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "mlxkv"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


OPENAI_KINDS = {  # OpenAI's error types for the core's kinds it names otherwise
    "overloaded_error": "server_error",
    "not_found_error": "invalid_request_error",
    "request_too_large": "invalid_request_error",
    "authentication_error": "invalid_request_error",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """OpenAI's error object: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorDetail


def error_body(error: ServingError) -> ErrorBody:
    kind = OPENAI_KINDS.get(error.kind, error.kind)
    return ErrorBody(error=ErrorDetail(message=str(error), type=kind, param=error.param, code=error.code))


def error_response(error: ServingError) -> JSONResponse:
    return JSONResponse(error_body(error).model_dump(), status_code=error.status, headers=error.headers)


def usage_of(usages: list[Usage | None], per_prompt: int) -> OpenAIUsage:
    """OpenAI's `usage` for the choices of one request, `per_prompt` choices per prompt: each
    prompt is counted once, as its first choice computed it."""
    done = [u for u in usages if u is not None]
    firsts = [u for u in usages[::per_prompt] if u is not None]
    prompt, completion = sum(u.prompt_tokens for u in firsts), sum(u.completion_tokens for u in done)
    details = PromptDetails(cached_tokens=sum(u.cached_tokens for u in firsts))
    return OpenAIUsage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=details,
        completion_tokens_details=CompletionDetails(reasoning_tokens=sum(u.reasoning_tokens for u in done)),
    )


def sse(payload: dict[str, Any] | str) -> str:
    """One Server-Sent Events message."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"
