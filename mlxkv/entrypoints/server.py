"""`mlxkv serve`'s HTTP app: OpenAI's API (`openai/`), Anthropic's Messages API (`anthropic/`), Ollama's
API (`ollama/`), `/metrics`, `/health`, the model list and a chat page, all over one serving core
(`core.py`).

Concurrent clients share one `AsyncLLM`, so their requests are batched by the scheduler.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from importlib.resources import files
from typing import Any, TypeVar

from fastapi import Depends, FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from ..engine.async_llm import AsyncLLM
from ..errors import RequestFailed, RequestTooLong
from .anthropic import protocol as anthropic_protocol
from .anthropic.serving import AnthropicServing
from .core import ServingCore, ServingError
from .metrics import Metrics
from .ollama import protocol as ollama_protocol
from .ollama.serving import OllamaServing
from .openai import protocol as openai_protocol
from .openai.responses import ResponsesBody, ResponsesServing
from .openai.serving import OpenAIServing

Model = TypeVar("Model", bound=BaseModel)
KEEPALIVE_S = 2.0  # a comment line this often while a stream has nothing to send (a long prefill)
OPEN_PATHS = ("/health", "/")  # what answers without the API key


async def json_body(request: HTTPRequest, model: type[Model]) -> Model:
    """The request's body read as JSON whatever its content type says (Ollama's clients and docs
    send JSON without one), checked by `model`."""
    return model.model_validate_json(await request.body() or b"{}")


def build_app(
    llm: AsyncLLM,
    model_id: str,
    *,
    api_key: str | None = None,
    allowed_origins: Sequence[str] = (),
    max_queue: int = 1024,
    keepalive_s: float = KEEPALIVE_S,
) -> FastAPI:
    """The FastAPI app serving `llm` as `model_id`."""

    def authorize(request: HTTPRequest) -> None:
        """With an API key, every endpoint but /health and the chat page wants it (the page holds no
        data and asks its user for the key), as `Authorization: Bearer <key>` or Anthropic's
        `x-api-key: <key>`. A dependency: an HTTP middleware would hide client disconnects from the
        handlers."""
        if api_key and request.url.path not in OPEN_PATHS:
            bearer = request.headers.get("authorization", "").encode()
            header = request.headers.get("x-api-key", "").encode()
            if not (
                secrets.compare_digest(bearer, f"Bearer {api_key}".encode())
                or secrets.compare_digest(header, api_key.encode())
            ):
                raise ServingError(
                    401,
                    "a valid API key is required (Authorization: Bearer <key>, or x-api-key: <key>)",
                    code="invalid_api_key",
                    kind="authentication_error",
                )

    app = FastAPI(title="mlxkv", docs_url=None, redoc_url=None, dependencies=[Depends(authorize)])
    metrics = Metrics(llm.engine)
    core = ServingCore(llm, model_id, metrics, max_queue, keepalive_s)
    openai, responses = OpenAIServing(core), ResponsesServing(core)
    anthropic, ollama = AnthropicServing(core), OllamaServing(core)
    created = int(time.time())
    chat_page = files("mlxkv.entrypoints").joinpath("chat.html").read_text(encoding="utf-8")
    if allowed_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"], allow_headers=["*"]
        )

    def render(request: HTTPRequest, error: ServingError) -> JSONResponse:
        """`error` in the shape of the API the request called."""
        if request.url.path.startswith("/v1/messages"):
            return anthropic_protocol.error_response(error)
        if request.url.path.startswith("/api/"):
            return ollama_protocol.error_response(error)
        return openai_protocol.error_response(error)

    @app.exception_handler(ServingError)
    async def refused(request: HTTPRequest, exc: ServingError) -> JSONResponse:
        return render(request, exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: HTTPRequest, exc: RequestValidationError) -> JSONResponse:
        return render(request, refusal(exc.errors()))

    @app.exception_handler(ValidationError)
    async def invalid_json(request: HTTPRequest, exc: ValidationError) -> JSONResponse:
        return render(request, refusal(exc.errors()))

    def refusal(errors: Sequence[Any]) -> ServingError:
        """The first of a body's validation errors, naming the field."""
        first = errors[0]
        where = [str(part) for part in first.get("loc", ()) if part != "body"]
        if first.get("type") == "json_invalid":
            return ServingError(400, f"the body is not valid JSON: {first.get('msg')}")
        param = ".".join(where) or None
        return ServingError(400, f"{param}: {first.get('msg')}" if param else str(first.get("msg")), param)

    @app.exception_handler(RequestTooLong)
    async def too_long(request: HTTPRequest, exc: RequestTooLong) -> JSONResponse:
        return render(request, ServingError(400, str(exc), None, "context_length_exceeded"))

    @app.exception_handler(RequestFailed)
    async def failed(request: HTTPRequest, exc: RequestFailed) -> JSONResponse:
        return render(request, ServingError(500, str(exc), kind="server_error"))

    @app.get("/health", response_model=None)
    async def health() -> dict[str, str] | JSONResponse:
        lost = llm.engine.lost  # a tensor-parallel group that failed: the server is ending
        return {"status": "ok"} if lost is None else JSONResponse({"status": "error", "error": str(lost)}, 503)

    @app.get("/metrics")
    def prometheus() -> Response:  # a plain def: FastAPI runs it off the event loop, as stats() takes the engine lock
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": model_id, "object": "model", "created": created, "owned_by": "mlxkv"}],
        }

    @app.get("/", response_class=HTMLResponse)
    async def page() -> str:
        return chat_page

    @app.post("/v1/chat/completions")
    async def chat(body: openai_protocol.ChatBody, request: HTTPRequest) -> Any:
        return await openai.chat(body, request)

    @app.post("/v1/completions")
    async def completions(body: openai_protocol.CompletionBody, request: HTTPRequest) -> Any:
        return await openai.completions(body, request)

    @app.post("/v1/responses")
    async def create_response(body: ResponsesBody, request: HTTPRequest) -> Any:
        return await responses.create(body, request)

    @app.post("/v1/messages")
    async def messages(body: anthropic_protocol.MessagesBody, request: HTTPRequest) -> Any:
        return await anthropic.messages(body, request)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: anthropic_protocol.CountTokensBody) -> dict[str, int]:
        return await anthropic.count_tokens(body)

    @app.post("/api/chat")
    async def ollama_chat(request: HTTPRequest) -> Any:
        return await ollama.chat(await json_body(request, ollama_protocol.ChatBody), request)

    @app.post("/api/generate")
    async def ollama_generate(request: HTTPRequest) -> Any:
        return await ollama.generate(await json_body(request, ollama_protocol.GenerateBody), request)

    @app.get("/api/tags")
    async def ollama_tags() -> dict[str, Any]:
        return ollama.tags()

    @app.post("/api/show")
    async def ollama_show(request: HTTPRequest) -> dict[str, Any]:
        return ollama.show(await json_body(request, ollama_protocol.ShowBody))

    @app.get("/api/version")
    async def ollama_version() -> dict[str, str]:
        return ollama.version()

    return app
