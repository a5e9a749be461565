"""How one layer's attention departs from plain causal softmax attention: window, soft-cap, sinks."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class Variant:
    """`window`: a query at position p sees keys p - window < j <= p (sliding-window layers);
    `softcap`: scores become softcap * tanh(score / softcap) (Gemma 2); `sinks`: one logit per
    query head that joins every softmax (GPT-OSS)."""

    window: int | None = None
    softcap: float | None = None
    sinks: mx.array | None = None


PLAIN = Variant()


def visible(query_pos: np.ndarray, key_pos: np.ndarray, window: int | None) -> np.ndarray:
    """Which keys each query sees (broadcast): causally, and within `window` positions when given."""
    allowed = key_pos <= query_pos
    if window is not None:
        allowed &= key_pos > query_pos - window
    return allowed
