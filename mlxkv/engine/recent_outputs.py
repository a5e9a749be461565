"""The token ids of text the engine produced lately, so that a prompt quoting that text is encoded
as it was generated and reuses the pages that hold it.

A chat's next turn sends the reply back as text, and encoding it again need not give the tokens
the model produced ("\\n" "\\n" comes back as "\\n\\n"; a first token's space, dropped from a
reply, is gone): the prompt then leaves the cached pages where the two first differ. Splicing
the produced ids in where the prompt holds the produced text keeps the prompt on those pages.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from .request import Request

MAX_ENTRIES = 256  # outputs remembered at most: a prompt is searched for each of them
CONTEXT = 4  # prompt tokens whose text must come before a quote, as it came before the output
ANCHOR = 32  # characters of an output searched for: a prompt may quote only its start

Piece = str | list[int]  # text still to encode, or produced token ids standing for their text


@dataclass
class Output:
    """An output's token ids, whether its text is all theirs (not cut by a stop string or abort),
    and the last prompt tokens before it."""

    ids: list[int]
    whole: bool
    after: list[int]
    before: str | None = None  # the text of `after`, decoded the first time a prompt is searched for it


@dataclass(frozen=True)
class Quote:
    """Where a prompt quotes an output: characters `start` to `end`, produced as `ids`."""

    start: int
    end: int
    ids: list[int]


class RecentOutputs:
    """Texts the engine produced, as their clients were given them, with the token ids that produced
    them, per cache salt; the least recently produced or quoted go first, beyond `MAX_ENTRIES`
    texts or `capacity` tokens (the pool's: older outputs' pages are gone by then). Remembering is
    O(1) on the engine thread; the serving threads that encode prompts do the searching (and the
    decoding that a quote of part of an output needs)."""

    def __init__(self, capacity: int, decode: Callable[[list[int]], str], bos: int | None = None) -> None:
        self.capacity = capacity
        self._decode = decode
        self._bos = bos
        self._outputs: OrderedDict[tuple[str | None, str], Output] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

    def remember(self, request: Request, whole: bool) -> None:
        """Keep the text of a request that ended with the output ids that produced it (handed over,
        not copied): a thinking model's reasoning and answer as it wrote them; `whole`: the text is
        all of theirs, else a start of it."""
        assert request.stream is not None  # every request the engine admits has its stream
        text, ids, reasoning = request.stream.text, request.output_ids, request.reasoning
        if reasoning is not None and (reasoning.tokens or reasoning.opened):  # it thought, or wrote a header
            text = reasoning.written(text)
        if not text or len(ids) > self.capacity:
            return
        key = (request.cache_salt, text)
        after = [t for t in request.prompt_ids[-CONTEXT:] if t != self._bos]
        with self._lock:
            if key in self._outputs:
                self._tokens -= len(self._outputs.pop(key).ids)
            self._outputs[key] = Output(ids, whole, after)
            self._tokens += len(ids)
            while len(self._outputs) > MAX_ENTRIES or self._tokens > self.capacity:
                self._tokens -= len(self._outputs.popitem(last=False)[1].ids)

    def split(self, salt: str | None, text: str) -> list[Piece]:
        """`text` in pieces: what quotes remembered outputs (of `salt`) as their ids, the rest as text.
        Where two quotes overlap, the longer wins."""
        with self._lock:
            known = [key for key in self._outputs if key[0] == salt]
        quotes = sorted((q for key in known for q in self._quotes(text, key)), key=lambda q: q.start - q.end)
        chosen: list[Quote] = []
        for quote in quotes:
            if all(quote.end <= other.start or quote.start >= other.end for other in chosen):
                chosen.append(quote)
        pieces: list[Piece] = []
        at = 0
        for quote in sorted(chosen, key=lambda q: q.start):
            pieces += [text[at : quote.start], quote.ids] if quote.start > at else [quote.ids]
            at = quote.end
        return pieces + [text[at:]] if at < len(text) else pieces

    def _quotes(self, text: str, key: tuple[str | None, str]) -> list[Quote]:
        """Where `text` quotes the output under `key` (whole, or from its start as far as some of its
        ids go) right after the text its prompt ended with (a quote anywhere else could not reuse
        its pages, and a short output would match everywhere); a quoted output becomes the most
        recent."""
        with self._lock:
            output = self._outputs.get(key)
        if output is None:  # forgotten meanwhile
            return []
        quoted, found = key[1], []
        if output.before is None:  # decoded once, not for every prompt searched
            output.before = self._decode(output.after).lstrip("\ufffd")  # from a character's start
        before = output.before
        needle = before + quoted[:ANCHOR]
        at = text.find(needle)
        while at >= 0:
            start = at + len(before)
            same = _common_length(quoted, text, start)
            if same == len(quoted) and output.whole:
                found.append(Quote(start, start + same, output.ids))
            elif (part := self._start(quoted[:same], output.ids)) is not None:
                found.append(Quote(start, start + part[0], part[1]))
            at = text.find(needle, start + max(same, 1))
        if found:
            with self._lock:
                if key in self._outputs:
                    self._outputs.move_to_end(key)
        return found

    def _start(self, quoted: str, ids: list[int]) -> tuple[int, list[int]] | None:
        """The most of `ids` whose text (as decoded, or without its first space, as a reply is
        streamed) starts `quoted`: its length and those ids; None if none."""
        spaced = not quoted.startswith(" ")

        def shown(count: int) -> str:
            decoded = self._decode(ids[:count])
            return decoded[1:] if spaced and decoded.startswith(" ") else decoded

        low, high = 0, len(ids)
        while low < high:
            middle = (low + high + 1) // 2
            if quoted.startswith(shown(middle)):
                low = middle
            else:
                high = middle - 1
        return (len(shown(low)), ids[:low]) if low else None

    def __len__(self) -> int:
        return len(self._outputs)


def _common_length(quoted: str, text: str, at: int) -> int:
    """How many characters of `quoted` `text` holds from `at` on."""
    if text.startswith(quoted, at):
        return len(quoted)
    low, high = 0, min(len(quoted), len(text) - at)
    while low < high:  # the longest start of `quoted` found at `at`
        middle = (low + high + 1) // 2
        if text.startswith(quoted[:middle], at):
            low = middle
        else:
            high = middle - 1
    return low
