"""An encoder embedding model (BERT, XLM-RoBERTa/BGE-M3, ModernBERT) as mlx-embeddings loads and runs
it, pooled as its checkpoint's sentence-transformers files say: mlxkv writes no encoder model code."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from .pooling import Pooling, pooling_of

ENCODERS = ("bert", "xlm-roberta", "xlm_roberta", "modernbert")  # the config model_types run here
BATCH_TOKENS = 512  # padded tokens an encoder batch holds at most: as many as an engine step, so a chat
# model's steps beside it wait for one short batch, not a long one (docs/benchmarks.md#embeddings)


def is_encoder(model_type: str | None) -> bool:
    """Whether a checkpoint's `model_type` is an encoder's (run by `Encoder`, not the engine)."""
    return model_type in ENCODERS


@dataclass
class Encoder:
    """An encoder model, its tokenizer (a transformers one) and its `pooling`; `max_length` tokens an input may have."""

    model: nn.Module
    tokenizer: Any
    pooling: Pooling
    max_length: int

    @classmethod
    def load(cls, folder: Path) -> Encoder:
        """The encoder checkpoint in `folder`; ValueError naming the file for one without a pooling,
        ImportError naming the extra when mlx-embeddings is not installed."""
        if importlib.util.find_spec("mlx_embeddings") is None:
            raise ImportError("encoder embedding models need mlx-embeddings: pip install 'mlxkv[embeddings]'")
        from mlx_embeddings import load as load_encoder

        pooling = pooling_of(folder)
        if pooling is None:
            raise ValueError(
                f"{str(folder / 'modules.json')!r} is missing: an encoder's pooling comes from its "
                "sentence-transformers files, never guessed"
            )
        model, wrapper = load_encoder(str(folder))
        tokenizer = getattr(wrapper, "_tokenizer", wrapper)
        positions = int(getattr(model.config, "max_position_embeddings", 512))
        most = min(positions, int(getattr(tokenizer, "model_max_length", positions)))
        return cls(model, tokenizer, pooling, most)

    def tokenize(self, text: str) -> list[int]:
        """`text`'s ids as sentence-transformers makes them: with the tokenizer's special tokens."""
        ids: list[int] = self.tokenizer(text)["input_ids"]
        return ids

    def embed(self, inputs: list[list[int]]) -> list[list[float]]:
        """A vector per input (token ids), computed in padded batches of similar lengths."""
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
        vectors: list[list[float]] = [[] for _ in inputs]
        start = 0
        while start < len(order):
            end = start + 1
            while end < len(order) and (end + 1 - start) * len(inputs[order[end]]) <= BATCH_TOKENS:
                end += 1
            batch = [inputs[i] for i in order[start:end]]
            for index, vector in zip(order[start:end], self._batch(batch)):
                vectors[index] = vector
            start = end
        return vectors

    def _batch(self, inputs: list[list[int]]) -> list[list[float]]:
        lengths = np.array([len(ids) for ids in inputs], np.int32)
        ids = np.full((len(inputs), lengths.max()), self.pad_id, np.int32)
        for row, tokens in enumerate(inputs):
            ids[row, : len(tokens)] = tokens
        mask = (np.arange(ids.shape[1])[None] < lengths[:, None]).astype(np.float32)
        hidden = self.model(mx.array(ids), attention_mask=mx.array(mask)).last_hidden_state
        vectors = self.pooling(hidden, mx.array(lengths))
        mx.eval(vectors)
        return cast("list[list[float]]", vectors.tolist())

    @property
    def pad_id(self) -> int:
        return int(self.tokenizer.pad_token_id or 0)

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def weight_bytes(self) -> int:
        leaves = cast("list[tuple[str, mx.array]]", tree_flatten(self.model.parameters()))
        return sum(value.nbytes for _, value in leaves)
