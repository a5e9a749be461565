"""Durations as Ollama reads `keep_alive`: seconds as a number, or Go's duration text ("5m",
"1h30m", "-1s"); negative means forever. The server's `--keep-alive`, a models file's
`keep_alive` and every API's body read them alike."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BeforeValidator

PART = re.compile(r"(\d+(\.\d+)?)(ns|us|µs|ms|s|m|h)")
DURATION = re.compile(rf"-?({PART.pattern})+")
UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def seconds(duration: str | float, name: str = "keep_alive") -> float:
    """`duration` in seconds; ValueError naming `name` if it is neither a number nor a duration."""
    if isinstance(duration, (int, float)) and not isinstance(duration, bool):
        return float(duration)
    try:
        return float(duration)
    except (TypeError, ValueError):
        pass
    if not isinstance(duration, str) or not DURATION.fullmatch(duration):
        raise ValueError(f"{name} must be seconds or a duration such as '5m' or '1h', got {duration!r}")
    total = sum(float(count) * UNITS[unit] for count, _, unit in PART.findall(duration))
    return -total if duration.startswith("-") else total


def _read(value: Any) -> Any:
    return seconds(value) if isinstance(value, str) else value


KeepAlive = Annotated[float | None, BeforeValidator(_read)]  # a body's keep_alive: seconds, or a duration's text
