"""Anthropic's Messages API: the request bodies as mlxkv reads them, and the response bodies, stream
events and error shape it sends.

Content blocks of type `text`, `tool_use` and `tool_result` are read, `thinking` passed back as the
template renders reasoning (`redacted_thinking` left out), and the request's `thinking` turns a
thinking model's thinking on or off; and `image` and `document` refused with
a 400 naming them (mlxkv serves text models); `cache_control` is accepted
(the prefix cache keeps every prompt's pages while the pool has room). Unknown fields, such as
`metadata`, are ignored, as Anthropic's clients send some of their own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from ..core import forced_tools
from ..errors import ServingError, UnsupportedContent
from ..images import ImageRef, from_base64, from_url, template_content

ANTHROPIC_KINDS = {"server_error": "api_error"}  # the core's kinds Anthropic names otherwise


class CacheControl(BaseModel):
    type: Literal["ephemeral"]
    ttl: str | None = None


class TextBlock(BaseModel):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ImageSource(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["base64", "url"]
    data: str | None = None  # base64, with `media_type`
    url: str | None = None


class ImageBlock(BaseModel):
    """An image, as base64 data or a URL the server fetches (also inside a `tool_result`)."""

    type: Literal["image"]
    source: ImageSource
    cache_control: CacheControl | None = None

    def image(self) -> ImageRef:
        source = self.source
        if source.type == "base64" and source.data is not None:
            return from_base64(source.data, "image")
        if source.type == "url" and source.url is not None:
            return from_url(source.url, "image")
        raise ValueError(f"image: a {source.type} source needs its {'data' if source.type == 'base64' else 'url'}")


class MediaBlock(BaseModel):
    """A document: read only to be refused, as mlxkv's models read text and images."""

    model_config = ConfigDict(extra="allow")
    type: Literal["document"]
    cache_control: CacheControl | None = None


class ThinkingBlock(BaseModel):
    """A reply's reasoning, passed back in the history: the template renders it as reasoning
    (`reasoning_content`, as mlx-lm's templates read it) or leaves it out."""

    model_config = ConfigDict(extra="allow")
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None
    cache_control: CacheControl | None = None


class RedactedThinkingBlock(BaseModel):
    """Reasoning passed back encrypted: accepted, and left out of the prompt."""

    model_config = ConfigDict(extra="allow")
    type: Literal["redacted_thinking"]
    data: str
    cache_control: CacheControl | None = None


ResultPart = Annotated[TextBlock | ImageBlock | MediaBlock, Field(discriminator="type")]


class ToolResultBlock(BaseModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[ResultPart] | None = None
    is_error: StrictBool = False
    cache_control: CacheControl | None = None

    def template_content(self) -> str | list[dict[str, Any]]:
        """The result as a `tool` message's content: its text (after "Error: " for an error) and images."""
        content = self.content or ""
        pieces = [content] if isinstance(content, str) else _pieces(content)
        return template_content((["Error: "] if self.is_error else []) + pieces)


Block = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ImageBlock | MediaBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class MessageParam(BaseModel):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    def as_template_inputs(self, trusted: Callable[[ThinkingBlock], bool]) -> list[dict[str, Any]]:
        """The message as chat templates read it (mlx-lm's way): a user's tool results as `tool`
        messages before its text, an assistant's tool uses as `tool_calls` with object arguments,
        its `trusted` thinking blocks as `reasoning_content`."""
        blocks = [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else self.content
        pieces = _pieces(blocks)
        text = template_content(pieces)
        if self.role == "assistant":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            thought = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock) and trusted(b))
            if thought:
                message["reasoning_content"] = thought
            uses = [b for b in blocks if isinstance(b, ToolUseBlock)]
            if uses:
                message["tool_calls"] = [
                    {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}} for b in uses
                ]
            return [message]
        results = [
            {"role": "tool", "tool_call_id": b.tool_use_id, "content": b.template_content()}
            for b in blocks
            if isinstance(b, ToolResultBlock)
        ]
        return results + ([{"role": "user", "content": text}] if any(pieces) or not results else [])


