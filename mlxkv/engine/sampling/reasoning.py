"""A reply's reasoning apart from its answer: a thinking model's tokens between its think markers
(Qwen3's `<think>` and `</think>`, as mlx-lm finds them in the vocabulary; gpt-oss's harmony
channels, `<|channel|>analysis<|message|>` up to the final channel's header) are its reasoning, the
rest its answer, the markers neither. Thinking starts only where the reply starts (or the prompt
opened it) and never again once it has ended. With a budget, the reply's thinking is closed when
its reasoning (markers included) would outgrow it: the end marker is forced, token by token, as a
constraint forces a grammar's tokens, and the answer follows."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from mlx_lm.tokenizer_utils import StreamingDetokenizer, TokenizerWrapper

from .text import TextStream

if TYPE_CHECKING:
    from ..request import Request

CLOSED_TAIL = 4  # tokens after a prompt's last end marker that still leave its reply all answer
# OpenAI's harmony format (gpt-oss): a reply's analysis channel is its reasoning, its final channel
# its answer. The end marker closes the analysis and opens the final channel, so that a budget
# that forces it is followed by an answer; a reply that writes no analysis opens with the header.
HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>")
HARMONY_START = "<|channel|>analysis<|message|>"
HARMONY_ANSWER = "<|channel|>final<|message|>"
HARMONY_END = "<|end|><|start|>assistant" + HARMONY_ANSWER


@dataclass(frozen=True)
class ThinkMarkers:
    """The token ids that open and close a model's thinking, and their text; where the model has
    them, the header it opens an answer without reasoning with (`answer`, dropped like a marker)
    and what ends a thinking block in a prompt where that is less than the end marker (`close`)."""

    start: tuple[int, ...]
    end: tuple[int, ...]
    start_text: str = ""
    end_text: str = ""
    answer: tuple[int, ...] = ()
    answer_text: str = ""
    close: tuple[int, ...] = ()

    @staticmethod
    def of(tokenizer: TokenizerWrapper) -> ThinkMarkers | None:
        """The tokenizer's markers, where mlx-lm finds some in the vocabulary (or the vocabulary
        has harmony's) and the chat template thinks too (names the start marker or
        `enable_thinking`): a vocabulary may hold the markers for a model that never thinks, and
        its replies are all answer."""
        template = getattr(tokenizer, "chat_template", None)
        text = " ".join(template.values()) if isinstance(template, dict) else template or ""
        if not tokenizer.has_thinking:
            return _harmony(tokenizer) if "<|channel|>" in text else None
        if tokenizer.think_start not in text and "enable_thinking" not in text:
            return None
        start, end = tuple(tokenizer.think_start_tokens), tuple(tokenizer.think_end_tokens)
        return ThinkMarkers(start, end, tokenizer.think_start, tokenizer.think_end)

    def open_in(self, prompt: Sequence[int]) -> bool:
        """Whether `prompt` leaves thinking open: its last start marker after its last end marker
        (a template that opens the reply's thinking itself)."""
        return _last(prompt, self.start) > _last(prompt, self.close or self.end)

    def closed_in(self, prompt: Sequence[int]) -> bool:
        """Whether `prompt` ends with a thinking block closed (Qwen3's template with thinking off
        writes an empty one): the reply is then all answer."""
        end = _last(prompt, self.end)
        return end >= 0 and end + len(self.end) >= len(prompt) - CLOSED_TAIL


def _harmony(tokenizer: TokenizerWrapper) -> ThinkMarkers | None:
    """Harmony's markers, where the vocabulary has its special tokens."""
    vocab = tokenizer.get_vocab()
    if not all(token in vocab for token in HARMONY_TOKENS):
        return None

    def ids(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special_tokens=False))

    return ThinkMarkers(
        ids(HARMONY_START),
        ids(HARMONY_END),
        HARMONY_START,
        HARMONY_END,
        ids(HARMONY_ANSWER),
        HARMONY_ANSWER,
        (vocab["<|end|>"],),
    )


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
        self.opened = ""  # the marker the reply opened with, as text (its start marker or answer header)
        self._held: list[int] = []

    def route(self, token: int) -> list[tuple[int, bool]]:
        """`token`, with those held before it, each with whether it is reasoning, as far as they are
        settled; marker tokens are dropped."""
        self._held.append(token)
        held = tuple(self._held)
        if self.thinking:
            self.tokens += 1  # the end marker's tokens count as reasoning
            if held == self.markers.end:
                self._held, self.thinking, self.ended = [], False, True
                self.stream.finish()  # all the reasoning's text goes out before the answer's
                return []
            kept = _restart(self.markers.end, held)  # the held tokens that may still begin the marker
            released, self._held = self._held[: len(held) - kept], self._held[len(held) - kept :]
            return [(t, True) for t in released]
        if self._opening:
            if held in (self.markers.start, self.markers.answer):
                self._held, self._opening, self.thinking = [], False, held == self.markers.start
                self.opened = self.markers.start_text if self.thinking else self.markers.answer_text
                self.tokens += len(held) if self.thinking else 0  # the start marker counts as reasoning
                return []
            if self.continuations():
                return []
        released, self._held, self._opening = self._held, [], False
        return [(t, self.thinking) for t in released]

    def continuations(self) -> tuple[int, ...]:
        """While the reply has not started and the tokens held begin a marker that opens it (the
        start marker, or harmony's answer header), the tokens that go on with one; else none."""
        if not self._opening or not self._held:
            return ()
        held = tuple(self._held)
        return tuple({m[len(held)] for m in (self.markers.start, self.markers.answer) if _begins(m, held)})

    def openers(self) -> tuple[int, ...]:
        """The tokens that may open the reply: the first of its start marker (and answer header)."""
        return tuple({m[0] for m in (self.markers.start, self.markers.answer) if m})

    @property
    def opening(self) -> bool:
        """Whether the reply has not started: its next token may open thinking."""
        return self._opening

    def free(self, pending: int = 0) -> int | None:
        """How many more tokens the reply may sample freely before its thinking must close (with
        `pending` tokens sampled but not yet routed); None while it is not thinking under a budget."""
        if self.budget is None or not self.thinking:
            return None
        # Tokens held as the end marker's start are counted as reasoning, not as the marker's: the
        # model may yet write something else after them, and the whole marker must still fit.
        return self.budget - self.tokens - pending - len(self.markers.end)

    def forced(self) -> int | None:
        """The token the reply must take next to close its thinking within its budget; None if free."""
        free = self.free()
        return None if free is None or free > 0 else self.markers.end[len(self._held)]

    def written(self, answer: str) -> str:
        """The reply's text as the model wrote it, markers and all, around `answer`: what a template
        that renders past reasoning as the model wrote it gives back."""
        return self.opened + self.stream.text + (self.markers.end_text if self.ended else "") + answer

    def flush(self) -> list[tuple[int, bool]]:
        """The tokens still held, at the end of the reply."""
        released, self._held = self._held, []
        return [(t, self.thinking) for t in released]


