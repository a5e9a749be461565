"""How a conversation becomes prompt token ids: the model's chat template, or plain text."""

from __future__ import annotations

from typing import Any, cast

from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..engine.inputs import encode_text


def prompt_ids(
    tokenizer: TokenizerWrapper,
    messages: list[dict[str, Any]],
    ignore_template: bool = False,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The prompt for `messages` (`role`/`content` dicts), ending where the assistant's reply
    begins; the template shows the model `tools` (OpenAI's function entries) where given."""
    if tokenizer.has_chat_template and not ignore_template:
        return cast(list[int], tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True))
    return encode_text(tokenizer, plain_text(messages))


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