class ToolParam(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    description: str | None = None
    input_schema: dict[str, Any]

    def as_openai(self) -> dict[str, Any]:
        """The tool as chat templates and mlx-lm's tool parsers read it: OpenAI's function entry."""
        function = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


class ToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: StrictBool = False


class ThinkingConfig(BaseModel):
    """Extended thinking: on (with a budget of reasoning tokens) or off."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1)


class CountTokensBody(BaseModel):
    """What decides a prompt's tokens: the model, system prompt, messages, tools and thinking."""

    model_config = ConfigDict(extra="allow")
    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None

    def template_kwargs(self) -> dict[str, Any]:
        """What the chat template reads of `thinking`: thinking on or off."""
        return {} if self.thinking is None else {"enable_thinking": self.thinking.type != "disabled"}

    def upto_last_cache_mark(self) -> tuple[CountTokensBody, CacheControl] | None:
        """The conversation cut after its last block marked with `cache_control` (system blocks,
        then each message's blocks, in order), with that mark; None if no block has one."""
        system = self.system if isinstance(self.system, list) else []
        marks = [(-1, j, block.cache_control) for j, block in enumerate(system)]
        for i, message in enumerate(self.messages):
            if not isinstance(message.content, str):
                marks += [(i, j, block.cache_control) for j, block in enumerate(message.content)]
        marked = [(i, j, mark) for i, j, mark in marks if mark is not None]
        if not marked:
            return None
        i, j, mark = marked[-1]
        if i < 0:
            assert isinstance(self.system, list)
            return self.model_copy(update={"system": self.system[: j + 1], "messages": []}), mark
        message = self.messages[i]
        assert not isinstance(message.content, str)
        cut = message.model_copy(update={"content": message.content[: j + 1]})
        return self.model_copy(update={"messages": [*self.messages[:i], cut]}), mark

    def template_inputs(self, trusted: Callable[[ThinkingBlock], bool] = lambda block: True) -> list[dict[str, Any]]:
        """The conversation as chat templates read it, with the `trusted` thinking blocks only."""
        system = self.system if isinstance(self.system, str) or self.system is None else _joined(self.system)
        head = [{"role": "system", "content": system}] if system else []
        return head + [m for message in self.messages for m in message.as_template_inputs(trusted)]

    def shown_tools(self) -> list[dict[str, Any]]:
        """The tools the chat template shows the model: all of them, or none with `tool_choice` none."""
        if self.tool_choice is not None and self.tool_choice.type == "none":
            return []
        return [tool.as_openai() for tool in self.tools or []]

    def forced_tools(self) -> list[dict[str, Any]]:
        """The tools the reply must call one of: all with `any`, the named one with `tool`."""
        choice = self.tool_choice
        if choice is None:
            return []
        return forced_tools(self.shown_tools(), choice.type, choice.name if choice.type == "tool" else None)


class OutputFormat(BaseModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="allow")  # `effort` and what else a client sends: not for this model
    format: OutputFormat | None = None


class MessagesBody(CountTokensBody):
    max_tokens: int = Field(ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    stream: StrictBool = False
    output_config: OutputConfig | None = None

    def sampling_fields(self) -> dict[str, Any]:
        """The sampling fields given (null is unset), as `SamplingParams` names them, with the JSON
        schema of `output_config.format` (Anthropic's structured outputs) and the thinking budget."""
        given: dict[str, Any] = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}
        given["stop"] = self.stop_sequences
        if self.output_config is not None and self.output_config.format is not None:
            given["json_schema"] = self.output_config.format.schema_
        if self.thinking is not None and self.thinking.type == "enabled":
            given["thinking_token_budget"] = self.thinking.budget_tokens
        if self.thinking is not None and self.thinking.type == "disabled":  # for a template that thinks regardless
            given["thinking_token_budget"] = 0
        return {k: v for k, v in given.items() if v is not None}


def _joined(blocks: Sequence[BaseModel]) -> str:
    """The text of `blocks`' text blocks (a system prompt's)."""
    return "".join(b.text for b in blocks if isinstance(b, TextBlock))


def _pieces(blocks: Sequence[BaseModel]) -> list[str | ImageRef]:
    """The text and images of `blocks`, in order (as `template_content` reads them); a document
    among them is refused (`UnsupportedContent`)."""
    media = next((b for b in blocks if isinstance(b, MediaBlock)), None)
    if media is not None:
        raise UnsupportedContent(media.type, media.type)
    return [b.text if isinstance(b, TextBlock) else b.image() for b in blocks if isinstance(b, (TextBlock, ImageBlock))]


class TextContent(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseContent(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class ThinkingContent(BaseModel):
    """A thinking model's reasoning, signed so that the server knows it again when it comes back."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str


Content = ThinkingContent | TextContent | ToolUseContent


class Usage(BaseModel):
    """Prompt tokens read from the cache, those written to it for a pin, the rest, and the reply's."""

    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class Message(BaseModel):
    """A reply, whole (or opening a stream, with no content yet)."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[Content]
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage


class TokenCount(BaseModel):
    input_tokens: int


class TextDelta(BaseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class InputJsonDelta(BaseModel):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ThinkingDelta(BaseModel):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class SignatureDelta(BaseModel):
    type: Literal["signature_delta"] = "signature_delta"
    signature: str


class MessageStart(BaseModel):
    type: Literal["message_start"] = "message_start"
    message: Message


class ContentBlockStart(BaseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: Content


class ContentBlockDelta(BaseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: TextDelta | InputJsonDelta | ThinkingDelta | SignatureDelta


class ContentBlockStop(BaseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class Stop(BaseModel):
    stop_reason: str | None
    stop_sequence: str | None


class MessageDelta(BaseModel):
    type: Literal["message_delta"] = "message_delta"
    delta: Stop
    usage: Usage


class MessageStop(BaseModel):
    type: Literal["message_stop"] = "message_stop"


class Ping(BaseModel):
    type: Literal["ping"] = "ping"


class ErrorDetail(BaseModel):
    type: str
    message: str


class ErrorBody(BaseModel):
    """Anthropic's error object, a response's body or a stream's `error` event."""

    type: Literal["error"] = "error"
    error: ErrorDetail


StreamEvent = (
    MessageStart
    | ContentBlockStart
    | ContentBlockDelta
    | ContentBlockStop
    | MessageDelta
    | MessageStop
    | Ping
    | ErrorBody
)


def event(payload: StreamEvent) -> str:
    """One Server-Sent Event as Anthropic sends them: its type named twice, as `event` and `type`."""
    return f"event: {payload.type}\ndata: {payload.model_dump_json()}\n\n"


def error_body(error: ServingError) -> ErrorBody:
    """Anthropic's error object: `{"type": "error", "error": {"type", "message"}}`."""
    return ErrorBody(error=ErrorDetail(type=ANTHROPIC_KINDS.get(error.kind, error.kind), message=str(error)))


def error_response(error: ServingError) -> JSONResponse:
    return JSONResponse(error_body(error).model_dump(), status_code=error.status, headers=error.headers)
