"""OpenAI's `/v1/embeddings`: `input` as a text, a list of texts, token ids or lists of them;
`encoding_format` float or base64 (little-endian float32, as the `openai` client decodes it);
`dimensions` for a model whose checkpoint says its vectors may be cut (Matryoshka)."""

from __future__ import annotations

import base64
from typing import Any, Literal, cast

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from ..embedder import Embedded, Embedder


class EmbeddingsBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    ttl: float | None = None  # LM Studio's: seconds the model stays loaded idle after this request

    @property
    def inputs(self) -> list[str] | list[list[int]]:
        """The inputs as a list: one text or one list of token ids is a list of one."""
        given = self.input
        if isinstance(given, str):
            return [given]
        if given and all(isinstance(token, int) for token in given):
            return [[int(token) for token in given if isinstance(token, int)]]
        return cast("list[str] | list[list[int]]", given)  # a list of texts, or of token id lists


async def embeddings(embedder: Embedder, body: EmbeddingsBody) -> dict[str, Any]:
    """The reply to `body`, OpenAI's shape."""
    embedded = await embedder.embed(body.inputs, body.dimensions)
    return reply(embedder.model_id, embedded, body.encoding_format)


def reply(model: str, embedded: Embedded, encoding: str) -> dict[str, Any]:
    data = [
        {"object": "embedding", "index": index, "embedding": _encoded(vector, encoding)}
        for index, vector in enumerate(embedded.vectors)
    ]
    usage = {"prompt_tokens": embedded.prompt_tokens, "total_tokens": embedded.prompt_tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}


def _encoded(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "float":
        return vector
    return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode("ascii")
