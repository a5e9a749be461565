"""Text in llguidance's Lark grammars, spelled as the model's tokenizer spells it.

Real tokenizers add tokens beside their learned vocabulary: special ones (`<|im_end|>`, harmony's
`<|channel|>`) and others that are not special but still one token each (Qwen's `<tool_call>` and
`<think>`, Gemma 4's `<|"|>`). llguidance treats every added token as a token that text cannot
spell byte by byte, so a grammar that writes such a marker as a string can never be met: the
model's own token is refused and the bytes are never offered. `LarkText` writes those markers as
tokens (`<[id]>`, llguidance's token syntax) and everything else as strings.
"""

from __future__ import annotations

import json
import re
from typing import Any

from mlx_lm.tokenizer_utils import TokenizerWrapper


class LarkText:
    """Lark expressions for text as `tokenizer` spells it: its added tokens by id, the rest as strings."""

    def __init__(self, tokenizer: TokenizerWrapper) -> None:
        hf: Any = tokenizer._tokenizer  # mlx-lm's wrapper keeps the Hugging Face tokenizer here
        self.added: dict[str, int] = dict(hf.get_added_vocab())
        by_length = sorted(self.added, key=len, reverse=True)  # the longest marker wins, as when encoding
        self._split = re.compile("|".join(map(re.escape, by_length))) if by_length else None

    def __call__(self, text: str) -> str:
        """`text` as a sequence of Lark strings and tokens (`""` for no text)."""
        if self._split is None:
            return json.dumps(text, ensure_ascii=False)
        parts, at = [], 0
        for found in self._split.finditer(text):
            if found.start() > at:
                parts.append(json.dumps(text[at : found.start()], ensure_ascii=False))
            parts.append(f"<[{self.added[found.group()]}]>")
            at = found.end()
        if at < len(text) or not parts:
            parts.append(json.dumps(text[at:], ensure_ascii=False))
        return " ".join(parts)

    def starts_with_token(self, text: str) -> bool:
        """Whether `text` begins with an added token: nothing a regex matches can run into it."""
        return any(text.startswith(marker) for marker in self.added)

    def plain_prefix(self, text: str) -> str:
        """The part of `text` before its first added token (all of it if it holds none)."""
        found = self._split.search(text) if self._split is not None else None
        return text if found is None else text[: found.start()]
