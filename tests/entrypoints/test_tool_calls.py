"""A reply's text split into content and tool calls, whole or in any pieces; the grammar of a forced call."""

import json

import pytest

from mlxkv.entrypoints.tool_calls import ToolCall, ToolCallStream, lazy_tool_grammar, tool_grammar
from mlxkv.models import load
from mlxkv.models.random_model import TOOLS_CHAT_TEMPLATE, make_checkpoint

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
REPLY = (
    "Let me look.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("tools"), chat_template=TOOLS_CHAT_TEMPLATE)
    return load(str(path))[1]


def split(tokenizer, text, size):
    stream = ToolCallStream(tokenizer, TOOLS)
    pieces = [p for i in range(0, len(text), size) for p in stream.feed(text[i : i + size])] + stream.close()
    content = "".join(p for p in pieces if isinstance(p, str))
    return content, [(c.name, json.loads(c.arguments)) for c in pieces if isinstance(c, ToolCall)]


@pytest.mark.parametrize("size", [1, 2, 5, 11, len(REPLY)])
def test_calls_are_parsed_and_never_content_whatever_the_pieces(tokenizer, size):
    content, calls = split(tokenizer, REPLY, size)
    assert content == "Let me look.\n"  # the newlines between and after the calls are not content
    assert calls == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]


def test_text_that_only_looks_like_a_marker_is_content(tokenizer):
    assert split(tokenizer, "a <tool_ca b <tool", 3) == ("a <tool_ca b <tool", [])


def test_a_call_cut_off_is_given_back_as_text(tokenizer):
    cut = '<tool_call>\n{"name": "get_weather", "argu'
    assert split(tokenizer, "ok " + cut, 4) == ("ok " + cut, [])


def test_a_call_without_its_end_marker_still_parses_at_the_end(tokenizer):
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}'
    assert split(tokenizer, text, 7) == ("", [("get_weather", {"city": "Rome"})])


def test_text_after_a_call_is_content(tokenizer):
    text = '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>\n\nDone.'
    assert split(tokenizer, text, 3) == ("\n\nDone.", [("get_weather", {})])


def test_the_grammar_of_a_forced_call_wants_json_between_the_marker_tokens(tokenizer):
    """The markers are added tokens, so the grammar names them by id, never as text."""
    start, end = (tokenizer.convert_tokens_to_ids(m) for m in ("<tool_call>", "</tool_call>"))
    grammar = tool_grammar(tokenizer, TOOLS, parallel=False)
    assert f"<[{start}]> r0 <[{end}]>" in grammar and '"<tool_call>' not in grammar
    assert '%json {"type": "object", "properties": {"name": {"const": "get_weather"}' in grammar
    assert grammar.startswith("start: r1\n") and "(" not in grammar.splitlines()[0]
    assert tool_grammar(tokenizer, TOOLS, parallel=True).startswith('start: r1 ("\\n" r1)*\n')


@pytest.mark.parametrize("arguments", ['"Paris"', "[1, 2]", "7", '"{not json"'])
def test_a_call_whose_arguments_are_not_an_object_is_given_back_as_text(tokenizer, arguments):
    """Every API hands a call's arguments to its client as an object: a call with other arguments
    stays the model's text, end marker included."""
    text = f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>'
    assert split(tokenizer, "ok " + text, 5) == ("ok " + text, [])


def test_under_auto_each_call_is_held_lazily_from_its_opening_marker(tokenizer):
    """The lazy grammar is the one-call grammar; its trigger the opening marker, one token."""
    assert lazy_tool_grammar(tokenizer, TOOLS, parallel=True) == (
        tool_grammar(tokenizer, TOOLS, parallel=True),
        "<tool_call>",
    )


def test_a_marker_spelled_in_several_tokens_has_no_lazy_grammar(tmp_path):
    path = make_checkpoint(tmp_path, chat_template=TOOLS_CHAT_TEMPLATE, markers=())
    assert lazy_tool_grammar(load(str(path))[1], TOOLS, parallel=True) is None
