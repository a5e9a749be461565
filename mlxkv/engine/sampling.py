"""Sampling parameters, and turning a batch of logits into next tokens with mlx-lm's filters."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_p

from ..errors import MlxkvError

GREEDY_BELOW = 1e-5  # a lower temperature is greedy: 1/T would push the scaled logits past float32
MAX_LOGPROBS = 20  # most alternatives a request may ask log-probabilities for (OpenAI's limit)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request. `temperature` 0 (or below `GREEDY_BELOW`) is greedy.

    `stop` strings end the text before the stop string; `seed` (0 <= seed < 2**64) makes
    sampling reproducible whatever else shares the batch; `ignore_eos` generates past EOS
    (for benchmarks); `logprobs` (0 to `MAX_LOGPROBS`) reports each token's log-probability
    under the model and that many most likely alternatives.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    stop: tuple[str, ...] = field(default_factory=tuple)
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else self.stop
        if isinstance(stop, (list, tuple)):
            object.__setattr__(self, "stop", tuple(stop))
        checks = [
            ("max_tokens", _is_int(self.max_tokens) and self.max_tokens >= 1, "an integer >= 1"),
            ("temperature", _is_real(self.temperature) and self.temperature >= 0, "a number >= 0"),
            ("top_p", _is_real(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("top_k", _is_int(self.top_k) and self.top_k >= 0, "an integer >= 0 (0 disables it)"),
            ("min_p", _is_real(self.min_p) and 0 <= self.min_p < 1, "a number in [0, 1)"),
            ("stop", isinstance(self.stop, tuple) and all(isinstance(s, str) and s for s in self.stop),
             "a non-empty string or a list of them"),
            ("seed", self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**64),
             "an integer in [0, 2**64) or None"),
            ("ignore_eos", isinstance(self.ignore_eos, bool), "True or False"),
            ("logprobs", self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
             f"an integer in [0, {MAX_LOGPROBS}] or None"),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(f"{name} must be {expected}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def log_softmax(logits: mx.array) -> mx.array:
    """Log-probabilities over the last axis, in float32."""
    scores = logits.astype(mx.float32)
    return scores - mx.logsumexp(scores, axis=-1, keepdims=True)


def _mix(seed: int, index: int) -> int:
    """A 64-bit key seed for sample `index` of a request seeded `seed` (splitmix64's mixer)."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return z ^ (z >> 31)


class TokenSampler:
    """One request's sampling parameters and seed. The PRNG key of its n-th token is a function
    of its seed and n alone, so a seed gives the same tokens in any batch, and a step that is
    run again (after a preemption or a failed step) draws exactly what it would have drawn."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.seed = params.seed if params.seed is not None else random.getrandbits(64)

    def key(self, index: int) -> mx.array:
        """The PRNG key of the request's token number `index`."""
        return mx.random.key(_mix(self.seed, index))


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model, and the most likely tokens' (best first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def logprobs(logits: mx.array, tokens: mx.array, top: int) -> tuple[mx.array, mx.array, mx.array]:
    """Log-probabilities of `tokens` (one per row of `logits`), and the ids and log-probabilities
    of each row's `top` most likely tokens (unordered); lazy, for the step's one evaluation."""
    scores = log_softmax(logits)
    chosen = mx.take_along_axis(scores, tokens.astype(mx.int32)[:, None], axis=-1)[:, 0]
    ids = mx.argpartition(-scores, top - 1, axis=-1)[:, :top] if top else mx.zeros((scores.shape[0], 0), mx.int32)
    return chosen, ids, mx.take_along_axis(scores, ids, axis=-1)


class SamplingFailed(MlxkvError):
    """Row `row`'s sampler raised: the request behind that row is the one to fail."""

    def __init__(self, row: int, cause: Exception) -> None:
        super().__init__(f"sampling failed: {cause}")
        self.row = row
        self.cause = cause


def sample(logits: mx.array, samplers: list[TokenSampler], indices: list[int]) -> mx.array:
    """Next tokens for rows of `logits` (`[rows, vocab]`): row i is token `indices[i]` of its
    request. One argmax for the greedy rows and one batched draw for the others, whatever mix of
    parameters they have (a row's draw depends only on its logits, parameters and key)."""
    greedy = mx.argmax(logits, axis=-1).astype(mx.uint32)
    rows = [row for row, s in enumerate(samplers) if not s.params.greedy]
    if not rows:
        return greedy
    keys = []
    for row in rows:
        try:
            keys.append(samplers[row].key(indices[row]))
        except Exception as exc:
            raise SamplingFailed(row, exc) from exc
    index = mx.array(rows)
    greedy[index] = _draw(logits[index], [samplers[row].params for row in rows], mx.stack(keys))
    return greedy


def _column(values: list[float]) -> mx.array:
    return mx.array(values, mx.float32)[:, None]


def _draw(logits: mx.array, params: list[SamplingParams], keys: mx.array) -> mx.array:
    """Tokens drawn from `logits` rows (mlx-lm's top-p, min-p and top-k filters, in that order,
    with each row's own parameters, then temperature), with each row's key: the Gumbel-max draw
    `mx.random.categorical` makes, one row at a time or all at once."""
    logprobs = log_softmax(logits)
    top_p = [p.top_p for p in params]
    if min(top_p) < 1:
        logprobs = mx.where(_column(top_p) < 1, apply_top_p(logprobs, _column(top_p)), logprobs)
    if any(p.min_p > 0 for p in params):
        floor = mx.max(logprobs, axis=-1, keepdims=True) + _column([math.log(p.min_p) if p.min_p > 0 else -math.inf
                                                                    for p in params])
        logprobs = mx.where(logprobs < floor, -math.inf, logprobs)
    vocab = logits.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if min(top_k) < vocab:  # ties at the k-th value all stay
        kth = mx.take_along_axis(mx.sort(logprobs, axis=-1), mx.array([vocab - k for k in top_k])[:, None], axis=-1)
        logprobs = mx.where(logprobs < kth, -math.inf, logprobs)
    scaled = logprobs * _column([1 / p.temperature for p in params])
    noise = mx.vmap(lambda key: mx.random.gumbel((vocab,), key=key))(keys)
    return mx.argmax(scaled + noise, axis=-1).astype(mx.uint32)
