"""OpenAI's Responses API (`/v1/responses`): the request body as mlxkv reads it (`input` as text or
items, `instructions`, function tools, `text.format`), and the response object, its output items and
the typed stream events it sends (dumped with `exclude_unset`: a field is sent where it is given)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from ...engine.sampling.params import CONSTRAINTS
from ..core import forced_tools
from ..errors import UnsupportedContent
from ..images import ImageRef, from_url, template_content
from ..prompts import request_template_kwargs
from ..sampling_defaults import effort_fields
from .protocol import SAMPLING_FIELDS, TokenLogprob

LOGPROBS = "message.output_text.logprobs"  # what `include` names to get the text's log-probabilities


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None

    def as_chat(self) -> dict[str, Any]:
        """The tool as chat templates and mlx-lm's parsers read it: Chat Completions' entry."""
        function = {"name": self.name, "parameters": self.parameters or {"type": "object"}}
        return {
            "type": "function",
            "function": function | ({"description": self.description} if self.description else {}),
        }


class NamedFunction(BaseModel):
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]
    schema_: dict[str, Any] | None = Field(None, alias="schema")


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    format: TextFormat | None = None


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="allow")  # `summary`, ...: the whole reasoning is its summary here
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None


class ResponsesBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: StrictBool = True
    text: TextConfig | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    stream: StrictBool = False
    store: StrictBool = True
    previous_response_id: str | None = None
    ttl: float | None = None  # LM Studio's: seconds the model stays loaded idle after this request
    top_logprobs: int | None = None
    include: list[str] | None = None
    reasoning: ReasoningConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: what the template reads besides

    def template_kwargs(self) -> dict[str, Any]:
        """`chat_template_kwargs`, with what the chat template reads of `reasoning.effort` (see
        `effort_kwargs`) unless the kwargs say it themselves; ValueError for a name the server
        sets itself."""
        return request_template_kwargs(self.chat_template_kwargs, self.reasoning.effort if self.reasoning else None)

    def misplaced_constraints(self) -> list[str]:
        """The constraint fields given in the body, where chat bodies take them: the Responses API
        constrains its output through `text.format`."""
        return [k for k in (*CONSTRAINTS, "grammar_trigger") if k in (self.model_extra or {})]

    def sampling_fields(self) -> dict[str, Any]:
        """The sampling fields given (null is unset): `temperature`, `top_p`, and as in chat
        bodies, any other `SamplingParams` field but the constraints (`text.format` sets those)."""
        extra = {k: v for k, v in (self.model_extra or {}).items() if k in SAMPLING_FIELDS}
        extra = {k: v for k, v in extra.items() if k not in self.misplaced_constraints()}
        given = extra | {"temperature": self.temperature, "top_p": self.top_p}
        return {k: v for k, v in given.items() if v is not None}

    def effort_fields(self) -> dict[str, Any]:
        """The thinking budget `reasoning.effort` stands for (`EFFORT_BUDGETS`), as a default."""
        return effort_fields(self.reasoning.effort if self.reasoning else None)

    @property
    def logprobs(self) -> int | None:
        """How many alternatives each output token's log-probability comes with (None: no
        log-probabilities), as `include` and `top_logprobs` ask."""
        if self.top_logprobs is None and LOGPROBS not in (self.include or []):
            return None
        return self.top_logprobs or 0

    def shown_tools(self) -> list[dict[str, Any]]:
        return [] if self.tool_choice == "none" else [t.as_chat() for t in self.tools or []]

    def forced_tools(self) -> list[dict[str, Any]]:
        choice = self.tool_choice
        if isinstance(choice, NamedFunction):
            return forced_tools(self.shown_tools(), None, choice.name)
        return forced_tools(self.shown_tools(), choice)

    def constraint(self) -> dict[str, Any]:
        kind = self.text.format if self.text is not None else None
        if kind is None or kind.type == "text":
            return {}
        return {"json_schema": kind.schema_ if kind.type == "json_schema" and kind.schema_ else {"type": "object"}}


def template_inputs(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat templates read them: messages, and calls with their outputs (mlx-lm's
    way: an assistant's calls with object arguments, each output a `tool` message)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            content = item.get("content", "")
            text = content if isinstance(content, str) else _content(content)
            role = "system" if item.get("role") == "developer" else item.get("role", "user")
            if role == "assistant" and messages and messages[-1].keys() == {"role", "content", "reasoning_content"}:
                messages[-1]["content"] = text  # the answer after its reasoning
            else:
                messages.append({"role": role, "content": text})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function"}
            call["function"] = {"name": item["name"], "arguments": json.loads(item.get("arguments") or "{}")}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "reasoning":  # a reply's reasoning passed back: the template's reasoning_content
            parts = item.get("content") or item.get("summary") or []
            messages.append({"role": "assistant", "content": "", "reasoning_content": _text(parts)})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": str(item.get("output", ""))})
        else:
            raise ValueError(
                f"input items of type {kind!r} are not supported; use message, reasoning, function_call, "
                "function_call_output"
            )
    return messages


MEDIA = {"input_image": "image", "input_file": "file", "input_audio": "audio"}


def _text(parts: list[dict[str, Any]]) -> str:
    """A message's text parts joined; an image, file or audio part is refused (`UnsupportedContent`)."""
    media = next((part["type"] for part in parts if part.get("type") in MEDIA), None)
    if media is not None:
        raise UnsupportedContent(MEDIA[media], media)
    return "".join(part.get("text", "") for part in parts)


