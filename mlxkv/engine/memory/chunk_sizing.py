"""How many tokens of a prompt a step computes: as many as its token budget allows, cut so that the
step's temporaries fit the memory reserve and, while other requests are decoding, so that the step
ends within the inter-token latency target (Sarathi-Serve's stall-free batching).

The target is relative by default: a step with prefill takes at most `max_itl_factor` times the
same step's decodes alone, so it scales with the machine and the model, and prefill always gets
that share of a step, even where an absolute `max_itl_s` could not be met by decoding alone.
A chunk of c tokens after n computed ones attends about c * (n + c) token pairs and holds its
attention temporaries as the path states them, so long contexts get shorter chunks. The time cut
never takes a step's first chunk below `LEAST_CHUNK` tokens: prefill always progresses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from .step_memory import StepMemory
from .step_time import StepTime

LEAST_CHUNK = 16  # tokens of prefill a step takes at the least, whatever the latency target


@dataclass
class StepShape:
    """What a step being built holds so far: new tokens, sampled rows, attended token pairs,
    temporary bytes, decode rows and prefill chunks."""

    tokens: int = 0
    samples: int = 0
    attended: int = 0
    memory: int = 0
    decodes: int = 0
    chunks: int = 0
    decode_tokens: int = 0  # the decode rows' part of `tokens` and `attended`: the step without prefill
    decode_attended: int = 0
    joining: int = 0  # requests in prefill, or waiting with room to be admitted: they will decode beside these

    def add(self, queries: int, context: int, samples: int, decode: bool, memory: StepMemory | None) -> None:
        self.tokens += queries
        self.samples += samples
        self.attended += queries * context
        if memory is not None:
            self.memory += memory.bytes(queries, samples, [(queries, context)])
        self.decodes += decode
        self.chunks += not decode
        if decode:
            self.decode_tokens += queries
            self.decode_attended += queries * context

    def copy(self) -> StepShape:
        return replace(self)


@dataclass(frozen=True)
class ChunkSizer:
    """Cuts prefill chunks to the step `reserve` (bytes, by `memory`) and to `max_itl_s` seconds
    (by the fitted `step_time`); either may be absent."""

    memory: StepMemory | None = None
    reserve: int | None = None
    step_time: StepTime | None = None
    max_itl_s: float | None = None
    max_itl_factor: float | None = None

    def chunk(self, shape: StepShape, wanted: int, computed: int) -> int:
        """The most of `wanted` next tokens of a prompt (`computed` of it already done) that a step
        already holding `shape` can take; 0 if none fits."""
        fits = self._fits_memory(shape, computed)
        most = _largest(wanted, fits)
        target = self.target(shape)
        if target is None:
            return most
        timed = _largest(most, self._fits_time(shape, computed, target))
        least = min(most, LEAST_CHUNK) if not shape.chunks else 0
        return max(timed, least)

    @property
    def has_target(self) -> bool:
        """Whether steps that decode are cut to a latency target."""
        return self.step_time is not None and bool(self.max_itl_s or self.max_itl_factor)

    def target(self, shape: StepShape) -> float | None:
        """The seconds a step holding `shape` may take, if it decodes and a target applies: the
        absolute one, or `max_itl_factor` times its decode step alone, whichever is longer. The decode
        step counts a row for each request `joining` too, so that a batch still filling (prompts
        arriving together) is held to the step it is filling to, not to its first rows' step."""
        if not self.has_target or not shape.decodes:
            return None
        assert self.step_time is not None
        bounds = [self.max_itl_s] if self.max_itl_s else []
        decodes = self.step_time.seconds(shape.decode_tokens + shape.joining, shape.decode_attended)
        if self.max_itl_factor and decodes is not None:
            bounds.append(self.max_itl_factor * decodes)
        return max(bounds, default=None)

    def cut(self) -> ChunkSizer:
        """This sizer with half the reserve: after a step ran out of memory."""
        return self if self.reserve is None else replace(self, reserve=self.reserve // 2)

    def _fits_memory(self, shape: StepShape, computed: int) -> Callable[[int], bool]:
        memory, reserve = self.memory, self.reserve
        if memory is None or reserve is None:
            return lambda count: True
        return lambda count: shape.memory + memory.row(count, computed + count) <= reserve

    def _fits_time(self, shape: StepShape, computed: int, target: float) -> Callable[[int], bool]:
        assert self.step_time is not None
        step_time = self.step_time

        def fits(count: int) -> bool:
            seconds = step_time.seconds(shape.tokens + count, shape.attended + count * (computed + count))
            return seconds is None or seconds <= target

        return fits


def _largest(most: int, fits: Callable[[int], bool]) -> int:
    """The largest count in [0, most] that `fits` (which holds up to some count and not beyond)."""
    if most <= 0 or fits(most):
        return max(most, 0)
    low, high = 0, most  # fits(low) is taken to hold; fits(high) does not
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low
