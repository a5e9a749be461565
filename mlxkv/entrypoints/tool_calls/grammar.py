"""The grammar that holds a reply to tool calls when `tool_choice` asks for one, in the format the
model writes its calls in: one layout for each tool-call parser of mlx-lm.

Each layout writes a call as the family's chat template teaches it, so that a forced call reads to
the model like one it chose, and as mlx-lm's parser for the family reads it back: the tool's name,
then its arguments, valid under the tool's parameter schema. Formats that carry arguments as one
JSON object get it through llguidance's `%json`; formats that write one argument at a time write
each as the parser converts it back: text verbatim where the parser keeps text, JSON elsewhere.
Markers are spelled as the tokenizer spells them (`LarkText`): most are single added tokens.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlx_lm.tokenizer_utils import TokenizerWrapper

from ...engine.sampling.lark import LarkText

COMPACT_JSON: dict[str, Any] = {"whitespace_flexible": False}  # llguidance's option: JSON as a model writes it best
NL = "\n"
Schema = dict[str, Any]


class Expr(str):
    """A Lark expression, as opposed to text that `Rules.join` spells."""


class Rules:
    """A Lark grammar being written: its rules, and the pieces calls are written with."""

    def __init__(self, text: LarkText, forbidden: tuple[str, ...]) -> None:
        self.text = text
        self.forbidden = forbidden  # what no argument's text may hold: the format's end marker
        self.lines: list[str] = []

    def join(self, *pieces: str) -> Expr:
        """`pieces` one after the other: expressions as they are, text spelled (markers as tokens)."""
        return Expr(" ".join(p if isinstance(p, Expr) else self.text(p) for p in pieces if p) or '""')

    def rule(self, body: str, terminal: bool = False) -> Expr:
        """A new rule of `body` (a terminal: one lexeme, which may intersect regexes); its name."""
        name = f"{'T' if terminal else 'r'}{len(self.lines)}"
        self.lines.append(f"{name}: {body}")
        return Expr(name)

    def json(self, schema: Schema) -> Expr:
        """A JSON value valid under `schema`."""
        return Expr("%json " + json.dumps({**schema, "x-guidance": COMPACT_JSON}, ensure_ascii=False))

    def verbatim(self, schema: Schema, closing: str, avoid: str = "") -> Expr:
        """A string argument written as it is (valid under `schema`'s enum, const, lengths and
        pattern), then `closing`, which it may not hold, nor any character of `avoid`."""
        choices = _strings(schema)
        if choices is not None:
            return self.join(Expr("(" + " | ".join(self.text(c) for c in choices) + ")"), closing)
        if self.text.starts_with_token(closing):  # a regex cannot run into a token: the text ends there
            return self.join(self.rule(_matching(schema, avoid, "") + self._without(self.forbidden), True), closing)
        # One terminal for the text and the closing's first word, which it holds only at its end, so
        # that writing the word ends the text. (Not llguidance's lazy `stop`: it fails on a token that
        # holds part of a character.)
        plain = self.text.plain_prefix(closing)
        lead = plain[: len(plain) - len(plain.lstrip())]
        word = plain[len(lead) :].split(NL)[0] or plain
        ends = f" & ~/(?s:.*{_regex(word)}.+)/"
        terminal = self.rule(_matching(schema, avoid, lead + word) + ends + self._without(self.forbidden), True)
        return self.join(terminal, closing[len(lead) + len(word) :])

    def _without(self, texts: tuple[str, ...]) -> str:
        return f" & ~/(?s:.*({'|'.join(map(_regex, texts))}).*)/" if texts else ""

    def grammar(self, start: Expr) -> str:
        return NL.join([f"start: {start}", *self.lines]) + NL


def _strings(schema: Schema) -> list[str] | None:
    """The strings a string schema allows, when it lists them (`enum`, `const`)."""
    if "const" in schema:
        return [schema["const"]] if isinstance(schema["const"], str) else None
    values = schema.get("enum")
    return values if isinstance(values, list) and values and all(isinstance(v, str) for v in values) else None


def _matching(schema: Schema, avoid: str, lead: str) -> str:
    """A Lark terminal for text valid under a string schema's lengths and pattern, without any
    character of `avoid`, followed by `lead`, which `avoid` does not apply to."""
    least, most = schema.get("minLength", 0), schema.get("maxLength", "")
    anything = f"[^{_regex(avoid)}]" if avoid else "."
    terminal = f"/(?s:{anything}{{{least},{most}}}){_regex(lead)}/"
    pattern = schema.get("pattern")
    if isinstance(pattern, str):  # JSON Schema's patterns search; one anchored at both ends matches whole
        inner = pattern.removeprefix("^").removesuffix("$")
        searched = inner if len(inner) + 2 == len(pattern) else f"(?s:.*)(?:{inner})(?s:.*)"
        terminal += f" & /(?:{searched.replace('/', '[/]')}){_regex(lead)}/"
    return terminal


def _regex(text: str) -> str:
    """`text` as a regex inside Lark's `/.../`: every character but letters and digits by its code."""
    return "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):x}}}" for c in text)


