"""A reply's reasoning apart from its answer: a thinking model's tokens between its think markers
(Qwen3's `<think>` and `</think>`, as mlx-lm finds them in the vocabulary) are its reasoning, the
rest its answer, the markers neither. Thinking starts only where the reply starts (or the prompt
opened it) and never again once it has ended. With a budget, the reply's thinking is closed when
its reasoning (markers included) would outgrow it: the end marker is forced, token by token, as a
constraint forces a grammar's tokens, and the answer follows."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from mlx_lm.tokenizer_utils import StreamingDetokenizer, TokenizerWrapper

from .text import TextStream

CLOSED_TAIL = 4  # tokens after a prompt's last end marker that still leave its reply all answer


@dataclass(frozen=True)
class ThinkMarkers:
    """The token ids that open and close a model's thinking, and their text."""

    start: tuple[int, ...]
    end: tuple[int, ...]
    start_text: str = ""
    end_text: str = ""

    @staticmethod
    def of(tokenizer: TokenizerWrapper) -> ThinkMarkers | None:
        """The tokenizer's markers, where mlx-lm finds some in the vocabulary and the chat template
        thinks too (names its start marker or `enable_thinking`): a vocabulary may hold the
        markers for a model that never thinks, and its replies are all answer."""
        if not tokenizer.has_thinking:
            return None
        template = getattr(tokenizer, "chat_template", None)
        text = " ".join(template.values()) if isinstance(template, dict) else template or ""
        if tokenizer.think_start not in text and "enable_thinking" not in text:
            return None
        start, end = tuple(tokenizer.think_start_tokens), tuple(tokenizer.think_end_tokens)
        return ThinkMarkers(start, end, tokenizer.think_start, tokenizer.think_end)

    def open_in(self, prompt: Sequence[int]) -> bool:
        """Whether `prompt` leaves thinking open: its last start marker after its last end marker
        (a template that opens the reply's thinking itself)."""
        return _last(prompt, self.start) > _last(prompt, self.end)

    def closed_in(self, prompt: Sequence[int]) -> bool:
        """Whether `prompt` ends with a thinking block closed (Qwen3's template with thinking off
        writes an empty one): the reply is then all answer."""
        end = _last(prompt, self.end)
        return end >= 0 and end + len(self.end) >= len(prompt) - CLOSED_TAIL


class Reasoning:
    """Routes a reply's tokens to its reasoning or its answer as they are accepted, holding back
    those that may be the start of a marker; keeps the reasoning's text."""

    def __init__(
        self,
        markers: ThinkMarkers,
        thinking: bool,
        detokenizer: StreamingDetokenizer,
        budget: int | None = None,
        opening: bool = True,
    ) -> None:
        self.markers = markers
        self.budget = budget  # most reasoning tokens, markers included
        self.thinking = thinking  # the tokens now are reasoning
        self.ended = False  # thinking has ended: it never starts again
        self.tokens = 0  # reasoning tokens so far, markers included
        self.stream = TextStream(detokenizer, ())
        self._opening = opening and not thinking  # the reply has not started: a start marker opens thinking
        self.opened = False  # the reply wrote the start marker itself
        self._held: list[int] = []

    def route(self, token: int) -> list[tuple[int, bool]]:
        """`token`, with those held before it, each with whether it is reasoning, as far as they are
        settled; marker tokens are dropped."""
        self._held.append(token)
        if self.thinking or self._opening:
            self.tokens += self.thinking  # the end marker's tokens count as reasoning
            marker = self.markers.end if self.thinking else self.markers.start
            if tuple(self._held) == marker:
                self.tokens += 0 if self.thinking else len(marker)  # and the start marker's
                self._held, self._opening = [], False
                self.opened = self.opened or not self.thinking
                self.thinking, self.ended = not self.thinking, self.thinking
                if self.ended:  # all the reasoning's text goes out before the answer's
                    self.stream.finish()
                return []
            if marker[: len(self._held)] == tuple(self._held):
                return []  # may still become the marker
        released, self._held, self._opening = self._held, [], False
        return [(t, self.thinking) for t in released]

    @property
    def opening(self) -> bool:
        """Whether the reply has not started: its next token may open thinking."""
        return self._opening

    def free(self, pending: int = 0) -> int | None:
        """How many more tokens the reply may sample freely before its thinking must close (with
        `pending` tokens sampled but not yet routed); None while it is not thinking under a budget."""
        if self.budget is None or not self.thinking:
            return None
        closing = len(self.markers.end) - len(self._held)  # the end marker's tokens still to come
        return self.budget - self.tokens - pending - closing

    def forced(self) -> int | None:
        """The token the reply must take next to close its thinking within its budget; None if free."""
        free = self.free()
        return None if free is None or free > 0 else self.markers.end[len(self._held)]

    def written(self, answer: str) -> str:
        """The reply's text as the model wrote it, markers and all, around `answer`: what a template
        that renders past reasoning as the model wrote it gives back."""
        start = self.markers.start_text if self.opened else ""
        return start + self.stream.text + (self.markers.end_text if self.ended else "") + answer

    def flush(self) -> list[tuple[int, bool]]:
        """The tokens still held, at the end of the reply."""
        released, self._held = self._held, []
        return [(t, self.thinking) for t in released]


def reasoning_for(
    tokenizer: TokenizerWrapper,
    prompt: Sequence[int],
    detokenizer: Callable[[], StreamingDetokenizer],
    budget: int | None = None,
) -> Reasoning | None:
    """A reply's `Reasoning` (of at most `budget` tokens), for a model that thinks; None for one
    that does not."""
    markers = ThinkMarkers.of(tokenizer)
    if markers is None:
        return None
    return Reasoning(markers, markers.open_in(prompt), detokenizer(), budget, not markers.closed_in(prompt))


def _last(tokens: Sequence[int], marker: tuple[int, ...]) -> int:
    """Where `marker` last starts in `tokens`; -1 if nowhere (one vectorised pass over a long prompt)."""
    ids = np.asarray(tokens)
    for at in np.flatnonzero(ids == marker[0])[::-1]:
        if tuple(ids[at : at + len(marker)].tolist()) == marker:
            return int(at)
    return -1
