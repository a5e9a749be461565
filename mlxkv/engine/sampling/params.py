"""How one request samples, declared once: `SamplingParams`; CLI options and HTTP fields derive from it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ...settings import BOOLEAN, POSITIVE, TEXT, Check, integer, number, optional, setting, validate

GREEDY_BELOW = 1e-5  # a lower temperature is greedy: 1/T would push the scaled logits past float32
MAX_LOGPROBS = 20  # most alternatives a request may ask log-probabilities for (OpenAI's limit)


def _stop_strings(stop: Any) -> Any:
    """`stop` as a tuple: None is none, one string is one."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    return tuple(stop) if isinstance(stop, list) else stop


STOP = Check(
    lambda v: isinstance(v, tuple) and all(isinstance(s, str) and s for s in v), "a non-empty string or a list of them"
)
CONSTRAINTS = ("json_schema", "regex", "choice", "grammar")  # the ways to constrain an output, at most one a request


def _schema_text(schema: Any) -> Any:
    """A JSON schema (a dict, or JSON text of one) as JSON text, its keys in their order (which
    orders the output's properties). Anything else is left for the check to refuse."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError:
            return schema
    return json.dumps(schema, ensure_ascii=False) if isinstance(schema, dict) else schema


def _is_schema_text(value: Any) -> bool:
    try:
        return isinstance(value, str) and isinstance(json.loads(value), dict)
    except json.JSONDecodeError:
        return False


def _choices(choice: Any) -> Any:
    return tuple(choice) if isinstance(choice, list) else choice


SCHEMA = Check(_is_schema_text, "a JSON schema, as a dict or JSON text")
CHOICES = Check(
    lambda v: isinstance(v, tuple) and bool(v) and all(isinstance(s, str) and s for s in v),
    "a list of non-empty strings",
)


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to pick one request's tokens, checked when made; temperature 0 (or below `GREEDY_BELOW`) is greedy."""

    max_tokens: int = setting(256, "Most tokens to generate.", POSITIVE, flags=("--max-tokens", "-m"))
    temperature: float = setting(
        0.0, "Sampling temperature; 0 is greedy.", number(0), flags=("--temperature", "--temp")
    )
    top_p: float = setting(
        1.0, "Sample from the most likely tokens whose probabilities add up to top_p.", number(0, 1, low_open=True)
    )
    top_k: int = setting(0, "Sample from the k most likely tokens; 0 disables it.", integer(0))
    min_p: float = setting(
        0.0, "Drop tokens less likely than min_p times the most likely one.", number(0, 1, high_open=True)
    )
    stop: tuple[str, ...] = setting(
        (), "A string that ends the text before it (repeatable).", STOP, convert=_stop_strings, cli_type=list[str]
    )
    seed: int | None = setting(
        None,
        "Seed that makes sampling reproducible, whatever shares the batch.",
        optional(Check(integer(0, 2**64 - 1).accepts, "an integer in [0, 2**64)")),
    )
    ignore_eos: bool = setting(False, "Generate past the end-of-sequence token (for benchmarks).", BOOLEAN)
    thinking_token_budget: int | None = setting(
        None,
        "Most tokens a thinking model may reason before its answer (its think markers included): at the "
        "budget its thinking is closed and the answer follows.",
        optional(integer(0)),
    )
    logprobs: int | None = setting(
        None,
        "Report each token's log-probability and this many most likely others.",
        optional(integer(0, MAX_LOGPROBS)),
    )

    json_schema: str | None = setting(
        None,
        'A JSON schema the output must satisfy (a dict, or its JSON text); {"type": "object"} for any JSON object.',
        optional(SCHEMA),
        convert=_schema_text,
    )
    regex: str | None = setting(None, "A regular expression the whole output must match.", optional(TEXT))
    choice: tuple[str, ...] | None = setting(
        None, "Strings the output must be one of (repeatable).", optional(CHOICES), convert=_choices, cli_type=list[str]
    )
    grammar: str | None = setting(
        None, "A Lark grammar the output must follow (llguidance's dialect, rule `start`).", optional(TEXT)
    )
    grammar_trigger: str | None = setting(
        None,
        "Make the grammar lazy: it holds the output from each time the output writes this token until it "
        "completes (a tool call from its opening marker to its end), and the output is free elsewhere.",
        optional(TEXT),
    )

    def __post_init__(self) -> None:
        validate(self)
        given = [name for name in CONSTRAINTS if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"give at most one of {', '.join(CONSTRAINTS)}; got {' and '.join(given)}")
        if self.grammar_trigger is not None and self.grammar is None:
            raise ValueError("grammar_trigger needs a grammar to trigger")

    @property
    def constrained(self) -> bool:
        """Whether the output must follow a schema, regex, choice or grammar."""
        return any(getattr(self, name) is not None for name in CONSTRAINTS)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW
