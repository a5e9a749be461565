"""The user-facing API: `LLM(model).generate(prompts, params)` and `LLM.stream(prompt, params)`."""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..config import EngineConfig
from ..engine.images import ImagePrompt
from ..engine.llm_engine import LLMEngine
from ..engine.request import Request
from ..engine.sampling.params import SamplingParams
from ..engine.stats import EngineStats
from ..errors import RequestFailed, counted
from ..models.loading import DEMO_MODEL, load, resolve_model_path
from ..models.pooling import pooling_of
from ..models.sharding import world
from ..settings import keywords_of

Prompt = str | Sequence[int] | ImagePrompt


@dataclass(frozen=True)
class Completion:
    """The result for one prompt. `finish_reason` is `stop` (EOS or a stop string) or `length`;
    `num_cached_tokens` of the prompt's tokens came from the prefix cache instead of the model.
    A thinking model's reply (with `continuation=False`) has its `reasoning` apart from `text`."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_token_ids: list[int]
    num_cached_tokens: int
    reasoning: str = ""


class Stream:
    """Text deltas of one request as they are produced; `request` holds its tokens and timings.
    Iterating gives the text (a thinking model's answer); `pieces` gives its reasoning too.

    Iterating steps the shared engine when this request has no text waiting; text the step
    makes for other requests waits for their own consumers. Closing the stream, or dropping
    it before the request finishes, aborts the request and frees its pages.
    """

    def __init__(self, llm: LLM, request: Request) -> None:
        self.request = request
        self._llm = llm
        self._deltas = llm._deltas[request.request_id]
        self._closed = weakref.finalize(self, llm._forget, request)

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        while True:
            text, reasoning = self._next_piece()
            if not reasoning:
                return text

    def pieces(self) -> Iterator[tuple[str, bool]]:
        """Each new piece of text as it is produced, with whether it is a thinking model's reasoning."""
        while True:
            try:
                yield self._next_piece()
            except StopIteration:
                return

    def _next_piece(self) -> tuple[str, bool]:
        while not self._deltas:
            if self.request.finish_reason is not None:
                self.close()
                if self.request.error is not None:
                    raise RequestFailed(self.request.request_id, self.request.error) from self.request.error
                raise StopIteration
            self._llm._step()
        return self._deltas.popleft()

    def prefill(self) -> Iterator[int]:
        """Step the engine until this request's prompt is in the cache, yielding how many of its
        tokens are after each step: what a progress display of a long prompt counts."""
        prompt = len(self.request.prompt_ids)
        while not self._deltas and self.request.finish_reason is None and self.request.num_computed < prompt:
            self._llm._step()
            yield min(self.request.num_computed, prompt)

    def close(self) -> None:
        self._closed()


class LLM:
    """A model with a paged KV cache and continuous batching.

    `model` is a local mlx-lm checkpoint directory, a Hugging Face repo id, a
    `(model, tokenizer)` pair already loaded, or None for the shipped demo model. The engine's
    settings are `EngineConfig`'s fields as keywords (`LLM(kv_bits=8, max_num_seqs=32)`), or one
    `config`.

    Under `mlx.launch` the model loaded here is split across the processes (tensor parallel; a
    pair already loaded must have been loaded over `group`): on rank 0 this returns, and on every
    other rank it runs the steps rank 0 plans and then ends the process, so that only rank 0 runs
    the rest of the script.
    """

    @keywords_of(EngineConfig)
    def __init__(
        self,
        model: str | Path | tuple[nn.Module, TokenizerWrapper] | None = None,
        *,
        config: EngineConfig | None = None,
        group: mx.distributed.Group | None = None,
        **settings: Any,
    ) -> None:
        if config is not None and settings:
            raise TypeError(f"LLM takes either config or settings as keywords, not both (got {', '.join(settings)})")
        config = config or EngineConfig(**settings)
        if not isinstance(model, tuple):
            group = group or world()
        self.model, self.tokenizer = model if isinstance(model, tuple) else load(model, group)
        pooling = None if isinstance(model, tuple) else pooling_of(resolve_model_path(model or DEMO_MODEL))
        self.engine = LLMEngine(self.model, self.tokenizer, config, group=group, pooling=pooling)
        if self.engine.rank != 0:
            self.engine.follow()
            raise SystemExit(0)
        self._deltas: dict[str, deque[tuple[str, bool]]] = {}  # text waiting for each request's consumer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        cache_salt: str | None = None,
        continuation: bool = True,
    ) -> list[Completion]:
        """Complete every prompt, batched; results come back in prompt order. Prompts reuse
        cached prefix pages of earlier requests with the same `cache_salt`. Each text continues its
        prompt's exactly (`prompt + text` reads as the tokens decode); with `continuation=False`
        it starts a reply, as after a chat template (its first token's leading space dropped, as
        mlx-lm does).

        Raises `RequestFailed` if a prompt's request fails (the others are aborted)."""
        batch = _prompts(prompts)
        if isinstance(params, Sequence) and not isinstance(params, str):
            each = list(params)
        else:
            each = [params or SamplingParams()] * len(batch)
        if len(each) != len(batch):
            raise ValueError(f"got {counted(len(batch), 'prompt')} but {len(each)} SamplingParams")
        added = [
            partial(self.engine.add_request, p, sp, cache_salt=cache_salt, continuation=continuation)
            for p, sp in zip(batch, each)
        ]
        return [_completion(r) for r in self._run(added)]

    def embed(
        self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]], cache_salt: str | None = None
    ) -> list[list[float]]:
        """The vector of each prompt (text, or token ids), batched, in prompt order: for an embedding
        model, whose checkpoint says how it pools (see `LLMEngine.add_embedding`).

        Raises `RequestFailed` if a prompt's request fails (the others are aborted)."""
        batch = _prompts(prompts)
        texts = [p for p in batch if not isinstance(p, ImagePrompt)]
        if len(texts) != len(batch):
            raise TypeError("prompts: embed takes text or token ids, not images")
        added = [partial(self.engine.add_embedding, p, cache_salt=cache_salt) for p in texts]
        return [cast("list[float]", r.embedding) for r in self._run(added)]

    def _run(self, added: Sequence[Callable[[], Request]]) -> list[Request]:
        """Queue a request by each of `added` and step until all are finished."""
        requests = self._submit(added)
        try:
            while any(r.finish_reason is None for r in requests):
                self._step()
        finally:
            for request in requests:
                self._forget(request)
        for request in requests:
            if request.error is not None:
                raise RequestFailed(request.request_id, request.error) from request.error
        return requests

    def stats(self) -> EngineStats:
        """The engine's requests, KV cache and prefix cache, as a snapshot."""
        return self.engine.stats()

    @property
    def image_marker(self) -> str | None:
        """What an `ImagePrompt`'s text holds where each image goes (the marker the model's chat
        template writes for an image, such as Qwen's `<|image_pad|>`); None for a model that takes
        no images."""
        return self.engine.vision.image_token if self.engine.vision is not None else None

    def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        continuation: bool = True,
    ) -> Stream:
        """Iterate over the returned `Stream` for the text as it is produced (`continuation`: see
        `generate`)."""
        add = partial(
            self.engine.add_request,
            prompt,
            params or SamplingParams(),
            cache_salt=cache_salt,
            continuation=continuation,
        )
        (request,) = self._submit([add])
        return Stream(self, request)

    def _step(self) -> None:
        """One engine step; each request's new text goes to its own consumer."""
        for output in self.engine.step():
            deltas = self._deltas.get(output.request_id)
            if deltas is not None:
                new = ((output.reasoning, True), (output.delta, False))  # a step's reasoning comes first
                deltas.extend((text, reasoning) for text, reasoning in new if text)

    def _submit(self, added: Sequence[Callable[[], Request]]) -> list[Request]:
        """Queue a request by each of `added`, or none: a bad one aborts those already queued."""
        requests: list[Request] = []
        try:
            for add in added:
                requests.append(add())
                self._deltas[requests[-1].request_id] = deque()
        except Exception:
            for request in requests:
                self._forget(request)
            raise
        return requests

    def _forget(self, request: Request) -> None:
        """Stop delivering `request`'s text, and abort it if it is still running."""
        self._deltas.pop(request.request_id, None)
        if request.finish_reason is None:
            self.engine.abort(request.request_id, missing_ok=True)


def _completion(request: Request) -> Completion:
    """The result of a finished request."""
    assert request.stream is not None and request.finish_reason is not None
    return Completion(
        request.stream.text,
        list(request.output_ids),
        request.finish_reason,
        list(request.prompt_ids),
        request.num_cached_tokens or 0,
        request.reasoning.stream.text if request.reasoning is not None else "",
    )


def _prompts(prompts: object) -> list[Prompt]:
    """`prompts` as a list of prompts: one prompt (text, token ids, an `ImagePrompt`) or a list of them."""
    if _is_one_prompt(prompts):
        return [cast(Prompt, prompts)]
    if not isinstance(prompts, (list, tuple, np.ndarray)):
        raise TypeError(
            f"prompts must be text, token ids, an ImagePrompt, or a list of those, got {type(prompts).__name__}"
        )
    return list(prompts)


def _is_one_prompt(prompts: object) -> bool:
    """True for a single prompt (text, or token ids), False for a list of prompts."""
    if isinstance(prompts, (str, ImagePrompt)) or (isinstance(prompts, np.ndarray) and prompts.ndim == 1):
        return True
    return isinstance(prompts, (list, tuple)) and bool(prompts) and isinstance(prompts[0], (int, np.integer))
