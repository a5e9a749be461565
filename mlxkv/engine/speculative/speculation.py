"""Speculative decoding's decisions: how many tokens each request drafts in a step, and how many
of them the model accepted.

A speculating decode row runs its last token and `k` draft tokens through the model in one chunk;
the model's own draw at each of the k + 1 positions (with the key of that output's index, as
without speculation) is compared with the drafts, and the drafts are accepted up to the first
that differs, whose position's draw is the correction (or, all accepted, the bonus token). The
outputs are therefore exactly the tokens the request draws without speculation, greedy or seeded.

Whether a draft token pays is measured. Step time is fitted on the steps the engine runs
(`StepTime`: a fixed part, a part per token and a part per token of context attended), and
drafting's own time per draft token (a draft model's decode step; next to nothing for prompt
lookup) is averaged. A step of n tokens makes about n tokens in `fixed + per_token * n` seconds
(leaving attention aside); the i-th draft token of a request whose drafts are accepted at a
rate r adds r**i tokens (its chance of being accepted) for `per_token` seconds and its share of
the drafting, so it is proposed only while r**i beats the cost's share of the step. While reading
the weights dominates a step (one chat, or few), that share is small and requests draft their
most; in a full batch of a compute-bound step, or with a draft that is seldom right, it is not,
and drafting stops. A request that stopped drafting tries again after a rest that doubles each
time the trial fails, so a draft that is never right costs next to nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ..memory.step_time import StepTime

if TYPE_CHECKING:
    from ..request import Request

logger = logging.getLogger(__name__)
PRIOR_RATE = 0.6  # a request's acceptance rate before any of its drafts is verified
RATE_WEIGHT = 0.3  # weight of the latest verification in the moving average
LONGEST_REST = 64  # most steps a request sits out before trying to draft again


class Drafter(Protocol):
    """Proposes draft tokens for requests whose tokens are all known on the host."""

    def propose(self, requests: Sequence[Request], lengths: Sequence[int]) -> list[list[int]]:
        """Up to `lengths[i]` tokens likely to follow `requests[i]`'s tokens (maybe fewer, or none)."""
        ...

    def forget(self, request: Request) -> None:
        """`request` is finished: drop what is kept for it."""
        ...

    def reset(self) -> None:
        """Drop everything kept, after a failure."""
        ...


@dataclass
class Speculation:
    """One request's drafting: its acceptance rate (a moving average of the share of draft tokens
    accepted per trial), its totals, and the steps it sits out after drafting stopped paying."""

    rate: float = PRIOR_RATE
    drafted: int = 0
    accepted: int = 0
    rest: int = 0  # steps left to sit out
    next_rest: int = 1  # the rest after the next time drafting stops paying

    def length(self, most: int, share: float) -> int:
        """Draft tokens worth proposing: the i-th is accepted with chance rate**i, and pays while
        that beats `share` (the share of a step one draft token costs)."""
        if self.rest:
            self.rest -= 1
            if not self.rest:
                self.rate = PRIOR_RATE  # rested: a fresh trial
            return 0
        k = 0
        while k < most and self.rate ** (k + 1) > share:
            k += 1
        if k == 0:
            self.rest, self.next_rest = self.next_rest, min(2 * self.next_rest, LONGEST_REST)
        return k

    def record(self, drafted: int, accepted: int) -> None:
        """`accepted` of `drafted` draft tokens were accepted (a rejection ends a trial)."""
        self.drafted += drafted
        self.accepted += accepted
        trials = accepted + (accepted < drafted)
        self.rate += RATE_WEIGHT * (accepted / trials - self.rate)
        if accepted:
            self.next_rest = 1


def accepted_prefix(draft: Sequence[int], sampled: Sequence[int]) -> int:
    """How many of `draft` the model accepted: those equal to its draws before them
    (`sampled[i]` is its draw where `draft[i]` was proposed)."""
    count = 0
    while count < len(draft) and draft[count] == sampled[count]:
        count += 1
    return count


@dataclass(frozen=True)
class SpeculationStats:
    """Draft tokens proposed and accepted so far, over every request."""

    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class Speculator:
    """The engine's speculative decoding: a drafter, at most `most` draft tokens a request and
    step, and the step-time fit that says how many pay."""

    def __init__(self, drafter: Drafter, most: int, step_time: StepTime) -> None:
        self.drafter = drafter
        self.most = most
        self.step_time = step_time
        self.draft_step = 0.0  # seconds of drafting per draft token of every request, a moving average
        self.stats = SpeculationStats()

    def step_lengths(self, running: Sequence[Request], waiting: bool, budget: int) -> dict[Request, int]:
        """How many draft tokens each running decode request proposes in the next step (those
        proposing any), in a step of at most `budget` tokens beside the prefill the running
        requests have left (and a full budget more of it when requests are `waiting`)."""
        decode = [r for r in running if r.is_decode and not r.done_sampling]
        prefill = sum(r.num_remaining for r in running if not r.is_decode)
        left = budget - len(decode)
        return self.lengths(decode, min(left, prefill + (left if waiting else 0)))

    def lengths(self, requests: Sequence[Request], other_tokens: int) -> dict[Request, int]:
        """How many draft tokens each decode request (of those that would propose any) proposes in
        a step of these rows and `other_tokens` more: as many as pay, within its `max_tokens`."""
        share = self._share(len(requests) + other_tokens, sum(r.num_tokens for r in requests))
        wanted = {}
        for request in requests:
            room = request.params.max_tokens - len(request.output_ids) - 1  # k drafts make k + 1 outputs
            free = request.reasoning.free(request.num_pending) if request.reasoning is not None else None
            if free is not None:  # no draft reaches where a thinking budget forces its end marker
                room = min(room, free - 1)
            k = min(request.speculation.length(self.most, share), room)
            if k > 0:
                wanted[request] = k
        return wanted

    def _share(self, tokens: int, attended: int) -> float:
        """The share of a step of `tokens` tokens attending `attended` token pairs that its tokens
        and a draft token's drafting cost: 0 before anything is measured (tokens are then free)."""
        fitted = self.step_time.coefficients
        if fitted is None:
            return 0.0
        fixed, per_token, per_pair = fitted
        varying = per_token * tokens + per_pair * attended
        return 1.0 if fixed + varying <= 0 else (varying + self.draft_step) / (fixed + varying)

    def propose(self, requests: Sequence[Request], lengths: Sequence[int]) -> None:
        """Set each request's `draft`: at most its length of tokens from the drafter, cut at the
        first its constraint forbids. A drafter that fails costs the step its drafts, never a
        request: it starts afresh."""
        started = time.perf_counter()
        try:
            proposals = self.drafter.propose(requests, lengths)
        except Exception as exc:
            logger.warning("drafting failed (%s); this step runs without draft tokens", exc)
            proposals = [[] for _ in requests]
            self.drafter.reset()
        if lengths:
            self.draft_step += RATE_WEIGHT * ((time.perf_counter() - started) / max(lengths) - self.draft_step)
        for request, proposal, most in zip(requests, proposals, lengths):
            request.draft = proposal[:most]
            if request.constraint is not None and request.draft:
                reasoning = request.reasoning
                # a draft could open or end the thinking, unchecked by the constraint
                thinking = reasoning is not None and (reasoning.thinking or reasoning.opening)
                del request.draft[0 if thinking else request.constraint.draftable(request.draft) :]

    def record(self, request: Request, drafted: int, accepted: int) -> None:
        request.speculation.record(drafted, accepted)
        self.stats = SpeculationStats(self.stats.drafted + drafted, self.stats.accepted + accepted)
