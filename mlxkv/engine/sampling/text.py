"""Incremental text of one request: streaming detokenization and stop strings."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mlx_lm.tokenizer_utils import StreamingDetokenizer

CONTEXT = 8  # prompt (then output) tokens a continuation is decoded after
SETTLE = 32  # tokens decoded together at most before their text is settled


class ContinuingDetokenizer:
    """Text that continues the prompt exactly: what `decode(prompt + outputs)` adds past
    `decode(prompt)`, a first token's leading space included. mlx-lm's streaming detokenizers drop
    it (a reply after a chat template starts without one), which joins a completion to its prompt
    ("is" + "still"). Tokens are decoded after the last `CONTEXT` tokens before them (more where
    those would start inside a character), a line (or `SETTLE` tokens) at a time."""

    def __init__(self, decode: Callable[[list[int]], str], prompt: Sequence[int]) -> None:
        self._decode = decode
        self._history = list(prompt)  # the prompt and the settled tokens
        self._tokens: list[int] = []  # since the text was last settled
        self._settled = ""
        self._current = ""
        self._context, self._head = self._after()

    @property
    def text(self) -> str:
        return self._settled + self._current

    def add_token(self, token: int) -> None:
        self._tokens.append(token)
        text = self._continued()
        self._current = text.rstrip("\ufffd")  # the rest of a character is still to come
        if text == self._current and (text.endswith("\n") or len(self._tokens) >= SETTLE):
            self._settle()

    def finalize(self) -> None:
        self._current = self._continued()
        self._settle()

    def _continued(self) -> str:
        """The text the unsettled tokens add after the context."""
        return self._decode(self._context + self._tokens)[len(self._head) :]

    def _settle(self) -> None:
        self._settled += self._current
        self._history += self._tokens
        self._tokens, self._current = [], ""
        self._context, self._head = self._after()

    def _after(self) -> tuple[list[int], str]:
        """The tokens the next ones are decoded after, and their text: the last `CONTEXT`, or up to
        `CONTEXT` more where the text of those would start inside a character."""
        start = max(0, len(self._history) - CONTEXT)
        head = self._decode(self._history[start:])
        while start > 0 and head.startswith("\ufffd") and len(self._history) - start < 2 * CONTEXT:
            start -= 1
            head = self._decode(self._history[start:])
        return self._history[start:], head


class TextStream:
    """Turns tokens into text as they come, ending before the first stop string.

    A tail of the text that could still grow into a stop string is held back from
    `take_delta` until later tokens settle it, so a stop string is never streamed.
    """

    __slots__ = ("_detokenizer", "_stop", "_longest", "text", "_sent", "stopped", "stop_string", "finished")

    def __init__(self, detokenizer: StreamingDetokenizer | ContinuingDetokenizer, stop: tuple[str, ...]) -> None:
        self._detokenizer = detokenizer
        self._stop = stop
        self._longest = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self._sent = 0
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that ended the text
        self.finished = False

    def add(self, token: int) -> bool:
        """Add one token; True when a stop string has appeared (the text then ends before it)."""
        self._detokenizer.add_token(token)
        self._update(self._detokenizer.text)
        return self.stopped

    def finish(self) -> None:
        """Flush the detokenizer at the end of generation."""
        if not self.stopped:
            self._detokenizer.finalize()
            self._update(self._detokenizer.text)
        self.finished = True

    def take_delta(self) -> str:
        """Text not yet handed out that no later token can retract."""
        end = len(self.text) if self.stopped or self.finished else max(self._sent, len(self.text) - self._undecided())
        delta, self._sent = self.text[self._sent : end], end
        return delta

    def _undecided(self) -> int:
        """Length of the longest tail of the text that is the start of a stop string."""
        for length in range(min(self._longest, len(self.text)), 0, -1):
            if any(s.startswith(self.text[-length:]) for s in self._stop):
                return length
        return 0

    def _update(self, text: str) -> None:
        if not self._stop:
            self.text = text
            return
        search_from = max(0, len(self.text) - self._longest)
        hits = sorted((i, s) for s in self._stop if (i := text.find(s, search_from)) >= 0)
        if hits:
            (at, self.stop_string), self.stopped = hits[0], True
            text = text[:at]
        self.text = text
