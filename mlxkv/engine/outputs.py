"""What the engine hands back per step: each request's new text and tokens, and its token counts."""

from __future__ import annotations

from dataclasses import dataclass

from .sampling.sampler import TokenLogprob


@dataclass(slots=True)
class Usage:
    """A request's token counts so far; `cached_tokens` of its prompt came from the prefix cache,
    `pinned_tokens` stay cached for a while (its `pin`)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    pinned_tokens: int = 0
    reasoning_tokens: int = 0  # of the completion tokens, a thinking model's reasoning


@dataclass(slots=True)
class RequestOutput:
    """What one step did for one request: new text (a thinking model's answer, its reasoning apart)
    and tokens (with their log-probabilities when asked for), or an embedding request's vector,
    whether it is done, and its token counts."""

    # why: plain slotted records, not frozen ones, as the engine makes one per running request per step
    request_id: str
    delta: str
    finished: bool
    finish_reason: str | None
    error: Exception | None = None  # set when finish_reason is "error"
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    usage: Usage | None = None
    stop_string: str | None = None  # the stop string that ended the text, when one did
    reasoning: str = ""  # new reasoning text of a thinking model (`delta` is its answer's)
    embedding: list[float] | None = None  # an embedding request's vector, in its last output
