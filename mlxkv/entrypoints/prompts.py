"""How a conversation becomes prompt token ids: the model's chat template, or plain text."""

from __future__ import annotations

import json
from typing import Any

from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..engine.images import ImagePrompt, place_images
from ..engine.inputs import encode_text
from ..engine.llm_engine import LLMEngine
from ..models.vision import Vision
from .errors import UnreadableImage, UnsupportedContent
from .images import image_refs
from .sampling_defaults import effort_kwargs

SERVER_KWARGS = ("messages", "tools", "add_generation_prompt", "tokenize")  # what mlxkv itself gives a template


def checked_template_kwargs(kwargs: Any, name: str = "chat_template_kwargs") -> dict[str, Any]:
    """`kwargs` as what a chat template reads besides the conversation (`enable_thinking`,
    `preserve_thinking`, ...); ValueError naming `name` for anything but an object, or one that
    sets what mlxkv gives the template itself."""
    if not isinstance(kwargs, dict):
        raise ValueError(f'{name} must be a JSON object, such as {{"enable_thinking": false}}')
    taken = [k for k in SERVER_KWARGS if k in kwargs]
    if taken:
        raise ValueError(f"{name} may not set {', '.join(taken)}: mlxkv sets them")
    return dict(kwargs)


def request_template_kwargs(given: Any, effort: str | None) -> dict[str, Any]:
    """A request's `chat_template_kwargs` (checked), over what the template reads of its reasoning
    effort (see `effort_kwargs`)."""
    return (effort_kwargs(effort) if effort else {}) | checked_template_kwargs(given or {})


def template_kwargs_of(text: str | None, name: str = "--chat-template-kwargs") -> dict[str, Any]:
    """The chat-template kwargs a JSON text gives (none for None); ValueError naming `name`."""
    if text is None:
        return {}
    try:
        return checked_template_kwargs(json.loads(text), name)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{name} is not JSON ({exc.msg}); give an object, such as '{{\"enable_thinking\": false}}'"
        ) from None


def prompt_ids(
    tokenizer: TokenizerWrapper,
    messages: list[dict[str, Any]],
    ignore_template: bool = False,
    tools: list[dict[str, Any]] | None = None,
    engine: LLMEngine | None = None,
    cache_salt: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
    fetch_urls: bool = True,
    vision: Vision | None = None,
) -> list[int]:
    """The prompt for `messages` (`role`/`content` dicts), ending where the assistant's reply
    begins; the template shows the model `tools` (OpenAI's function entries) where given, and
    reads `template_kwargs` (`enable_thinking`, say). With `engine`, replies it produced (under
    `cache_salt`) keep the token ids it produced them as, so that a next turn reuses the pages of
    the turns before. A conversation with images (`images.ImageRef` parts) gives a `PlacedPrompt`,
    its images read (URLs fetched if `fetch_urls`) and placed by the engine's vision (or `vision`,
    without an engine); `UnsupportedContent` for a model without one."""
    images = image_refs(messages)
    vision = engine.vision if engine is not None else vision
    if images and vision is None:
        raise UnsupportedContent("image", images[0].block)
    templated = tokenizer.has_chat_template and not ignore_template
    if images and not templated:
        raise ValueError("images need the model's chat template, which places them in the prompt")
    if templated:
        text = tokenizer.apply_chat_template(
            [_with_thinking(m) for m in messages],
            tools=tools or None,
            add_generation_prompt=True,
            tokenize=False,
            **(template_kwargs or {}),
        )
    else:
        text = plain_text(messages)
    if images:
        assert vision is not None
        try:
            prompt = ImagePrompt(text, [image.read(fetch_urls) for image in images])
            return place_images(tokenizer, vision, prompt, engine.recent if engine else None, cache_salt, templated)
        except ValueError as exc:
            raise UnreadableImage(str(exc)) from None
    return encode_text(tokenizer, text, engine.recent if engine else None, cache_salt, templated)


def _with_thinking(message: dict[str, Any]) -> dict[str, Any]:
    """`message` with its reasoning under both names templates read it by: `reasoning_content`
    (Qwen's, DeepSeek's) and `thinking` (gpt-oss's)."""
    thought = message.get("reasoning_content")
    return message | {"thinking": thought} if thought and "thinking" not in message else message


def plain_text(messages: list[dict[str, Any]]) -> str:
    """A conversation as a model without a chat template saw it: each reply continues the
    message before it, each user message starts a new line, system prompts are left out."""
    text = ""
    for message in messages:
        if message["role"] == "user":
            text += ("\n" if text else "") + message["content"]
        elif message["role"] == "assistant":
            text += message["content"]
    return text
