"""Anthropic's routes: `/v1/messages` and `/v1/messages/count_tokens`."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi import Request as HTTPRequest

from ..core import ServingCore
from ..hosting import ModelHost
from .protocol import CountTokensBody, MessagesBody
from .serving import WAITING, AnthropicServing
from .signatures import ThinkingSignatures

PATHS = ("/v1/messages",)  # where errors take Anthropic's shape


def router(host: ModelHost) -> APIRouter:
    """Anthropic's endpoints over the models of `host`."""
    signatures = ThinkingSignatures()  # every model's: a conversation may go on with another model
    api = APIRouter()

    def anthropic(core: ServingCore) -> AnthropicServing:
        return AnthropicServing(core, signatures)

    @api.post("/v1/messages")
    async def messages(body: MessagesBody, request: HTTPRequest) -> Any:
        call = lambda api: api.messages(body, request)  # noqa: E731
        return await host.serve(body.model, "anthropic", anthropic, call, waiting=WAITING if body.stream else None)

    @api.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensBody) -> Any:
        async def count(api: AnthropicServing) -> dict[str, int]:
            return (await api.count_tokens(body)).model_dump()

        return await host.serve(body.model, "anthropic", anthropic, count)

    return api
