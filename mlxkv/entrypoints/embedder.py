"""The embedding path every HTTP API shares: an embedding model's inputs (texts or token ids)
tokenized off the event loop, checked or truncated to what the model takes, embedded (a decoder
model's as engine requests batched with the rest, an encoder's in the batches of its own thread),
and cut to the `dimensions` asked for. Each API (`openai/`, `ollama/`) frames the vectors in its shape."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ..engine.async_llm import AsyncLLM
from ..errors import counted
from ..models.pooling import Pooling
from .errors import ServingError, refused_as
from .replies import failure

Input = str | Sequence[int]
MAX_INPUTS = 2048  # inputs one request may carry (OpenAI's limit)


@dataclass(frozen=True)
class Embedded:
    """The vectors of a request's inputs, in order, and the tokens they took."""

    vectors: list[list[float]]
    prompt_tokens: int


class EmbeddingModel(Protocol):
    """What the embedding path needs of a model: its pooling, the tokens an input may have, its
    vocabulary's size, its tokenizer, and the vectors of token ids."""

    @property
    def pooling(self) -> Pooling: ...

    @property
    def max_length(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def tokenize(self, text: str) -> list[int]: ...

    async def vectors(self, inputs: list[list[int]]) -> list[list[float]]: ...


class EngineEmbeddings:
    """A decoder embedding model's engine (`llm`, whose engine pools) as an `EmbeddingModel`: each
    input an embedding request, batched with the engine's other requests."""

    def __init__(self, llm: AsyncLLM) -> None:
        engine = llm.engine
        assert engine.pooling is not None
        self.llm, self.pooling = llm, engine.pooling
        self.max_length, self.vocab_size = engine.max_request_tokens, engine.vocab_size

    def tokenize(self, text: str) -> list[int]:
        return self.llm.engine.embedding_ids(text)

    async def vectors(self, inputs: list[list[int]]) -> list[list[float]]:
        outputs = await asyncio.gather(*(self.llm.embed(ids) for ids in inputs))
        return [output.embedding or [] for output in outputs]


class Embedder:
    """One embedding model behind every API (see the module)."""

    def __init__(self, model_id: str, model: EmbeddingModel) -> None:
        self.model_id, self.model = model_id, model

    async def embed(self, inputs: Sequence[Input], dimensions: int | None = None, truncate: bool = False) -> Embedded:
        """The vectors of `inputs`; an input longer than the model takes is cut to its first tokens
        if `truncate`, else refused. 400s name `input` or `dimensions`."""
        if not inputs:
            raise ServingError(400, "input must hold at least one text or list of token ids", "input")
        if len(inputs) > MAX_INPUTS:
            raise ServingError(
                400, f"input holds {len(inputs)} inputs; one request may have at most {MAX_INPUTS}", "input"
            )
        with refused_as("input"):
            ids = await asyncio.to_thread(self._tokenized, inputs, truncate)
        try:
            vectors = await self.model.vectors(ids)
        except Exception as exc:
            raise failure(exc) from None
        if dimensions is not None:
            with refused_as("dimensions"):
                vectors = self.model.pooling.cut(vectors, dimensions)
        return Embedded(vectors, sum(len(one) for one in ids))

    def _tokenized(self, inputs: Sequence[Input], truncate: bool) -> list[list[int]]:
        """Each input's token ids (text with the tokenizer's special tokens, as sentence-transformers
        tokenizes), cut to the model's most if `truncate`; ValueError naming the input at fault."""
        most, vocab = self.model.max_length, self.model.vocab_size
        tokenized = []
        for number, one in enumerate(inputs):
            ids = self.model.tokenize(one) if isinstance(one, str) else list(one)
            if not ids:
                raise ValueError(f"input {number} is empty")
            if any(not 0 <= token < vocab for token in ids):
                raise ValueError(f"input {number}: token ids must be in [0, {vocab})")
            if len(ids) > most and not truncate:
                raise ValueError(f"input {number} has {counted(len(ids), 'token')}; this model takes at most {most}")
            tokenized.append(ids[:most])
        return tokenized
