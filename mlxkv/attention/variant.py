"""How one layer's attention departs from plain causal softmax attention: window, chunk, soft-cap, sinks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class Variant:
    """`window`: a query at position p sees keys p - window < j <= p (sliding-window layers);
    `chunk`: it sees keys from the start of its chunk, p - p % chunk <= j <= p (Llama 4's chunked
    local attention); `softcap`: scores become softcap * tanh(score / softcap) (Gemma 2); `sinks`:
    one logit per query head that joins every softmax (GPT-OSS)."""

    window: int | None = None
    softcap: float | None = None
    sinks: mx.array | None = None
    chunk: int | None = None


PLAIN = Variant()


def first_key(query_pos: Any, window: int | None, chunk: int | None = None) -> Any:
    """The first key position a query at `query_pos` (an int or an array) sees."""
    if chunk is not None:
        return query_pos - query_pos % chunk
    return 0 * query_pos if window is None else np.maximum(0, query_pos - window + 1)


def visible(query_pos: np.ndarray, key_pos: np.ndarray, window: int | None, chunk: int | None = None) -> np.ndarray:
    """Which keys each query sees (broadcast): causally, and within its window or chunk when given."""
    allowed: np.ndarray = key_pos <= query_pos
    if window is not None or chunk is not None:
        allowed &= key_pos >= first_key(query_pos, window, chunk)
    return allowed
