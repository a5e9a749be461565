"""Turning a batch of logits into next tokens: one argmax for the greedy rows, one draw for the others."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_top_p

from ...errors import MlxkvError
from .params import SamplingParams
from .structured_output import StructuredOutput

if TYPE_CHECKING:
    from ..request import Request


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
        thresholds = _column(top_p)  # apply_top_p broadcasts a column of per-row thresholds as it does a float
        logprobs = mx.where(thresholds < 1, apply_top_p(logprobs, thresholds), logprobs)  # type: ignore[arg-type]
    if any(p.min_p > 0 for p in params):
        floor = mx.max(logprobs, axis=-1, keepdims=True) + _column(
            [math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params]
        )
        logprobs = mx.where(logprobs < floor, -math.inf, logprobs)
    vocab = logits.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if min(top_k) < vocab:  # ties at the k-th value all stay
        kth = mx.take_along_axis(mx.sort(logprobs, axis=-1), mx.array([vocab - k for k in top_k])[:, None], axis=-1)
        logprobs = mx.where(logprobs < kth, -math.inf, logprobs)
    scaled = logprobs * _column([1 / p.temperature for p in params])
    noise = mx.vmap(lambda key: mx.random.gumbel((vocab,), key=key))(keys)
    return mx.argmax(scaled + noise, axis=-1).astype(mx.uint32)


def _after_thinking(
    logits: mx.array, structured: StructuredOutput, rows: list[tuple[Request, int, Sequence[int]]]
) -> mx.array:
    """`logits` with each constrained row masked by its matcher: a thinking model's constraint holds
    its answer only, so a reply that has not started may still open its thinking (or, harmony's,
    its answer's header): the first tokens of those markers are allowed beside what the grammar
    allows, and once it has begun one, only the tokens that go on with it."""
    thinkers = [(r.reasoning, first) for r, first, _ in rows if r.reasoning and r.reasoning.opening]
    begun = [(first, next_ones) for reasoning, first in thinkers if (next_ones := reasoning.continuations())]
    masked = {first for first, _ in begun}
    opening = [(first, t) for reasoning, first in thinkers if first not in masked for t in reasoning.openers()]
    at = (mx.array([f for f, _ in opening]), mx.array([t for _, t in opening]))
    kept = logits[at] if opening else None
    matched = [(r.constraint.matcher, first, d) for r, first, d in rows if r.constraint and first not in masked]
    if matched:
        logits = structured.masked(logits, matched)
    if kept is not None:
        logits[at] = kept
    return _only(logits, begun) if begun else logits


def _only(logits: mx.array, rows: Sequence[tuple[int, Sequence[int]]]) -> mx.array:
    """`logits` with each of `rows` allowing its tokens only (a thinking budget's end marker, the
    rest of a marker a constrained reply has begun)."""
    allowed = np.zeros((len(rows), logits.shape[-1]), dtype=np.bool_)
    for i, (_, tokens) in enumerate(rows):
        allowed[i, list(tokens)] = True
    index = mx.array([row for row, _ in rows])
    logits[index] = mx.where(mx.array(allowed), logits[index], -mx.inf)
    return logits


def draw(
    logits: mx.array,
    requests: Sequence[Request],
    indices: Sequence[int],
    drafts: Sequence[Sequence[int]],
    structured: StructuredOutput,
) -> tuple[mx.array, tuple[mx.array, ...]]:
    """A step's draws (lazy): row i's `1 + len(drafts[i])` tokens (its last token's and one for each
    draft token) for `requests[i]` from its output number `indices[i]` on, each row under an active constraint
    masked; and the log-probabilities the requests asked for (`logprobs`, or none)."""
    widths = [1 + len(d) for d in drafts]
    firsts = np.cumsum(widths) - widths  # each row's first row of logits
    constrained = [
        (r, int(f), d)
        for r, f, d in zip(requests, firsts, drafts)
        if r.constraint is not None and r.constraint.active and not (r.reasoning and r.reasoning.thinking)
    ]
    if constrained:
        logits = _after_thinking(logits, structured, constrained)
    forced = [
        (int(f), (t,)) for r, f in zip(requests, firsts) if r.reasoning and (t := r.reasoning.forced()) is not None
    ]
    if forced:
        logits = _only(logits, forced)
    samplers = [r.sampler for r, w in zip(requests, widths) for _ in range(w)]
    tokens = sample(logits, samplers, [n + i for n, w in zip(indices, widths) for i in range(w)])
    wanted = [r.params.logprobs for r in requests if r.params.logprobs is not None]
    return tokens, logprobs(logits, tokens, max(wanted)) if wanted else ()
