"""The command line's options, derived from the settings: every field of `EngineConfig` and
`SamplingParams` is an option of the commands that take one (`with_settings`), with the field's own
flags, help text and default, so a setting is declared in one place; and errors name settings by
the flags a user types (`in_flags`)."""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import Field, fields
from typing import Any, NoReturn, Optional, get_args, get_type_hints

import typer
from typer.core import TyperCommand

from ..config import EngineConfig
from ..engine.sampling.params import SamplingParams

SETTINGS = {"config": EngineConfig, "params": SamplingParams}  # a command's parameter -> the record it gets
# The help's sections, in this order: what a run of `generate` or `chat` most often changes first.
PANELS = ("Sampling", "Prompt", "Model", "Serving", "Engine", "Memory", "Speculation", "Tensor parallel", "Options")


class PanelledCommand(TyperCommand):
    """A command whose help lists its options in sections (`PANELS`), plain text as Click prints it."""

    def format_options(self, ctx: Any, formatter: Any) -> None:  # Click's Context and HelpFormatter
        sections: dict[str, list[tuple[str, str]]] = {panel: [] for panel in PANELS}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                sections[getattr(param, "rich_help_panel", None) or "Options"].append(record)
        for panel, records in sections.items():
            if records:
                with formatter.section(f"{panel} options" if panel != "Options" else panel):
                    formatter.write_dl(records)


def fail(message: object) -> NoReturn:
    """End the command with one `error:` line, in the user's words (the flags they type)."""
    typer.echo(f"error: {in_flags(str(message))}", err=True)
    raise typer.Exit(1)


def _flags(item: Field[Any]) -> tuple[str, ...]:
    """A settings field's flags: its own, else `--` and its name with dashes."""
    return item.metadata["flags"] or (f"--{item.name.replace('_', '-')}",)


def _long_flags(item: Field[Any]) -> str:
    """How an error names a setting: its long flags (`--temperature/--temp`)."""
    return "/".join(flag for flag in _flags(item) if flag.startswith("--"))


def in_flags(message: str) -> str:
    """`message` with the settings it names written as the flags a user types: `max_tokens must
    be ...` is `--max-tokens must be ...`, and `8, 4 or None` is `8 or 4 (or left out)`. A one-word
    name (`seed`) is replaced only where it is the subject or an assignment, so that a word of
    English is not taken for it."""
    for item in (item for record in SETTINGS.values() for item in fields(record)):
        pattern = rf"\b{item.name}\b" if "_" in item.name else rf"\b{item.name}\b(?= must| cannot|=)"
        message = re.sub(pattern, _long_flags(item), message)
    message = re.sub(r", ([^,\s()\[\]]+) or None\b", r" or \1 or None", message)
    return re.sub(r" or None\b", " (or left out)", message)


def _cli_type(item: Field[Any], hint: Any) -> Any:
    """The type the command line parses a field as: its declared one, else its type less None."""
    return item.metadata["cli_type"] or next((a for a in get_args(hint) if a is not type(None)), hint)


def _old_name(flag: str) -> str:
    return "old_" + flag.lstrip("-").replace("-", "_")


def _old_option(name: str, flag: str, hint: Any) -> inspect.Parameter:
    """A hidden option for a setting's old flag (the command warns when it is given)."""
    option = typer.Option(None, flag, hidden=True)
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=Optional[hint])  # noqa: UP045


def _option(item: Field[Any], hint: Any, default: Any) -> inspect.Parameter:
    """The command-line option of one settings field: its flags, help text, default and type."""
    meta = item.metadata
    flags = _flags(item)
    kind = _cli_type(item, hint)
    if kind is bool:
        flags = (f"{flags[0]}/--no-{flags[0][2:]}",)
    if default == ():
        default = None  # a repeatable option's "none given"
    metavar = "<str>" if meta["cli_type"] == list[str] else None  # typer would print <list[str]>
    if meta["choices"]:
        metavar = "[" + "|".join(meta["choices"]) + "]"
    shown = default is not None and "[default:" not in meta["help"]  # a help text that says its default says it once
    option = typer.Option(
        default, *flags, help=meta["help"], show_default=shown, metavar=metavar, rich_help_panel=meta["panel"]
    )
    annotation = Optional[kind] if default is None else kind  # noqa: UP045 (typer reads the annotation)
    return inspect.Parameter(item.name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation)


def with_settings(
    defaults: Mapping[str, Any] | None = None,
    fixed: Mapping[str, Any] | None = None,
    sampling: Collection[str] | None = None,
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give a command one option per field of `EngineConfig` (if it takes `config`) and of
    `SamplingParams` (if it takes `params`; only the fields in `sampling` where given), with
    `defaults` of its own; `fixed` fields are set, not offered. The command is called with the
    records built from the options; a bad value ends it with one error line naming the setting."""
    defaults, fixed = dict(defaults or {}), dict(fixed or {})
    if sampling is not None:
        names = {f.name for f in fields(SamplingParams)}
        assert not isinstance(sampling, str) and set(sampling) <= names, f"not SamplingParams fields: {sampling}"
        fixed |= {f.name: f.default for f in fields(SamplingParams) if f.name not in sampling}

    def decorate(command: Callable[..., None]) -> Callable[..., None]:
        signature = inspect.signature(command)
        records = {name: cls for name, cls in SETTINGS.items() if name in signature.parameters}
        offered = {name: [f for f in fields(cls) if f.name not in fixed] for name, cls in records.items()}
        options = [
            _option(f, get_type_hints(records[name])[f.name], defaults.get(f.name, f.default))
            for name, items in offered.items()
            for f in items
        ]
        old = {
            _old_name(flag): (flag, f, records[name])
            for name, items in offered.items()
            for f in items
            for flag in f.metadata["old_flags"]
        }
        hidden = [
            _old_option(name, flag, _cli_type(f, get_type_hints(cls)[f.name])) for name, (flag, f, cls) in old.items()
        ]

        @functools.wraps(command)
        def run(**kwargs: Any) -> None:
            for name, (flag, f, _) in old.items():
                value = kwargs.pop(name)
                if value is not None:
                    typer.echo(f"warning: {flag} is now {_flags(f)[0]}; the old name goes in mlxkv 0.3", err=True)
                    kwargs[f.name] = value
            try:
                built = {
                    name: cls(
                        **{f.name: kwargs.pop(f.name) for f in offered[name]},
                        **{k: v for k, v in fixed.items() if k in {f.name for f in fields(cls)}},
                    )
                    for name, cls in records.items()
                }
            except (ValueError, TypeError) as exc:
                fail(exc)
            command(**kwargs, **built)

        own = [p for p in signature.parameters.values() if p.name not in records]
        run.__signature__ = signature.replace(parameters=own + options + hidden)  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in own + options + hidden}
        return run

    return decorate
