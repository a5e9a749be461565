"""Anthropic's routes: `/v1/messages` and `/v1/messages/count_tokens`."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi import Request as HTTPRequest

from ..core import ServingCore
from .protocol import CountTokensBody, MessagesBody
from .serving import AnthropicServing

PATHS = ("/v1/messages",)  # where errors take Anthropic's shape


def router(core: ServingCore) -> APIRouter:
    """Anthropic's endpoints over `core`."""
    anthropic = AnthropicServing(core)
    api = APIRouter()

    @api.post("/v1/messages")
    async def messages(body: MessagesBody, request: HTTPRequest) -> Any:
        return await anthropic.messages(body, request)

    @api.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensBody) -> dict[str, int]:
        return (await anthropic.count_tokens(body)).model_dump()

    return api
