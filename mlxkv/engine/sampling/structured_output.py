"""Structured output: the token masks that hold a request's output to a JSON schema, a regex, a
choice of strings or a grammar, made by llguidance.

Each constrained request has a matcher that follows its output token by token. Before a step
samples, every constrained row's mask of allowed tokens is filled on the host (llguidance's
threads, one bit per token) and all of them are applied to the step's logits in one operation;
a step without constrained rows does nothing here. A matcher must have seen every earlier token
of its request before its next mask is made, so the engine reads a step holding constrained
rows before it samples the next (`LLMEngine._launch`). A speculating row gets a mask for each
of its draft tokens' positions too, each as the matcher would be after the drafts before it.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import llguidance
import llguidance.hf
import llguidance.numpy
import mlx.core as mx
import numpy as np
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .constraint import Constraint
from .params import SamplingParams

CACHE_SIZE = 64  # distinct constraints kept compiled
JSON_OPTIONS: Any = {"whitespace_flexible": False}  # compact JSON: "," and ":" with no spaces, as a model reads best


def grammar_of(params: SamplingParams) -> tuple[str, str] | None:
    """(the field that constrains `params`, llguidance's grammar for it), or None if none does."""
    if params.json_schema is not None:
        return "json_schema", llguidance.LLMatcher.grammar_from_json_schema(params.json_schema, defaults=JSON_OPTIONS)
    if params.regex is not None:
        return "regex", llguidance.LLMatcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        options = " | ".join(json.dumps(option, ensure_ascii=False) for option in params.choice)
        return "choice", llguidance.LLMatcher.grammar_from_lark(f"start: {options}")
    if params.grammar is not None:
        return "grammar", llguidance.LLMatcher.grammar_from_lark(params.grammar)
    return None


class StructuredOutput:
    """The engine's llguidance: its view of the tokenizer (made on first use: about a second for a
    large vocabulary), a matcher compiled once per distinct constraint (the `CACHE_SIZE` most
    recent kept; each request gets a copy), and the masks a step applies."""

    def __init__(self, tokenizer: TokenizerWrapper, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._lltokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._executor: llguidance.LLExecutor | None = None

    def compile(self, params: SamplingParams) -> llguidance.LLMatcher | None:
        """The compiled matcher of `params`' constraint, kept for the next request with it (None if
        it has none); a constraint llguidance cannot compile raises ValueError naming the field and
        llguidance's reason."""
        found = grammar_of(params)
        if found is None:
            return None
        name, grammar = found
        if params.grammar_trigger is not None:
            self.trigger_token(params.grammar_trigger)
        with self._lock:
            compiled = self._compiled.get(grammar)
            if compiled is None:
                compiled = self._compile(name, grammar)
            self._compiled[grammar] = compiled
            self._compiled.move_to_end(grammar)
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
            return compiled

    def constraint(self, params: SamplingParams) -> Constraint | None:
        """One request's constraint (see `compile`): a copy of the compiled matcher, lazy if
        `params` has a `grammar_trigger`."""
        compiled = self.compile(params)
        if compiled is None:
            return None
        trigger = params.grammar_trigger
        return Constraint(compiled, None if trigger is None else self.trigger_token(trigger))

    def trigger_token(self, trigger: str) -> int:
        """The token that spells `trigger`; ValueError unless it is exactly one."""
        ids = self._tokenizer.encode(trigger, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"grammar_trigger must be one token of the model's vocabulary; {trigger!r} is {len(ids)}")
        return int(ids[0])

    def _compile(self, name: str, grammar: str) -> llguidance.LLMatcher:
        if self._lltokenizer is None:
            eos = sorted(self._tokenizer.eos_token_ids)
            hf: Any = self._tokenizer._tokenizer  # mlx-lm's wrapper keeps the Hugging Face tokenizer here
            self._lltokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size, eos_token=eos)
        problem = llguidance.LLMatcher.validate_grammar(grammar, self._lltokenizer)
        if problem:
            raise ValueError(f"{name} cannot be used: {problem.strip()}")
        return llguidance.LLMatcher(self._lltokenizer, grammar, log_level=0)

    def masked(self, logits: mx.array, rows: Sequence[tuple[llguidance.LLMatcher, int, Sequence[int]]]) -> mx.array:
        """`logits` (`[rows, vocab]`) with every token a matcher does not allow set to -inf. Each of
        `rows` is (a matcher, its row, its draft tokens): the matcher's mask goes in its row, and
        with draft tokens, the mask after each of them in the rows after it. One fill of all the
        masks (in parallel) and one `where` (lazy)."""
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        widths = np.array([len(draft) + 1 for _, _, draft in rows])
        index = np.concatenate([np.arange(first, first + w) for (_, first, _), w in zip(rows, widths)]).astype(np.int32)
        bitmask = llguidance.numpy.allocate_token_bitmask(len(index), self.vocab_size)
        packed = np.cumsum(widths) - widths
        drafting = [(matcher, int(at), list(draft)) for (matcher, _, draft), at in zip(rows, packed) if draft]
        plain = [(matcher, int(at)) for (matcher, _, draft), at in zip(rows, packed) if not draft]
        if drafting:
            llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafting, bitmask)
        if plain:
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, plain, bitmask)
        # why: unpacked on the host, as gathering each token's word is slow in MLX on a CPU (docs/benchmarks.md)
        allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, count=self.vocab_size, bitorder="little")
        masked = mx.where(mx.array(allowed.view(np.bool_)), logits[mx.array(index)], -mx.inf)
        if len(index) == logits.shape[0]:
            return masked
        logits[mx.array(index)] = masked
        return logits
