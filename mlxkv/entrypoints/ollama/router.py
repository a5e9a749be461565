"""Ollama's routes: `/api/chat`, `/api/generate`, `/api/tags`, `/api/show`, `/api/ps` and `/api/version`,
over the models of the model host (`keep_alive`: how long the model stays loaded idle after the
request; Ollama's load and unload idiom loads or unloads it)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta, timezone
from typing import Any, TypeVar

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from pydantic import BaseModel

from ..hosting import ModelHost, facts_of
from .protocol import ChatBody, GenerateBody, Running, ShowBody, Tags
from .serving import FOREVER, OllamaServing, loaded, model_entry, waiting

PATHS = ("/api/",)  # where errors take Ollama's shape
Model = TypeVar("Model", bound=BaseModel)


async def json_body(request: HTTPRequest, model: type[Model]) -> Model:
    """The request's body read as JSON whatever its content type says (Ollama's clients and docs
    send JSON without one), checked by `model`."""
    return model.model_validate_json(await request.body() or b"{}")


def router(host: ModelHost) -> APIRouter:
    """Ollama's endpoints over the models of `host`."""
    api = APIRouter()
    started = datetime.now(timezone.utc)

    async def answer(body: ChatBody | GenerateBody, key: str, call: Callable[[OllamaServing], Awaitable[Any]]) -> Any:
        if body.loads_only:
            if body.unloads:
                await host.unload(body.model)
            else:
                await host.load(body.model, body.keep_alive)
            return loaded(body, key)
        streaming = waiting(body.model, key) if body.stream else None
        return await host.serve(body.model, "ollama", OllamaServing, call, body.keep_alive, streaming)

    @api.post("/api/chat")
    async def chat(request: HTTPRequest) -> Any:
        body = await json_body(request, ChatBody)
        return await answer(body, "message", lambda ollama: ollama.chat(body, request))

    @api.post("/api/generate")
    async def generate(request: HTTPRequest) -> Any:
        body = await json_body(request, GenerateBody)
        return await answer(body, "response", lambda ollama: ollama.generate(body, request))

    @api.get("/api/tags")
    async def tags() -> dict[str, Any]:
        entries = []
        for listed in host.catalogue:
            resident = host.residents.get(listed.name)
            if resident is not None:
                entries.append(resident.serving("ollama", OllamaServing).entry())
            else:
                facts = facts_of(listed)
                modified = datetime.fromtimestamp(facts.modified, timezone.utc) if facts.modified else started
                entries.append(model_entry(listed.name, facts.model_type, facts.weight_bytes, modified))
        return Tags(models=entries).model_dump()

    @api.post("/api/show")
    async def show(request: HTTPRequest) -> Any:
        body = await json_body(request, ShowBody)

        async def shown(ollama: OllamaServing) -> dict[str, Any]:
            return ollama.show().model_dump()

        return await host.serve(body.model or body.name, "ollama", OllamaServing, shown)

    @api.get("/api/ps")
    async def running() -> dict[str, Any]:
        now, clock = datetime.now(timezone.utc), host.clock()
        models = [
            resident.serving("ollama", OllamaServing).running(
                FOREVER if resident.expires is None else now + timedelta(seconds=resident.expires - clock),
                resident.planned,
            )
            for resident in host.residents.values()
        ]
        return Running(models=models).model_dump(mode="json")

    @api.get("/api/version")
    async def version() -> dict[str, str]:
        return OllamaServing.version().model_dump()

    return api