def reasoning_for(markers: ThinkMarkers, request: Request, detokenizer: StreamingDetokenizer) -> Reasoning:
    """The `Reasoning` of `request`'s reply (of at most its `thinking_token_budget` tokens): inside
    the thinking where its prompt opened it, all answer where the prompt closed it."""
    prompt, budget = request.prompt_ids, request.params.thinking_token_budget
    return Reasoning(markers, markers.open_in(prompt), detokenizer, budget, not markers.closed_in(prompt))


def _begins(marker: tuple[int, ...], held: tuple[int, ...]) -> bool:
    """Whether `held` is a proper start of `marker`."""
    return len(held) < len(marker) and marker[: len(held)] == held


def _restart(marker: tuple[int, ...], held: tuple[int, ...]) -> int:
    """How many of `held`'s last tokens are a proper start of `marker` (`held` itself, if it is one)."""
    return next((n for n in range(len(held), 0, -1) if _begins(marker, held[-n:])), 0)


def _last(tokens: Sequence[int], marker: tuple[int, ...]) -> int:
    """Where `marker` last starts in `tokens`; -1 if nowhere (one vectorised pass over a long prompt)."""
    ids = np.asarray(tokens)
    for at in np.flatnonzero(ids == marker[0])[::-1]:
        if tuple(ids[at : at + len(marker)].tolist()) == marker:
            return int(at)
    return -1
