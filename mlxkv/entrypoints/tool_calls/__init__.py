"""Tool calls: a reply's text split into content and calls as it streams (`stream`), and the
grammar that holds a reply to calls when `tool_choice` asks for one, or each call the reply
opens under 'auto' (`grammar`), in each tool-call
format mlx-lm's parsers read."""

from .grammar import lazy_tool_grammar, tool_grammar
from .stream import Piece, ToolCall, ToolCallStream

__all__ = ["Piece", "ToolCall", "ToolCallStream", "lazy_tool_grammar", "tool_grammar"]
