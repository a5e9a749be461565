"""Ollama's routes: `/api/chat`, `/api/generate`, `/api/tags`, `/api/show`, `/api/ps` and `/api/version`."""

from __future__ import annotations

from typing import Any, TypeVar

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from pydantic import BaseModel

from ..core import ServingCore
from .protocol import ChatBody, GenerateBody, ShowBody
from .serving import OllamaServing

PATHS = ("/api/",)  # where errors take Ollama's shape
Model = TypeVar("Model", bound=BaseModel)


async def json_body(request: HTTPRequest, model: type[Model]) -> Model:
    """The request's body read as JSON whatever its content type says (Ollama's clients and docs
    send JSON without one), checked by `model`."""
    return model.model_validate_json(await request.body() or b"{}")


def router(core: ServingCore) -> APIRouter:
    """Ollama's endpoints over `core`."""
    ollama = OllamaServing(core)
    api = APIRouter()

    @api.post("/api/chat")
    async def chat(request: HTTPRequest) -> Any:
        return await ollama.chat(await json_body(request, ChatBody), request)

    @api.post("/api/generate")
    async def generate(request: HTTPRequest) -> Any:
        return await ollama.generate(await json_body(request, GenerateBody), request)

    @api.get("/api/tags")
    async def tags() -> dict[str, Any]:
        return ollama.tags().model_dump()

    @api.post("/api/show")
    async def show(request: HTTPRequest) -> dict[str, Any]:
        return ollama.show(await json_body(request, ShowBody)).model_dump()

    @api.get("/api/ps")
    async def running() -> dict[str, Any]:
        return ollama.running().model_dump(mode="json")

    @api.get("/api/version")
    async def version() -> dict[str, str]:
        return ollama.version().model_dump()

    return api
