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


def visible(
    query_pos: np.ndarray,
    key_pos: np.ndarray,
    window: int | None,
    chunk: int | None = None,
    blocks: np.ndarray | None = None,
) -> np.ndarray:
    """Which keys each query sees (broadcast): causally, and within its window or chunk when given;
    with `blocks` (`query_pos`'s shape and 2 more: `[first, end)` positions), every key of its
    block as well, later ones included (see `KVBatch.with_blocks`)."""
    allowed: np.ndarray = key_pos <= query_pos
    if window is not None or chunk is not None:
        allowed &= key_pos >= first_key(query_pos, window, chunk)
    if blocks is not None:
        allowed |= (key_pos >= blocks[..., 0]) & (key_pos < blocks[..., 1])
    return allowed


def key_range(
    query_pos: np.ndarray, window: int | None, chunk: int | None = None, blocks: np.ndarray | None = None
) -> tuple[int, int]:
    """The first key any of these queries sees, and the position past the last one (as `visible` says)."""
    first, end = int(first_key(int(query_pos.min()), window, chunk)), int(query_pos.max()) + 1
    if blocks is not None:
        flat = blocks.reshape(-1, 2)
        inside = flat[flat[:, 1] > flat[:, 0]]
        if inside.size:
            first, end = min(first, int(inside[:, 0].min())), max(end, int(inside[:, 1].max()))
    return first, end