def is_text(schema: Schema) -> bool:
    """Whether an argument's schema asks for a string and nothing else (a type, or listed strings)."""
    kind = schema.get("type")
    return kind == "string" or (kind is None and _strings(schema) is not None)


def sequence(rules: Rules, items: list[tuple[Expr, bool]], separator: str) -> Expr:
    """The `items` (expression, required) in order, each optional one present or not, `separator`
    between those present."""
    memo: dict[tuple[int, bool], Expr] = {}

    def after(index: int, first: bool) -> Expr:
        if index == len(items):
            return Expr('""')
        if (index, first) not in memo:
            item, required = items[index]
            present = rules.join("" if first else separator, item, after(index + 1, False))
            memo[index, first] = rules.rule(present if required else f"{present} | {after(index + 1, first)}")
        return memo[index, first]

    return after(0, True)


def arguments(rules: Rules, schema: Schema, argument: Callable[[str, Schema], Expr], separator: str = "") -> Expr:
    """A tool's arguments one at a time, in the order its schema lists them (the optional ones
    maybe), each written by `argument(name, schema)`."""
    properties = schema.get("properties")
    required = set(schema.get("required") or ())
    listed = properties.items() if isinstance(properties, dict) else ()
    items = [(argument(name, spec if isinstance(spec, dict) else {}), name in required) for name, spec in listed]
    return sequence(rules, items, separator)


def arguments_schema(tool: dict[str, Any]) -> Schema:
    parameters = tool["function"].get("parameters")
    return parameters if isinstance(parameters, dict) and parameters else {"type": "object"}


Call = Callable[[Rules, str, Schema], Expr]  # one call of the named tool, its arguments under the schema


@dataclass(frozen=True)
class Layout:
    """How a format writes calls: each call between the parser's markers (`each`), or all of them
    between one pair, opened by `opening` and closed by `closing` inside the markers; `separator`
    between calls; `call` writes one."""

    call: Call
    each: bool = True
    separator: str = ""
    opening: str = ""
    closing: str = ""


def json_tools(rules: Rules, name: str, schema: Schema) -> Expr:
    """`{"name": ..., "arguments": {...}}` on a line of its own (Qwen 2.5, Hermes)."""
    call: Schema = {"type": "object", "properties": {"name": {"const": name}, "arguments": schema}}
    call |= {"required": ["name", "arguments"], "additionalProperties": False}
    return rules.join(NL, rules.json(call), NL)


def qwen3_coder(rules: Rules, name: str, schema: Schema) -> Expr:
    """`<function=name>` then a `<parameter=key>` block for each argument, its value on lines of its
    own (Qwen3-Coder, Qwen3.5); the parser keeps text and converts the rest by the parameter's type."""

    def argument(key: str, spec: Schema) -> Expr:
        closing = f"{NL}</parameter>{NL}"
        value = rules.verbatim(spec, closing) if is_text(spec) else rules.join(rules.json(spec), closing)
        return rules.join(f"<parameter={key}>{NL}", value)

    return rules.join(f"{NL}<function={name}>{NL}", arguments(rules, schema, argument), f"</function>{NL}")


