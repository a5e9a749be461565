"""How one request samples, declared once: `SamplingParams`; CLI options and HTTP fields derive from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..settings import BOOLEAN, POSITIVE, Check, integer, number, optional, setting, validate

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
    logprobs: int | None = setting(
        None,
        "Report each token's log-probability and this many most likely others.",
        optional(integer(0, MAX_LOGPROBS)),
    )

    def __post_init__(self) -> None:
        validate(self)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW
