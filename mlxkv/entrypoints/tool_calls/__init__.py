"""Tool calls: a reply's text split into content and calls as it streams (`stream`), and the
grammar that holds a reply to calls when `tool_choice` asks for one (`grammar`), in each tool-call
format mlx-lm's parsers read."""

from .grammar import tool_grammar
from .stream import Piece, ToolCall, ToolCallStream

__all__ = ["Piece", "ToolCall", "ToolCallStream", "tool_grammar"]