def key_value(key_tag: str, value_tag: str, newline: str) -> Call:
    """`name`, then `<key_tag>key</key_tag><value_tag>value</value_tag>` for each argument (GLM 4.7's
    tags, LongCat's): text verbatim where the schema's type is string, JSON otherwise."""

    def call(rules: Rules, name: str, schema: Schema) -> Expr:
        def argument(key: str, spec: Schema) -> Expr:
            closing = f"</{value_tag}>{newline}"
            value = (
                rules.verbatim(spec, closing) if spec.get("type") == "string" else rules.join(rules.json(spec), closing)
            )
            return rules.join(f"<{key_tag}>{key}</{key_tag}>{newline}<{value_tag}>", value)

        return rules.join(name + newline, arguments(rules, schema, argument))

    return call


def longcat(rules: Rules, name: str, schema: Schema) -> Expr:
    """LongCat's tags; a call without a required argument as JSON, which its parser also reads
    (its tag reader needs one argument at least)."""
    if schema.get("required"):
        return key_value("longcat_arg_key", "longcat_arg_value", NL)(rules, name, schema)
    return json_tools(rules, name, schema)


def xml_invoke(invoke: str, parameter: str, text: bool, newline: str = "") -> Call:
    """`<invoke name="...">` holding `<parameter name="...">value</parameter>` for each argument
    (MiniMax M2's tags, MiniCPM 5's, Muse Spark's), `newline` after each tag that ends a line: text
    verbatim if `text` and the schema asks for a string (the parser keeps it), else JSON."""
    open_invoke, open_parameter = f"<{invoke} name=" if invoke else "", f"<{parameter} name="
    close_invoke, close_parameter = f"</{invoke}>{newline}" if invoke else "", f"</{parameter}>{newline}"

    def call(rules: Rules, name: str, schema: Schema) -> Expr:
        def argument(key: str, spec: Schema) -> Expr:
            if text and is_text(spec):
                value = rules.verbatim(spec, close_parameter, avoid="<")
            else:
                value = rules.join(rules.json(spec), close_parameter)
            return rules.join(f"{open_parameter}{json.dumps(key)}>", value)

        return rules.join(
            f"{open_invoke}{json.dumps(name)}>{newline}", arguments(rules, schema, argument), close_invoke
        )

    return call


def call_braces(quote: str, nested: bool) -> Call:
    """`call:name{key:value,...}` (Gemma 4, FunctionGemma): text between `quote` markers, other
    values as JSON; without `nested`, only values without commas or braces (the parser splits at them)."""

    def call(rules: Rules, name: str, schema: Schema) -> Expr:
        def argument(key: str, spec: Schema) -> Expr:
            if is_text(spec):
                value = rules.join(quote, rules.verbatim(spec, quote, avoid="" if nested else "}"))
            elif nested or spec.get("type") in ("integer", "number", "boolean", "null"):
                value = rules.json(spec)
            else:
                raise ValueError(
                    f"argument {key!r} of {name!r} is not a string, number or boolean, which this model's "
                    "tool-call format cannot hold; use tool_choice 'auto'"
                )
            return rules.join(f"{key}:", value)

        return rules.join(f"call:{name}{{", arguments(rules, schema, argument, ","), "}")

    return call


def pythonic(rules: Rules, name: str, schema: Schema) -> Expr:
    """`name(key=value, ...)` with JSON values, which its parser reads as Python literals (LFM2)."""

    def keyword(key: str, spec: Schema) -> Expr:
        return rules.join(f"{key}=", rules.json(spec))

    return rules.join(f"{name}(", arguments(rules, schema, keyword, ", "), ")")


def mistral(rules: Rules, name: str, schema: Schema) -> Expr:
    """`name[ARGS]{...}` (Mistral's tokenizers since v11)."""
    return rules.join(f"{name}[ARGS]", rules.json(schema))


def kimi_k2(rules: Rules, name: str, schema: Schema) -> Expr:
    """`<|tool_call_begin|>functions.name:index<|tool_call_argument_begin|>{...}<|tool_call_end|>`."""
    index = rules.rule("/[0-9]{1,4}/", True)
    opening = f"<|tool_call_begin|>functions.{name}:"
    return rules.join(opening, index, "<|tool_call_argument_begin|>", rules.json(schema), "<|tool_call_end|>")


