"""Ollama's routes: `/api/chat`, `/api/generate`, `/api/embed`, `/api/embeddings`, `/api/tags`,
`/api/show`, `/api/ps` and `/api/version`, over the models of the model host (`keep_alive`: how long
the model stays loaded idle after the request; Ollama's load and unload idiom loads or unloads it)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta, timezone
from typing import Any, TypeVar

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from pydantic import BaseModel

from ..embedder import Embedder
from ..hosting import ListedModel, ModelHost, Resident, facts_of
from ..replies import until_done
from .embed import embed, embeddings
from .protocol import (
    ChatBody,
    EmbedBody,
    EmbeddingsBody,
    GenerateBody,
    ModelEntry,
    ModelInfo,
    Running,
    RunningModel,
    ShowBody,
    Tags,
)
from .serving import FOREVER, OllamaServing, loaded, model_entry, running_model, waiting

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
            if resident is not None and resident.core is not None:
                entries.append(resident.serving("ollama", OllamaServing).entry())
            else:
                entries.append(listed_entry(listed))
        return Tags(models=entries).model_dump()

    def listed_entry(listed: ListedModel) -> ModelEntry:
        """A model as its checkpoint's files describe it (one not loaded, or an embedding model)."""
        facts = facts_of(listed)
        modified = datetime.fromtimestamp(facts.modified, timezone.utc) if facts.modified else started
        return model_entry(listed.name, facts.model_type, facts.weight_bytes, modified)

    def running_entry(resident: Resident, expires_at: datetime) -> RunningModel:
        if resident.core is not None:
            return resident.serving("ollama", OllamaServing).running(expires_at, resident.planned)
        assert resident.embedder is not None
        entry = listed_entry(resident.listed)
        return running_model(entry, expires_at, resident.planned, resident.embedder.model.max_length)

    @api.post("/api/show")
    async def show(request: HTTPRequest) -> Any:
        body = await json_body(request, ShowBody)

        async def shown(ollama: OllamaServing) -> dict[str, Any]:
            return ollama.show().model_dump()

        name = body.model or body.name
        resident = await host.resident(name)
        if resident.embedder is not None:
            return embedding_info(resident.listed, resident.embedder).model_dump()
        return await host.serve(name, "ollama", OllamaServing, shown)

    def embedding_info(listed: ListedModel, embedder: Embedder) -> ModelInfo:
        """An embedding model as `/api/show` describes it: no template, the `embedding` capability."""
        entry = listed_entry(listed)
        architecture = entry.details.family
        model = embedder.model
        return ModelInfo(
            template="",
            details=entry.details,
            model_info={
                "general.architecture": architecture,
                f"{architecture}.context_length": model.max_length,
                f"{architecture}.embedding_length": model.pooling.dimensions,
                f"{architecture}.pooling_type": model.pooling.mode,
            },
            capabilities=["embedding"],
            modified_at=entry.modified_at,
        )

    @api.get("/api/ps")
    async def running() -> dict[str, Any]:
        now, clock = datetime.now(timezone.utc), host.clock()
        models = [
            running_entry(
                resident, FOREVER if resident.expires is None else now + timedelta(seconds=resident.expires - clock)
            )
            for resident in host.residents.values()
        ]
        return Running(models=models).model_dump(mode="json")

    @api.post("/api/embed")
    async def embed_route(request: HTTPRequest) -> Any:
        body = await json_body(request, EmbedBody)
        return await host.embed(
            body.model, lambda embedder: until_done(embed(embedder, body), request), body.keep_alive
        )

    @api.post("/api/embeddings")
    async def embeddings_route(request: HTTPRequest) -> Any:
        body = await json_body(request, EmbeddingsBody)
        called = lambda embedder: until_done(embeddings(embedder, body), request)  # noqa: E731
        return await host.embed(body.model, called, body.keep_alive)

    @api.get("/api/version")
    async def version() -> dict[str, str]:
        return OllamaServing.version().model_dump()

    return api
