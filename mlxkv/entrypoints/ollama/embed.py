"""Ollama's embeddings: `/api/embed` (`input` a text or a list of texts; `truncate`, true unless
said, cuts an input to what the model takes instead of refusing it; `dimensions`) and the older
`/api/embeddings` (one `prompt`, one `embedding`)."""

from __future__ import annotations

import time
from typing import Any

from ..embedder import Embedder
from .protocol import EmbedBody, EmbeddingsBody


async def embed(embedder: Embedder, body: EmbedBody) -> dict[str, Any]:
    """`/api/embed`'s reply: the vectors, and the durations and token count Ollama reports."""
    started = time.perf_counter_ns()
    inputs = [body.input] if isinstance(body.input, str) else body.input
    embedded = await embedder.embed(inputs, body.dimensions, body.truncate)
    return {
        "model": embedder.model_id,
        "embeddings": embedded.vectors,
        "total_duration": time.perf_counter_ns() - started,
        "load_duration": 0,
        "prompt_eval_count": embedded.prompt_tokens,
    }


async def embeddings(embedder: Embedder, body: EmbeddingsBody) -> dict[str, Any]:
    """`/api/embeddings`' reply: the prompt's vector."""
    embedded = await embedder.embed([body.prompt], truncate=True)
    return {"embedding": embedded.vectors[0]}
