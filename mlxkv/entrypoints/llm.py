"""The user-facing API: `LLM(model).generate(prompts, params)` and `LLM.stream(prompt, params)`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..cache.layout import KVLayout
from ..config import EngineConfig
from ..engine.llm_engine import LLMEngine
from ..engine.request import Request
from ..engine.sampling import SamplingParams
from ..models.loading import load

Prompt = str | Sequence[int]


@dataclass(frozen=True)
class Completion:
    """The result for one prompt. `finish_reason` is `stop` (EOS or a stop string) or `length`."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_token_ids: list[int]


class Stream:
    """Text deltas of one request as they are produced; `request` holds its tokens and timings.

    Stopping early (breaking out, `close()`) aborts the request and frees its pages.
    """

    def __init__(self, engine: LLMEngine, request: Request) -> None:
        self.engine = engine
        self.request = request
        self._deltas = self._run()

    def __iter__(self) -> Iterator[str]:
        return self._deltas

    def close(self) -> None:
        self._deltas.close()
        if self.request.finish_reason is None:
            self.engine.abort(self.request.request_id)

    def _run(self) -> Iterator[str]:
        try:
            while self.request.finish_reason is None:
                for output in self.engine.step():
                    if output.request_id == self.request.request_id and output.delta:
                        yield output.delta
        finally:
            if self.request.finish_reason is None:
                self.engine.abort(self.request.request_id)


class LLM:
    """A model with a paged KV cache and continuous batching.

    `model` is a local mlx-lm checkpoint directory, a Hugging Face repo id, a
    `(model, tokenizer)` pair already loaded, or None for the shipped demo model.
    """

    def __init__(
        self,
        model: str | Path | tuple[nn.Module, TokenizerWrapper] | None = None,
        kv_layout: str | KVLayout | None = None,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_memory: int | str | None = None,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 512,
        max_model_len: int | None = None,
        attention: str | None = None,
    ) -> None:
        config = EngineConfig(kv_layout, block_size, num_blocks, kv_cache_memory, max_num_seqs,
                              max_num_batched_tokens, max_model_len, attention)
        self.model, self.tokenizer = model if isinstance(model, tuple) else load(model)
        self.engine = LLMEngine(self.model, self.tokenizer, config)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[Completion]:
        """Complete every prompt, batched; results come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        requests = self._submit(prompts, params)
        try:
            while any(r.finish_reason is None for r in requests):
                self.engine.step()
        finally:
            self._abort_unfinished(requests)
        return [Completion(r.stream.text, list(r.output_ids), r.finish_reason, list(r.prompt_ids)) for r in requests]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Stream:
        """Iterate over the returned `Stream` for the text as it is produced."""
        (request,) = self._submit([prompt], [params or SamplingParams()])
        return Stream(self.engine, request)

    def _submit(self, prompts: Sequence[Prompt], params: Sequence[SamplingParams]) -> list[Request]:
        """Queue every prompt, or none: a bad one aborts those already queued."""
        requests: list[Request] = []
        try:
            for prompt, p in zip(prompts, params):
                if not isinstance(p, SamplingParams):
                    raise TypeError(f"params must be SamplingParams, got {type(p).__name__}")
                requests.append(self.engine.add_request(prompt, p))
        except Exception:
            self._abort_unfinished(requests)
            raise
        return requests

    def _abort_unfinished(self, requests: list[Request]) -> None:
        for request in requests:
            if request.finish_reason is None:
                self.engine.abort(request.request_id)
