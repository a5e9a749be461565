"""What becomes of the tokens a step sampled: each row's draws are accepted into its request (a
speculating row's only as far as its draft tokens match them), checked against EOS, stop strings,
the request's constraint and `max_tokens`, turned into text, and reported as `RequestOutput`s; a
request that ends is finished here, its sequence released."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..errors import MlxkvError
from .outputs import RequestOutput, Usage
from .recent_outputs import RecentOutputs
from .request import Request, Status
from .sampling.sampler import TokenLogprob
from .scheduler import Scheduler
from .speculative.speculation import Speculator, accepted_prefix


class OutputProcessor:
    """Accepts sampled tokens into the live `requests` (by id), which it drops as they finish (their
    text and tokens kept in `recent`, where given)."""

    def __init__(
        self,
        tokenizer: TokenizerWrapper,
        scheduler: Scheduler,
        speculator: Speculator | None,
        requests: dict[str, Request],
        recent: RecentOutputs | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.speculator = speculator
        self.requests = requests
        self.recent = recent

    def accept_step(
        self,
        rows: Sequence[tuple[Request, int, list[int]]],
        sampled: list[int],
        scored: list[list[Any]],
        now: float,
    ) -> list[RequestOutput]:
        """The outputs of a step whose rows (request, the output number it sampled first, its draft
        tokens) drew `sampled`, `1 + len(draft)` a row, with `scored` the log-probabilities asked
        for; read at time `now`. Requests finished meanwhile (aborted) are skipped."""
        scores = _token_logprobs([r for r, _, draft in rows for _ in range(1 + len(draft))], sampled, scored)
        outputs, first = [], 0
        for request, index, draft in rows:
            row, first = slice(first, first + 1 + len(draft)), first + 1 + len(draft)
            if request.status is not Status.FINISHED:
                outputs.append(self._verify(request, index, draft, sampled[row], scores[row], now))
        return outputs

    def accept_vectors(self, requests: list[Request], vectors: list[list[float]], now: float) -> list[RequestOutput]:
        """The last outputs of embedding requests whose vectors a step made, read at time `now`
        (those finished meanwhile, aborted, are skipped)."""
        outputs = []
        for request, vector in zip(requests, vectors):
            if request.status is not Status.FINISHED:
                request.first_token_time, request.embedding = now, vector
                outputs.append(self.finish(request, "stop"))
        return outputs

    def _verify(
        self, request: Request, index: int, draft: list[int], sampled: list[int], scores: list[Any], now: float
    ) -> RequestOutput:
        """Accept a row's draws from output number `index` on: its first draw, and one more for
        each draft token equal to the draw before it (the drafts so accepted are computed: their
        K/V stay; the rest are given back)."""
        if not draft:
            return self._accept(request, index, sampled, scores, now)
        assert self.speculator is not None
        accepted = accepted_prefix(draft, sampled)
        self.speculator.record(request, len(draft), accepted)
        output = self._accept(request, index, sampled[: accepted + 1], scores[: accepted + 1], now)
        if request.status is Status.RUNNING:
            self.scheduler.commit_verified(request, 1 + accepted)
        return output

    def _accept(self, request: Request, index: int, tokens: list[int], scores: list[Any], now: float) -> RequestOutput:
        """Make `tokens`, read at time `now`, outputs number `index`, `index + 1`, ... (the first
        in its placeholder), and end the request at the first that finishes it (dropping what
        comes after, and what a later step computed for it)."""
        if request.first_token_time is None:
            request.first_token_time = now
        for count, token in enumerate(tokens):
            reason = self._take(request, index + count, token)
            if reason is not None:
                kept = count + (reason not in ("eos", "error"))
                return self.finish(
                    request, "stop" if reason == "eos" else reason, tuple(tokens[:kept]), _present(scores[:kept])
                )
        return output_of(request, tuple(tokens), _present(scores))

    def _take(self, request: Request, index: int, token: int) -> str | None:
        """Make `token` output number `index` (its placeholder, or the next output); the reason it
        ends the request, if it does ("eos": the token is not an output)."""
        if token in self.tokenizer.eos_token_ids and not request.params.ignore_eos:
            request.truncate_outputs(index)
            return "eos"
        if index < len(request.output_ids):
            request.set_output(index, token)
        else:
            request.append_output(token)
        constraint = request.constraint
        assert request.stream is not None  # every request the engine admits has its stream
        for routed, thinking in _routed(request, token):
            if thinking:  # a thinking model's reasoning: free text, whatever the answer must follow
                assert request.reasoning is not None
                request.reasoning.stream.add(routed)
                continue
            if constraint is not None and not constraint.consume(routed):  # the mask allowed it: a bug
                request.error = MlxkvError(f"structured output failed: {constraint.error()}")
                return "error"
            if request.stream.add(routed):
                request.truncate_outputs(index + 1)
                return "stop"
        if constraint is not None and constraint.is_stopped():  # its constraint allows nothing more
            return "stop"
        if index + 1 >= request.params.max_tokens:
            return "length"
        return None

    def fail(self, request: Request, error: Exception) -> RequestOutput:
        """End `request` with `error`."""
        request.error = error
        return self.finish(request, "error")

    def finish(
        self, request: Request, reason: str, token_ids: tuple[int, ...] = (), scores: tuple[TokenLogprob, ...] = ()
    ) -> RequestOutput:
        """End `request` for `reason` ("stop", "length", "error"), its last outputs `token_ids`."""
        request.drop_pending()
        if self.speculator is not None:
            self.speculator.drafter.forget(request)
        assert request.stream is not None
        if request.reasoning is not None:
            for token, thinking in request.reasoning.flush():
                (request.reasoning.stream if thinking else request.stream).add(token)
            if not request.reasoning.stream.finished:
                request.reasoning.stream.finish()
        request.stream.finish()
        if self.recent is not None and request.error is None and not request.embeds:
            self.recent.remember(request, whole=not request.stream.stopped)  # a stop string cuts the text
        request.finish_time = time.perf_counter()
        self.scheduler.finish(request, reason)
        del self.requests[request.request_id]
        return output_of(request, token_ids, scores)


def output_of(
    request: Request, token_ids: tuple[int, ...] = (), scores: tuple[TokenLogprob, ...] = ()
) -> RequestOutput:
    """`request`'s output now: its new text and tokens, and its usage so far."""
    reasoning = request.reasoning
    usage = Usage(
        len(request.prompt_ids),
        request.num_outputs,
        request.num_cached_tokens or 0,
        request.pinned_tokens or 0,
        reasoning.tokens if reasoning is not None else 0,
    )
    assert request.stream is not None
    return RequestOutput(
        request.request_id,
        request.stream.take_delta(),
        request.status is Status.FINISHED,
        request.finish_reason,
        request.error,
        token_ids,
        scores,
        usage,
        request.stream.stop_string,
        reasoning.stream.take_delta() if reasoning is not None else "",
        request.embedding,
    )


def _routed(request: Request, token: int) -> list[tuple[int, bool]]:
    """An accepted token, with those a thinking model held before it, each with whether it is
    reasoning (see `Reasoning`): as it is, for a model that does not think."""
    return request.reasoning.route(token) if request.reasoning is not None else [(token, False)]


def _present(scores: list[TokenLogprob | None]) -> tuple[TokenLogprob, ...]:
    """The log-probabilities asked for (a request that asked none has None for each token)."""
    return tuple(score for score in scores if score is not None)


def _token_logprobs(sampling: list[Request], tokens: list[int], scored: list[list[Any]]) -> list[TokenLogprob | None]:
    """Each sampled row's `TokenLogprob`, for the requests that asked (None for the others)."""
    if not scored:
        return [None] * len(sampling)
    chosen, ids, values = scored
    return [
        None
        if r.params.logprobs is None
        else TokenLogprob(
            token, chosen[row], tuple(sorted(zip(ids[row], values[row]), key=lambda p: -p[1])[: r.params.logprobs])
        )
        for row, (r, token) in enumerate(zip(sampling, tokens))
    ]
