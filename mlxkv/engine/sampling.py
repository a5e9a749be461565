"""Sampling parameters, and turning a batch of logits into next tokens with mlx-lm's filters."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request. `temperature=0` is greedy.

    `stop` strings end the text before the stop string; `seed` makes sampling reproducible
    whatever else shares the batch; `ignore_eos` generates past EOS (for benchmarks).
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    stop: tuple[str, ...] = field(default_factory=tuple)
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        checks = [
            ("max_tokens", _is_int(self.max_tokens) and self.max_tokens >= 1, "an integer >= 1"),
            ("temperature", _is_real(self.temperature) and self.temperature >= 0, "a number >= 0"),
            ("top_p", _is_real(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("top_k", _is_int(self.top_k) and self.top_k >= 0, "an integer >= 0 (0 disables it)"),
            ("min_p", _is_real(self.min_p) and 0 <= self.min_p < 1, "a number in [0, 1)"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "non-empty strings"),
            ("seed", self.seed is None or _is_int(self.seed), "an integer or None"),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(f"{name} must be {expected}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class TokenSampler:
    """One request's sampler: its own PRNG key, so a seed gives the same tokens in any batch.

    The key is made on first use, on the engine's thread: MLX arrays belong to the thread
    that builds them, and requests may be created on any thread.
    """

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._seed = params.seed if params.seed is not None else random.getrandbits(63)
        self._key: mx.array | None = None

    def __call__(self, logits: mx.array) -> mx.array:
        """The next token (a 0-d uint32 array) from one row of logits."""
        p = self.params
        if p.greedy:
            return mx.argmax(logits, axis=-1)
        logprobs = logits.astype(mx.float32) - mx.logsumexp(logits.astype(mx.float32), axis=-1, keepdims=True)
        if p.top_p < 1:
            logprobs = apply_top_p(logprobs[None], p.top_p)[0]
        if p.min_p > 0:
            logprobs = apply_min_p(logprobs[None], p.min_p)[0]
        if 0 < p.top_k < logits.shape[-1]:
            logprobs = apply_top_k(logprobs, p.top_k)
        self._key, key = mx.random.split(mx.random.key(self._seed) if self._key is None else self._key)
        return mx.random.categorical(logprobs * (1 / p.temperature), key=key)


def sample(logits: mx.array, samplers: list[TokenSampler]) -> mx.array:
    """Next tokens for rows of `logits` (`[rows, vocab]`), one sampler per row."""
    if all(s.params.greedy for s in samplers):
        return mx.argmax(logits, axis=-1)
    return mx.stack([s(logits[i]) for i, s in enumerate(samplers)]).astype(mx.uint32)
