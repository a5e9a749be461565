"""A request's state as it moves through the engine: tokens, progress, text, finish."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..cache.pins import Pin
from .sampling.constraint import Constraint
from .sampling.params import SamplingParams
from .sampling.reasoning import Reasoning
from .sampling.sampler import TokenSampler
from .sampling.text import TextStream
from .speculative.speculation import Speculation

if TYPE_CHECKING:
    from .images import PromptImages

PENDING = -1  # an output token sampled by a step whose result the host has not read yet
NO_SEQUENCE = -1  # the seq_id of a request that holds no sequence in the KV cache (not running)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Request:
    """One prompt being completed.

    `num_computed` counts tokens (prompt, then outputs) whose K/V are in the cache; the
    rest (the prompt's remainder, or the token sampled last) is what the next step computes.
    `num_cached_tokens` is how many prompt tokens its first admission found in the prefix
    cache (None until admitted); requests share cached pages only when their
    `cache_salt`s are equal. An embedding request (`embeds`) computes its prompt and ends with
    the vector its model's pooling makes of it (see `LLMEngine.add_embedding`).
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    pin: Pin | None = None  # keep the prompt's first tokens cached for a while, once computed
    embeds: bool = False  # an embedding request: its prompt's last hidden state is pooled, nothing sampled
    images: PromptImages | None = None  # where its images sit in its prompt (see `images`)
    output_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)  # prompt then outputs, for slicing and hashing
    status: Status = Status.WAITING
    seq_id: int = NO_SEQUENCE
    num_computed: int = 0
    num_cached_tokens: int | None = None
    finish_reason: str | None = None
    error: Exception | None = None  # why it failed, when finish_reason is "error"
    stream: TextStream | None = None  # the text (a thinking model's answer)
    reasoning: Reasoning | None = None  # a thinking model's reasoning, apart from its answer
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    num_pending: int = field(default=0, init=False)  # outputs still `PENDING` (always the last ones)
    sampler: TokenSampler = field(init=False)
    pinned_tokens: int | None = field(default=None, init=False)  # tokens `pin` pinned, once it has
    constraint: Constraint | None = field(default=None, init=False)  # following a constrained output
    draft: list[int] = field(default_factory=list, init=False)  # tokens proposed to follow, for the next step
    speculation: Speculation = field(default_factory=Speculation, init=False)
    held_steps: int = field(default=0, init=False)  # steps its first token waited for other prompts
    page_keys: list[bytes] | None = field(default=None, init=False)  # its chain while it waits (Scheduler._restoring)
    embedding: list[float] | None = field(default=None, init=False)  # an embedding request's vector, once made

    def __post_init__(self) -> None:
        self.sampler = TokenSampler(self.params)
        self.all_token_ids = self.prompt_ids + self.output_ids

    def append_output(self, token: int) -> None:
        self.output_ids.append(token)
        self.all_token_ids.append(token)
        self.num_pending += token == PENDING

    def set_output(self, index: int, token: int) -> None:
        """Output number `index`, the first still `PENDING`, is `token`."""
        self.output_ids[index] = token
        self.all_token_ids[len(self.prompt_ids) + index] = token
        self.num_pending -= 1

    def truncate_outputs(self, count: int) -> None:
        """Keep only the first `count` outputs (what later steps computed past them is dropped)."""
        self.num_pending -= min(self.num_pending, max(0, len(self.output_ids) - count))
        del self.output_ids[count:]
        del self.all_token_ids[len(self.prompt_ids) + count :]

    def drop_pending(self) -> None:
        """Forget the outputs still `PENDING`."""
        self.truncate_outputs(len(self.output_ids) - self.num_pending)

    @property
    def num_outputs(self) -> int:
        """Output tokens the host has read."""
        return len(self.output_ids) - self.num_pending

    @property
    def done_sampling(self) -> bool:
        """All `max_tokens` outputs are sampled (some maybe not read yet), or an embedding request's
        prompt is computed: nothing more to run."""
        if self.embeds:
            return self.num_computed >= len(self.prompt_ids)
        return len(self.output_ids) >= self.params.max_tokens

    def pending(self, count: int) -> list[int]:
        """The next `count` tokens to run through the model."""
        return self.all_token_ids[self.num_computed : self.num_computed + count]

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_remaining(self) -> int:
        """Tokens still to run through the model before the next sample."""
        return len(self.all_token_ids) - self.num_computed

    @property
    def is_decode(self) -> bool:
        return self.num_remaining == 1 and bool(self.output_ids)

    @property
    def prompt_tps(self) -> float:
        """Prompt tokens per second until the first token (or until now, before it)."""
        first = self.first_token_time or time.perf_counter()
        return len(self.prompt_ids) / max(first - self.arrival_time, 1e-9)

    @property
    def generation_tps(self) -> float:
        """Generated tokens per second after the first token (until the last, or now)."""
        first, end = self.first_token_time, self.finish_time or time.perf_counter()
        return len(self.output_ids) / max(end - first, 1e-9) if first is not None else 0.0

    @property
    def max_length(self) -> int:
        """Most tokens this request will ever have: its prompt and all `max_tokens` of output."""
        return len(self.prompt_ids) + (0 if self.embeds else self.params.max_tokens)
