"""Prompt lookup: draft tokens found in the request itself, with no second model.

A request's last few tokens (an n-gram) often occurred before in its prompt or output, and what
followed them then is a good guess at what follows now: a code edit rewrites most of the code it
was given, a summary quotes its source, an agent repeats its tool calls' arguments. Each request
keeps an index of where every n-gram of its tokens last ended, grown by the tokens added since the
last step, so a proposal costs a few dictionary lookups whatever the request's length.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..request import Request

NGRAMS = (4, 3, 2)  # n-gram sizes looked up, longest first: a longer match is the likelier to go on


class NgramIndex:
    """Where each n-gram of a growing token list last ended (the position of the token after it)."""

    def __init__(self, sizes: Sequence[int] = NGRAMS) -> None:
        self.sizes = tuple(sizes)
        self.last: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending at positions 1 .. indexed are in `last`

    def propose(self, tokens: Sequence[int], most: int) -> list[int]:
        """Up to `most` tokens that followed the latest earlier occurrence of `tokens`' longest
        matching suffix n-gram (none if no suffix occurred before)."""
        for end in range(self.indexed + 1, len(tokens)):  # every n-gram before the suffix itself
            for n in self.sizes:
                if end >= n:
                    self.last[tuple(tokens[end - n : end])] = end
        self.indexed = max(self.indexed, len(tokens) - 1)
        for n in self.sizes:
            found = self.last.get(tuple(tokens[-n:])) if len(tokens) >= n else None
            if found is not None:
                return list(tokens[found : found + most])
        return []


class PromptLookup:
    """The prompt-lookup drafter: an `NgramIndex` per request, dropped when it finishes."""

    def __init__(self) -> None:
        self._indexes: dict[Request, NgramIndex] = {}

    def propose(self, requests: Sequence[Request], lengths: Sequence[int]) -> list[list[int]]:
        return [
            self._indexes.setdefault(request, NgramIndex()).propose(request.all_token_ids, most)
            for request, most in zip(requests, lengths)
        ]

    def forget(self, request: Request) -> None:
        self._indexes.pop(request, None)

    def reset(self) -> None:
        self._indexes.clear()