def kimi_k3(rules: Rules, name: str, schema: Schema) -> Expr:
    """A call block holding its arguments as one JSON block (Kimi K3's XTML)."""
    attribute = name.replace("&", "&amp;").replace('"', "&quot;")
    index = rules.rule("/[0-9]{1,4}/", True)
    opening, body = f'<|open|>call tool="{attribute}" index="', '"<|sep|><|open|>json type="object"<|sep|>'
    return rules.join(opening, index, body, rules.json(schema), "<|close|>json<|sep|><|close|>call<|sep|>")


LAYOUTS: dict[str, Layout] = {
    "json_tools": Layout(json_tools, separator=NL),
    "qwen3_coder": Layout(qwen3_coder, separator=NL),
    "glm47": Layout(key_value("arg_key", "arg_value", "")),
    "laguna": Layout(key_value("arg_key", "arg_value", "")),
    "longcat": Layout(longcat, separator=NL),
    "minimax_m2": Layout(xml_invoke("invoke", "parameter", text=True, newline=NL), each=False, opening=NL),
    "minicpm5": Layout(xml_invoke("", "param", text=True)),
    "muse_spark": Layout(xml_invoke("atem:invoke", "atem:parameter", text=False), each=False),
    "gemma4": Layout(call_braces('<|"|>', nested=True)),
    "function_gemma": Layout(call_braces("<escape>", nested=False)),
    "pythonic": Layout(pythonic, each=False, separator=", ", opening="[", closing="]"),
    "mistral": Layout(mistral),
    "kimi_k2": Layout(kimi_k2, each=False),
    "kimi_k3": Layout(kimi_k3, each=False),
}


def tool_format(tokenizer: TokenizerWrapper) -> str:
    """The name of the model's tool-call parser in mlx-lm (`json_tools`, `qwen3_coder`, ...)."""
    module: str = getattr(tokenizer.tool_parser, "__module__", None) or ""
    return module.rpartition(".")[2]


def tool_grammar(tokenizer: TokenizerWrapper, tools: list[dict[str, Any]], parallel: bool) -> str:
    """A Lark grammar (llguidance's) for a reply of one tool call, or several when `parallel`, each
    naming one of `tools` (OpenAI's tool entries) with arguments valid under its parameter schema,
    written in the model's tool-call format; ValueError for a format or tool it cannot hold."""
    kind = tool_format(tokenizer)
    layout = LAYOUTS.get(kind)
    if layout is None:
        raise ValueError(
            f"this model writes its tool calls in a format mlxkv cannot enforce ({kind or 'none'}); "
            "use tool_choice 'auto'"
        )
    text = LarkText(tokenizer)
    start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
    rules = Rules(text, (end,) if end and not text.starts_with_token(end) else ())
    one = rules.rule(" | ".join(layout.call(rules, t["function"]["name"], arguments_schema(t)) for t in tools))
    if layout.each:
        one = rules.rule(rules.join(start, one, end))
    calls = rules.join(one, Expr(f"({rules.join(layout.separator, one)})*")) if parallel else one
    return rules.grammar(calls if layout.each else rules.join(start + layout.opening, calls, layout.closing + end))


def lazy_tool_grammar(
    tokenizer: TokenizerWrapper, tools: list[dict[str, Any]], parallel: bool
) -> tuple[str, str] | None:
    """The grammar of the calls a reply opens by itself (under `tool_choice` 'auto'), and the marker
    that opens them, for the engine's lazy constraint; None where the format cannot be held that
    way: one mlxkv cannot enforce or a tool it cannot write, calls with no end marker (they run to
    the reply's end), or an opening marker spelled in several tokens (the model may write it as
    ordinary text). A schema llguidance refuses is found when the grammar is compiled."""
    start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
    if tool_format(tokenizer) not in LAYOUTS or not end or start not in LarkText(tokenizer).added:
        return None
    try:
        return tool_grammar(tokenizer, tools, parallel), start
    except ValueError:  # the format cannot write one of the tools: its calls stay free
        return None