def _content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A message's content as chat templates read it (`template_content`): its text parts, and its
    `input_image` parts (a data or http(s) `image_url`); a file or audio part is refused."""
    pieces: list[str | ImageRef] = []
    for part in parts:
        if part.get("type") != "input_image":
            pieces.append(_text([part]))
        elif isinstance(part.get("image_url"), str):
            pieces.append(from_url(part["image_url"], "input_image"))
        else:
            raise ValueError("input_image: give its image_url (a data URL or http(s)); file_id is not supported")
    return template_content(pieces)


class OutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[TokenLogprob] = Field(default_factory=list)


class MessageItem(BaseModel):
    """The reply's text, an output item of its own."""

    type: Literal["message"]
    id: str
    status: Literal["in_progress", "completed"]
    role: Literal["assistant"]
    content: list[OutputText]


class SummaryText(BaseModel):
    type: Literal["summary_text"]
    text: str


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(BaseModel):
    """A thinking model's reasoning, an output item before the message: its whole text as the
    summary (there is no other) and as the content. (Types are given, never defaults: a dump that
    leaves out what was not set must keep them.)"""

    type: Literal["reasoning"]
    id: str
    summary: list[SummaryText]
    content: list[ReasoningText]
    status: Literal["in_progress", "completed"]


class FunctionCallItem(BaseModel):
    """A call of a function tool, an output item of its own."""

    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed"]


OutputItem = ReasoningItem | MessageItem | FunctionCallItem


class InputDetails(BaseModel):
    cached_tokens: int
    cache_write_tokens: int


class OutputDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputDetails
    output_tokens: int
    output_tokens_details: OutputDetails
    total_tokens: int


class Deleted(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class Response(BaseModel):
    """The response object, as it is while it runs and once it is done."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    incomplete_details: IncompleteDetails | None
    error: None
    model: str
    instructions: str | None
    output: list[OutputItem]
    parallel_tool_calls: bool
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    temperature: float | None
    top_p: float | None
    max_output_tokens: int | None
    previous_response_id: str | None
    store: bool
    text: dict[str, Any]
    metadata: dict[str, Any]
    usage: ResponseUsage | None


class Event(BaseModel):
    """A typed stream event: its type, its number in the stream, and what that type carries."""

    type: str
    sequence_number: int
    response: Response | None = None
    output_index: int | None = None
    item: OutputItem | None = None
    item_id: str | None = None
    content_index: int | None = None
    summary_index: int | None = None
    part: OutputText | SummaryText | None = None
    delta: str | None = None
    text: str | None = None
    logprobs: list[TokenLogprob] | None = None
    arguments: str | None = None
    code: str | None = None
    message: str | None = None
    param: str | None = None

    def sse(self) -> str:
        return f"event: {self.type}\ndata: {self.model_dump_json(exclude_unset=True)}\n\n"
