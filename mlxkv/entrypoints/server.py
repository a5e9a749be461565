"""`mlxkv serve`'s HTTP app: OpenAI's API (`openai/`), `/metrics`, `/health`, the model list and a chat page.

Concurrent clients share one `AsyncLLM`, so their requests are batched by the scheduler.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from importlib.resources import files
from typing import Any

from fastapi import Depends, FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..engine.async_llm import AsyncLLM
from ..errors import RequestFailed, RequestTooLong
from .metrics import Metrics
from .openai.protocol import APIError, ChatBody, CompletionBody
from .openai.serving import OpenAIServing

KEEPALIVE_S = 2.0  # a comment line this often while a stream has nothing to send (a long prefill)
OPEN_PATHS = ("/health", "/")  # what answers without the API key


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
        data and asks its user for the key). A dependency: an HTTP middleware would hide client
        disconnects from the handlers."""
        if api_key and request.url.path not in OPEN_PATHS:
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                raise APIError(401, "a valid API key is required (Authorization: Bearer <key>)", code="invalid_api_key")

    app = FastAPI(title="mlxkv", docs_url=None, redoc_url=None, dependencies=[Depends(authorize)])
    metrics = Metrics(llm.engine)
    openai = OpenAIServing(llm, model_id, metrics, max_queue, keepalive_s)
    created = int(time.time())
    chat_page = files("mlxkv.entrypoints").joinpath("chat.html").read_text(encoding="utf-8")
    if allowed_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"], allow_headers=["*"]
        )

    @app.exception_handler(APIError)
    async def api_error(_: HTTPRequest, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(_: HTTPRequest, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        where = [str(part) for part in first.get("loc", ()) if part != "body"]
        if first.get("type") == "json_invalid":
            return APIError(400, f"the body is not valid JSON: {first.get('msg')}").response()
        param = ".".join(where) or None
        return APIError(400, f"{param}: {first.get('msg')}" if param else str(first.get("msg")), param).response()

    @app.exception_handler(RequestTooLong)
    async def too_long(_: HTTPRequest, exc: RequestTooLong) -> JSONResponse:
        return APIError(400, str(exc), None, "context_length_exceeded").response()

    @app.exception_handler(RequestFailed)
    async def failed(_: HTTPRequest, exc: RequestFailed) -> JSONResponse:
        return APIError(500, str(exc), kind="server_error").response()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

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
    async def chat(body: ChatBody, request: HTTPRequest) -> Any:
        return await openai.chat(body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: HTTPRequest) -> Any:
        return await openai.completions(body, request)

    return app
