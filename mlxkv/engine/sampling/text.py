"""Incremental text of one request: streaming detokenization and stop strings."""

from __future__ import annotations

from mlx_lm.tokenizer_utils import StreamingDetokenizer


class TextStream:
    """Turns tokens into text as they come, ending before the first stop string.

    A tail of the text that could still grow into a stop string is held back from
    `take_delta` until later tokens settle it, so a stop string is never streamed.
    """

    __slots__ = ("_detokenizer", "_stop", "_longest", "text", "_sent", "stopped", "stop_string", "finished")

    def __init__(self, detokenizer: StreamingDetokenizer, stop: tuple[str, ...]) -> None:
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
