"""A draft model: a smaller checkpoint with the target's tokenizer that drafts tokens for every
speculating request at once, its K/V in a paged cache of its own.

Each request keeps a sequence in the draft's cache holding the K/V of its tokens as far as the
draft has seen them. To propose, the draft first catches up on the tokens added since (prefill
chunks of at most a step's token budget, all requests packed), then runs as many batched decode
steps as the longest draft asks, each drawing with the request's own sampler and the key of the
output index it proposes, the key the target will draw that output with: where the two models
agree the draws agree, so drafts are accepted as often as the two distributions allow. One
evaluation ends the proposal. The K/V of drafts the target rejects are rewound at the next
proposal, and only tokens the target accepted are ever published to the draft's prefix cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ...attention.kernels import PagedAttentionKernels
from ...cache.layout import KVLayout
from ...cache.manager import KVCacheManager
from ...config import EngineConfig
from ...errors import KVCacheExhausted, ModelLoadError
from ...models.loading import load
from ...models.structure import text_model
from ..memory.kv_budget import build_kv_cache, size_kv_cache
from ..model_kv import ModelKV, attention_for, model_kv
from ..model_runner import ModelRunner
from ..request import Request, Status
from ..sampling.sampler import sample

COUNTED = 2**62  # room for the draft's pages, which the target's KV sizing has counted already


@dataclass
class _Held:
    """A request's sequence in the draft's cache, and the tokens whose K/V it holds."""

    seq_id: int
    tokens: list[int]


class DraftModel:
    """The draft-model drafter: `model` (a text model) over `cache`, drafting for requests whose
    outputs the target's vocabulary of `vocab_size` tokens holds."""

    def __init__(self, model: nn.Module, cache: KVCacheManager, runner: ModelRunner, vocab_size: int, budget: int):
        self.model = model
        self.cache = cache
        self.runner = runner
        self.vocab_size = vocab_size
        self.budget = budget
        self._held: dict[Request, _Held] = {}

    @staticmethod
    def checkpoint(config: EngineConfig, tokenizer: TokenizerWrapper) -> tuple[nn.Module, ModelKV]:
        """The text model `config.draft_model` names, loaded, and its K/V shape; refused, naming
        `draft_model`, if it cannot load, its tokenizer is not the target's (`tokenizer`), or it
        keeps recurrent state (which cannot rewind)."""
        assert config.draft_model is not None
        try:
            model, draft_tokenizer = load(config.draft_model)
        except ModelLoadError as exc:
            raise ValueError(f"draft_model={config.draft_model!r}: {exc}") from None
        if len(draft_tokenizer) != len(tokenizer):  # added tokens included: they are where vocabularies part
            raise ValueError(
                f"draft_model={config.draft_model!r} has a tokenizer of {len(draft_tokenizer)} tokens, "
                f"the model's has {len(tokenizer)}: a draft model must share the model's tokenizer"
            )
        model = text_model(model)
        shape = model_kv(model)
        if shape.state_shapes:
            raise ValueError(
                f"draft_model={config.draft_model!r} has recurrent layers, whose state cannot be rewound past "
                "rejected draft tokens; choose a draft model whose every layer keeps K/V"
            )
        return model, shape

    @classmethod
    def build(
        cls,
        config: EngineConfig,
        model: nn.Module,
        target: KVCacheManager,
        vocab_size: int,
        kernels: PagedAttentionKernels | None = None,
    ) -> DraftModel:
        """The drafter for a `checkpoint`'s `model`, with a cache of as many tokens as `target`'s
        (float pages, no pins), which the target's memory budget has counted."""
        shape = model_kv(model)
        own = replace(config, kv_bits=None, kv_cache_memory=None, pinned_fraction=0.0)
        own = replace(own, max_model_len=target.max_model_len)
        if target.layout is KVLayout.CONTIGUOUS:
            own = replace(own, max_num_seqs=target.pool.capacity)
        else:
            own = replace(own, num_pages=target.pool.capacity)
        cache = build_kv_cache(own, shape, size_kv_cache(own, shape, room=COUNTED))
        runner = ModelRunner(model, cache, attention_for(model, cache, config.attention, kernels))
        return cls(model, cache, runner, vocab_size, config.max_num_batched_tokens)

    def propose(self, requests: Sequence[Request], lengths: Sequence[int]) -> list[list[int]]:
        """Up to `lengths[i]` draft tokens for `requests[i]`; none for a request the draft's cache
        has no room for."""
        self._drop_stale()
        rows = [(request, held) for request in requests if (held := self._hold(request)) is not None]
        try:
            self._catch_up(rows)
            drafts = self._decode(rows, max(lengths, default=0))
        except KVCacheExhausted:
            return [[] for _ in requests]
        return [drafts.get(r, [])[:most] for r, most in zip(requests, lengths)]

    def forget(self, request: Request) -> None:
        held = self._held.pop(request, None)
        if held is not None:
            self.cache.release(held.seq_id)

    def reset(self) -> None:
        """Release every sequence and start the cache's tensors afresh (their last writes may have failed)."""
        for request in list(self._held):
            self.forget(request)
        self.cache.reset()

    def _drop_stale(self) -> None:
        """Release the sequences of requests no longer running (preempted, or failed): they catch up
        again if they come back."""
        for request in [r for r in self._held if r.status is not Status.RUNNING]:
            self.forget(request)

    def _hold(self, request: Request) -> _Held | None:
        """`request`'s sequence, rewound to the tokens it shares with the request (its rejected
        drafts go), or a new one started from the draft's prefix cache; None if no row is free."""
        tokens = request.all_token_ids
        held = self._held.get(request)
        if held is None:
            if self.cache.num_sequences >= self.cache.max_num_seqs:
                return None
            (seq_id,) = self.cache.claim(1)
            held = self._held[request] = _Held(seq_id, [])
            held.tokens = list(tokens[: self.cache.reuse_prefix(seq_id, tokens, request.cache_salt)])
            return held
        common = min(len(held.tokens), len(tokens))
        while common and held.tokens[common - 1] != tokens[common - 1]:  # only the last few drafts can differ
            common -= 1
        del held.tokens[common:]
        self.cache.rewind(held.seq_id, common)
        self.cache.publish([held.seq_id], [tokens], [common])  # evaluated by the last proposal
        return held

    def _catch_up(self, rows: list[tuple[Request, _Held]]) -> None:
        """Compute the K/V of every token but the last of each request that its sequence lacks, in
        packed chunks of at most the step's token budget (lazily)."""
        rest = [(h, r.all_token_ids[len(h.tokens) : -1]) for r, h in rows]
        while any(tokens for _, tokens in rest):
            room, chunks, ids = self.budget, [], []
            for index, (h, tokens) in enumerate(rest):
                taken = tokens[:room]
                if taken:
                    chunks.append((h, len(taken)))
                    ids += taken
                    rest[index] = (h, tokens[len(taken) :])
                    room -= len(taken)
            kv = self.cache.append([h.seq_id for h, _ in chunks], [n for _, n in chunks])
            self.runner.hidden(np.array(ids, np.int32), kv, [0] * len(chunks))
            for h, n in chunks:
                h.tokens += ids[:n]
                ids = ids[n:]

    def _decode(self, rows: list[tuple[Request, _Held]], steps: int) -> dict[Request, list[int]]:
        """`steps` draft tokens for each request, from its last token on: batched decode steps, each
        row drawing with its request's sampler and the key of the output it proposes."""
        requests = [r for r, _ in rows]
        inputs = mx.array([r.all_token_ids[-1] for r in requests], mx.int32)
        drawn: list[mx.array] = []
        seq_ids = [h.seq_id for _, h in rows]
        for step in range(steps):
            kv = self.cache.append(seq_ids, [1] * len(seq_ids))
            logits = self.runner.head(self.runner.hidden(inputs, kv, [0] * len(seq_ids)))[:, : self.vocab_size]
            inputs = sample(logits, [r.sampler for r in requests], [len(r.output_ids) + step for r in requests])
            drawn.append(inputs)
        if not drawn:
            return {}
        self.cache.evaluate(*drawn)
        drafts = np.stack([np.array(d) for d in drawn], axis=1).tolist()
        for (request, h), draft in zip(rows, drafts):  # K/V held: the last token, and every draft but the last
            h.tokens += [request.all_token_ids[-1], *draft[:-1]]
        return dict(zip(requests, drafts))
