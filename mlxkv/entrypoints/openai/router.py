"""OpenAI's routes: `/v1/models`, `/v1/chat/completions`, `/v1/completions` and `/v1/responses` (created,
fetched and deleted)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter
from fastapi import Request as HTTPRequest

from ..core import ServingCore
from .protocol import ChatBody, CompletionBody, ModelCard, ModelList
from .responses import ResponsesServing
from .responses_protocol import ResponsesBody
from .serving import OpenAIServing


def router(core: ServingCore) -> APIRouter:
    """OpenAI's endpoints over `core`."""
    openai, responses = OpenAIServing(core), ResponsesServing(core)
    created = int(time.time())
    api = APIRouter()

    @api.get("/v1/models")
    async def models() -> dict[str, Any]:
        return ModelList(data=[ModelCard(id=core.model_id, created=created)]).model_dump()

    @api.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: HTTPRequest) -> Any:
        return await openai.chat(body, request)

    @api.post("/v1/completions")
    async def completions(body: CompletionBody, request: HTTPRequest) -> Any:
        return await openai.completions(body, request)

    @api.post("/v1/responses")
    async def create_response(body: ResponsesBody, request: HTTPRequest) -> Any:
        return await responses.create(body, request)

    @api.get("/v1/responses/{ident}")
    async def get_response(ident: str) -> dict[str, Any]:
        return responses.store.response(ident).model_dump(exclude_unset=True)

    @api.delete("/v1/responses/{ident}")
    async def delete_response(ident: str) -> dict[str, Any]:
        return responses.store.delete(ident).model_dump()

    return api
