"""One request's constraint as its output advances: llguidance's matcher over the whole output, or,
for a lazy constraint, over each stretch the output opens with the trigger token.

A lazy constraint lets the model write freely until it samples the trigger (a tool call's opening
marker, say); from there its grammar masks every token until it completes (the call's closing
marker), and the output is free again until the next trigger. While free, a row gets no mask at
all. The trigger is never a draft token, and an open stretch drafts nothing, so a mask never has to
guess whether a draft opens or closes one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class Constraint:
    """A request's matcher (llguidance's `LLMatcher`), copied from `compiled`; with a `trigger`
    token, applied only from each time the output samples it until its grammar completes."""

    def __init__(self, compiled: Any, trigger: int | None = None) -> None:
        self._compiled, self.trigger = compiled, trigger
        self.matcher: Any = compiled.deep_copy()
        self.active = trigger is None  # whether the next token is masked

    def consume(self, token: int) -> bool:
        """Follow the output's next `token`; False if the grammar refuses it (its mask allowed it: a bug)."""
        if not self.active:
            if token != self.trigger:
                return True
            self.active = True
        if not self.matcher.consume_token(token):
            return False
        if self.trigger is not None and self.matcher.is_accepting():  # the stretch is complete: free again
            self.matcher, self.active = self._compiled.deep_copy(), False
        return True

    def is_stopped(self) -> bool:
        """Whether the constraint allows nothing more (the output must end)."""
        return self.active and bool(self.matcher.is_stopped())

    def error(self) -> str:
        return str(self.matcher.get_error())

    def draftable(self, draft: Sequence[int]) -> int:
        """How many of `draft`'s tokens the constraint lets the next step verify."""
        if self.trigger is None:
            return int(self.matcher.validate_tokens(list(draft)))
        if self.active:
            return 0
        return draft.index(self.trigger) if self.trigger in draft else len(draft)
