"""OpenAI's `/v1/embeddings`: `input` as a text, a list of texts, token ids or lists of them;
`encoding_format` float or base64 (little-endian float32, as the `openai` client decodes it);
`dimensions` for a model whose checkpoint says its vectors may be cut (Matryoshka)."""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal, cast

import numpy as np
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from ..embedder import Embedded, Embedder


def _checked(value: Any) -> Any:
    """`input` as it is, if it has one of its shapes; else a ValueError naming them."""
    if isinstance(value, str) or _all(value, str) or _all(value, int):
        return value
    if isinstance(value, list) and all(_all(one, int) for one in value):
        return value
    raise ValueError("input must be a text, a list of texts, a list of token ids, or a list of such lists")


def _all(value: Any, kind: type) -> bool:
    return isinstance(value, list) and all(isinstance(v, kind) and not isinstance(v, bool) for v in value)


class EmbeddingsBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: Annotated[str | list[str] | list[int] | list[list[int]], BeforeValidator(_checked)]
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
