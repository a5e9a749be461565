"""A reply's text, as it streams, split into content and tool calls, which mlx-lm's parser for the
model's family reads.

Streamed and whole replies go through the same `ToolCallStream`, so they are equal: text between
the model's tool-call markers never reaches `content`, and a call that does not parse (cut off
by `max_tokens`, say), or whose arguments are not a JSON object, is given back as the text it was,
so that every API can hand a call's arguments to its client as an object.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from mlx_lm.tokenizer_utils import TokenizerWrapper


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: OpenAI's id, the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_json(self, index: int | None = None) -> dict[str, Any]:
        """The call as OpenAI's `tool_calls` entry (with `index` in a streamed delta)."""
        entry = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return entry if index is None else {"index": index, **entry}


Piece = str | ToolCall  # what a reply's text turns into: content, or a call


class ToolCallStream:
    """Splits a reply's text into content and tool calls as the text arrives (`feed`), holding
    back only what may be the start of a tool-call marker, and whitespace after a call (the
    separator between calls, which is not content); `close` ends the reply."""

    def __init__(self, tokenizer: TokenizerWrapper, tools: list[dict[str, Any]]) -> None:
        self.start: str = tokenizer.tool_call_start
        self.end: str = tokenizer.tool_call_end
        self.parse = tokenizer.tool_parser
        self.tools = tools
        self._held = ""
        self._in_call = False
        self._called = False
        self._gap = ""  # whitespace since the last call

    def feed(self, text: str) -> list[Piece]:
        self._held += text
        pieces: list[Piece] = []
        while True:
            marker = self.end if self._in_call else self.start
            if not marker:  # calls without an end marker (Mistral's) run to the reply's end
                break
            at = self._held.find(marker)
            if at < 0:
                break
            before, self._held = self._held[:at], self._held[at + len(marker) :]
            pieces += self._parsed(before, self.end) if self._in_call else [before]
            self._in_call = not self._in_call
        if not self._in_call:
            keep = _partial_marker(self._held, self.start)
            pieces.append(self._held[: len(self._held) - keep])
            self._held = self._held[len(self._held) - keep :]
        return self._between_calls(pieces)

    def close(self) -> list[Piece]:
        """What is left at the reply's end: a call without its end marker is parsed if it can be."""
        held, self._held = self._held, ""
        return self._between_calls(self._parsed(held, "") if self._in_call else [held])

    def _between_calls(self, pieces: list[Piece]) -> list[Piece]:
        """`pieces` without the whitespace that follows a call, unless other text follows it."""
        kept: list[Piece] = []
        for piece in pieces:
            if isinstance(piece, ToolCall):
                self._called, self._gap = True, ""
                kept.append(piece)
            elif self._called and not (self._gap + piece).strip():
                self._gap += piece
            elif piece:
                kept.append(self._gap + piece)
                self._gap = ""
        return kept

    def _parsed(self, text: str, end: str) -> list[Piece]:
        """The calls between a start marker and `end` (the end marker, or "" at the reply's end);
        the model's text as it was unless every call names a function and has a JSON object for
        arguments (mlx-lm's parser may raise, or give what is neither)."""
        try:
            parsed = self.parse(text, self.tools)
            calls = parsed if isinstance(parsed, list) else [parsed]
            return [ToolCall(str(call["name"]), _arguments(call["arguments"])) for call in calls]
        except Exception:
            return [self.start + text + end]


def _arguments(arguments: Any) -> str:
    """A call's arguments as JSON text of an object; ValueError if they are not one."""
    value = json.loads(arguments) if isinstance(arguments, str) else arguments
    if not isinstance(value, dict):
        raise ValueError(f"a call's arguments must be a JSON object, got {arguments!r}")
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _partial_marker(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    return next((n for n in range(min(len(text), len(marker) - 1), 0, -1) if marker.startswith(text[-n:])), 0)
