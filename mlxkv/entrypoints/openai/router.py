"""OpenAI's routes: `/v1/models`, `/v1/chat/completions`, `/v1/completions`, `/v1/responses` (created,
fetched and deleted) and `/v1/embeddings`."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter
from fastapi import Request as HTTPRequest

from ..core import ServingCore
from ..hosting import ModelHost
from ..replies import until_done
from .embeddings import EmbeddingsBody, embeddings
from .protocol import ChatBody, CompletionBody, ModelCard, ModelList
from .responses import WAITING as RESPONSES_WAITING
from .responses import ResponsesServing, ResponseStore
from .responses_protocol import ResponsesBody
from .serving import WAITING, OpenAIServing


def router(host: ModelHost) -> APIRouter:
    """OpenAI's endpoints over the models of `host` (a request's `ttl`: LM Studio's, the seconds its
    model stays loaded idle after it)."""
    store = ResponseStore()  # every model's: a conversation may go on with another model
    created = int(time.time())
    api = APIRouter()

    def responses(core: ServingCore) -> ResponsesServing:
        return ResponsesServing(core, store)

    @api.get("/v1/models")
    async def models() -> dict[str, Any]:
        return ModelList(data=[ModelCard(id=model.name, created=created) for model in host.catalogue]).model_dump()

    @api.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: HTTPRequest) -> Any:
        call = lambda api: api.chat(body, request)  # noqa: E731
        return await host.serve(body.model, "openai", OpenAIServing, call, body.ttl, WAITING if body.stream else None)

    @api.post("/v1/completions")
    async def completions(body: CompletionBody, request: HTTPRequest) -> Any:
        call = lambda api: api.completions(body, request)  # noqa: E731
        return await host.serve(body.model, "openai", OpenAIServing, call, body.ttl, WAITING if body.stream else None)

    @api.post("/v1/responses")
    async def create_response(body: ResponsesBody, request: HTTPRequest) -> Any:
        call = lambda api: api.create(body, request)  # noqa: E731
        waiting = RESPONSES_WAITING if body.stream else None
        return await host.serve(body.model, "responses", responses, call, body.ttl, waiting)

    @api.post("/v1/embeddings")
    async def embed(body: EmbeddingsBody, request: HTTPRequest) -> Any:
        return await host.embed(body.model, lambda embedder: until_done(embeddings(embedder, body), request), body.ttl)

    @api.get("/v1/responses/{ident}")
    async def get_response(ident: str) -> dict[str, Any]:
        return store.response(ident).model_dump(exclude_unset=True)

    @api.delete("/v1/responses/{ident}")
    async def delete_response(ident: str) -> dict[str, Any]:
        return store.delete(ident).model_dump()

    return api
