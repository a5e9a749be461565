"""Incremental text of one request: streaming detokenization and stop strings."""

from __future__ import annotations


class TextStream:
    """Turns tokens into text as they come, ending before the first stop string.

    Text that could still turn out to be the start of a stop string is held back from
    `take_delta` until the next token settles it, so a stop string is never streamed.
    """

    def __init__(self, detokenizer, stop: tuple[str, ...]) -> None:
        self._detokenizer = detokenizer
        self._stop = stop
        self._held = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self._sent = 0
        self.stopped = False

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
        self._held = 0

    def take_delta(self) -> str:
        """Text not yet handed out that no later token can retract."""
        end = len(self.text) if self.stopped else max(self._sent, len(self.text) - self._held)
        delta, self._sent = self.text[self._sent : end], end
        return delta

    def _update(self, text: str) -> None:
        search_from = max(0, len(self.text) - self._held)
        hits = [i for s in self._stop if (i := text.find(s, search_from)) >= 0]
        if hits:
            text, self.stopped = text[: min(hits)], True
        self.text = text
