"""Settings declared once: a dataclass field carries its default, its help text and the values it accepts.

`EngineConfig` and `SamplingParams` declare their fields with `setting`; `validate` checks a
record against that declaration, and the CLI options, `LLM(...)` keywords and HTTP request
fields are derived from it.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar


@dataclass(frozen=True)
class Check:
    """The values a setting accepts, and how an error message says so."""

    accepts: Callable[[Any], bool]
    expected: str


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def integer(low: int = 0, high: int | None = None) -> Check:
    """An int (not a bool) in [low, high]."""
    expected = f"an integer in [{low}, {high}]" if high is not None else f"an integer >= {low}"
    return Check(lambda v: _is_int(v) and low <= v and (high is None or v <= high), expected)


POSITIVE = Check(integer(1).accepts, "a positive integer")


def number(low: float, high: float | None = None, *, low_open: bool = False, high_open: bool = False) -> Check:
    """A finite int or float between `low` and `high`, each bound included unless open."""
    if high is None:
        expected = f"a number {'>' if low_open else '>='} {low:g}"
    else:
        expected = f"a number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"

    def accepts(v: Any) -> bool:
        return (
            _is_real(v)
            and (v > low if low_open else v >= low)
            and (high is None or (v < high if high_open else v <= high))
        )

    return Check(accepts, expected)


def one_of(*values: object) -> Check:
    """One of `values` (ints are not bools)."""
    words = [repr(v) for v in values]
    expected = ", ".join(words[:-1]) + f" or {words[-1]}"
    return Check(lambda v: not isinstance(v, bool) and any(isinstance(v, type(x)) and v == x for x in values), expected)


BOOLEAN = Check(lambda v: isinstance(v, bool), "True or False")
TEXT = Check(lambda v: isinstance(v, str) and bool(v), "a non-empty string")


def optional(check: Check) -> Check:
    """`check`, or None."""
    choices = check.expected.replace(" or ", ", ")  # "8 or 4" -> "8, 4 or None"
    return Check(lambda v: v is None or check.accepts(v), f"{choices} or None")


def require(name: str, value: Any, check: Check) -> Any:
    """`value` if `check` accepts it, else a ValueError naming the argument and what it accepts."""
    if not check.accepts(value):
        raise ValueError(f"{name} must be {check.expected}, got {value!r}")
    return value


def setting(
    default: Any,
    help: str,
    check: Check | None = None,
    *,
    flags: tuple[str, ...] = (),
    old_flags: tuple[str, ...] = (),
    convert: Callable[[Any], Any] | None = None,
    cli_type: Any = None,
    choices: tuple[str, ...] = (),
    panel: str = "Sampling",
) -> Any:
    """A settings field: `default`, a one-sentence `help` (the CLI's), the values it accepts, how a
    given value is normalised first (`convert`), and its CLI flags and type where the field's name
    and type do not make them (`--page-size` for `page_size`); `old_flags` still work, hidden and
    with a warning, for one release. The CLI lists `choices` as the option's values and shows it
    in the help's `panel`."""
    metadata = {
        "help": help,
        "check": check,
        "flags": flags,
        "old_flags": old_flags,
        "convert": convert,
        "cli_type": cli_type,
        "choices": choices,
        "panel": panel,
    }
    return field(default=default, metadata=metadata)


def validate(record: Any) -> None:
    """Normalise and check every field of a (frozen) settings record, naming the first bad one."""
    for item in fields(record):
        value = getattr(record, item.name)
        if item.metadata.get("convert") is not None:
            value = item.metadata["convert"](value)
            object.__setattr__(record, item.name, value)
        if item.metadata.get("check") is not None:
            require(item.name, value, item.metadata["check"])


F = TypeVar("F", bound=Callable[..., Any])


def keywords_of(settings: type) -> Callable[[F], F]:
    """Decorator: a function taking `**settings` shows the record's fields as its keywords (help(),
    editors), in place of `**settings`."""

    def decorate(function: F) -> F:
        own = [p for p in inspect.signature(function).parameters.values() if p.kind is not p.VAR_KEYWORD]
        keywords = [
            inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
            for f in fields(settings)
        ]
        function.__signature__ = inspect.Signature(own + keywords)  # type: ignore[attr-defined]
        return function

    return decorate
