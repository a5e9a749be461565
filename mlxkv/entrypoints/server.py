"""`mlxkv serve`'s HTTP app: the routes of OpenAI's API (`openai/`), Anthropic's Messages API
(`anthropic/`) and Ollama's API (`ollama/`), each API's own router over one serving core (`core.py`),
and `/metrics`, `/health` and a chat page; the API key, CORS, and every error in the shape of the
API it answers.

Concurrent clients share one `AsyncLLM`, so their requests are batched by the scheduler.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping, Sequence
from importlib.metadata import version
from importlib.resources import files
from typing import Any

from fastapi import Depends, FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.async_llm import AsyncLLM
from ..errors import RequestFailed, RequestTooLong
from .anthropic import protocol as anthropic_protocol
from .anthropic import router as anthropic_router
from .body_limit import BodyLimit
from .core import ServingCore
from .errors import ServingError
from .metrics import Metrics
from .ollama import protocol as ollama_protocol
from .ollama import router as ollama_router
from .openai import protocol as openai_protocol
from .openai import router as openai_router

KEEPALIVE_S = 2.0  # a stream's keepalive this often while it has nothing to send (a long prefill)
VERSION = version("mlxkv")
OPEN_PATHS = ("/health", "/")  # what answers without the API key
SLACK_BYTES = 4 * 2**20  # of a request body beyond its prompt's text: messages' fields, tools, schemas
BYTES_PER_TOKEN = 32  # of prompt text, as JSON, at most (a token is 4 characters on average)
IMAGE_BYTES = 64 * 2**20  # of images as base64, for a model that reads them: a few phone photos


def build_app(
    llm: AsyncLLM,
    model_id: str,
    *,
    api_key: str | None = None,
    allowed_origins: Sequence[str] = (),
    max_queue: int = 1024,
    keepalive_s: float = KEEPALIVE_S,
    max_request_bytes: int | None = None,
    aliases: Sequence[str] = (),
    sampling: Mapping[str, Any] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    fetch_image_urls: bool = True,
) -> FastAPI:
    """The FastAPI app serving `llm` as `model_id` (requests may also name it by `aliases`), sampling
    with `sampling`'s fields where a request gives none (default: `sampling_defaults.CONVERSATION`),
    its chat template reading `template_kwargs` where a request does not say, images at http(s) URLs
    fetched if `fetch_image_urls`;
    bodies over `max_request_bytes` (default: a few MiB above the longest prompt the context holds,
    `request_bytes_for`) are refused."""
    app = FastAPI(title="mlxkv", docs_url=None, redoc_url=None, dependencies=[Depends(authorizer(api_key))])
    if max_request_bytes is not None:
        limit = max_request_bytes
    else:
        limit = request_bytes_for(llm.engine.max_request_tokens, llm.engine.vision is not None)
    app.add_middleware(BodyLimit, limit=limit, refuse=lambda path, error: shape_of(path)(error))
    if allowed_origins:  # outermost, so that refusals carry the CORS headers too
        app.add_middleware(
            CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"], allow_headers=["*"]
        )
    handle_errors(app)
    metrics = Metrics(llm.engine)
    serve_own_paths(app, llm, metrics)
    core = ServingCore(
        llm, model_id, metrics, max_queue, keepalive_s, aliases, sampling, template_kwargs, fetch_image_urls
    )
    for api in (openai_router, anthropic_router, ollama_router):
        app.include_router(api.router(core))
    return app


def authorizer(api_key: str | None) -> Callable[[HTTPRequest], None]:
    """The dependency that checks the API key: with one, every endpoint but /health and the chat
    page wants it (the page holds no data and asks its user for the key), as `Authorization:
    Bearer <key>` or Anthropic's `x-api-key: <key>`. A dependency: an HTTP middleware would hide
    client disconnects from the handlers."""

    def authorize(request: HTTPRequest) -> None:
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

    return authorize


def request_bytes_for(tokens: int, images: bool = False) -> int:
    """The default body limit for a context of `tokens`: room for that many tokens of text, escaped
    as JSON (a generous `BYTES_PER_TOKEN` each), and `SLACK_BYTES` for the rest of the body; for a
    model that reads `images`, `IMAGE_BYTES` more, room for a few as base64."""
    return SLACK_BYTES + BYTES_PER_TOKEN * tokens + (IMAGE_BYTES if images else 0)


def handle_errors(app: FastAPI) -> None:
    """Every refusal and failure answered in the shape of the API the request called: the server's
    own refusals, bodies that do not parse or validate, unknown routes and methods, and whatever
    else goes wrong (a 500, never a plain-text one)."""

    @app.exception_handler(ServingError)
    async def refused(request: HTTPRequest, exc: ServingError) -> JSONResponse:
        return render(request, exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: HTTPRequest, exc: RequestValidationError) -> JSONResponse:
        return render(request, refusal(exc.errors()))

    @app.exception_handler(ValidationError)
    async def invalid_json(request: HTTPRequest, exc: ValidationError) -> JSONResponse:
        return render(request, refusal(exc.errors()))

    @app.exception_handler(RequestTooLong)
    async def too_long(request: HTTPRequest, exc: RequestTooLong) -> JSONResponse:
        return render(request, ServingError(400, str(exc), None, "context_length_exceeded"))

    @app.exception_handler(RequestFailed)
    async def failed(request: HTTPRequest, exc: RequestFailed) -> JSONResponse:
        return render(request, ServingError(500, str(exc), kind="server_error"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: HTTPRequest, exc: StarletteHTTPException) -> Response:
        return render(request, _http_error(request, exc))

    @app.exception_handler(Exception)
    async def crashed(request: HTTPRequest, exc: Exception) -> JSONResponse:  # Starlette logs it after
        return render(request, ServingError(500, f"the server failed: {exc!r}", kind="server_error"))


def _http_error(request: HTTPRequest, exc: StarletteHTTPException) -> ServingError:
    """Starlette's and FastAPI's own refusals, said as the server's: no such route, a method the
    route does not take, a body that is not JSON (FastAPI keeps why as the cause)."""
    if exc.status_code == 404:
        return ServingError(404, f"there is no {request.url.path} here", code="not_found", kind="not_found_error")
    if exc.status_code == 405:
        return ServingError(405, f"{request.url.path} does not take {request.method}", code="method_not_allowed")
    if exc.status_code == 400 and exc.__cause__ is not None:
        return ServingError(400, f"the body is not valid JSON: {exc.__cause__}")
    return ServingError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {}) or None)


def render(request: HTTPRequest, error: ServingError) -> JSONResponse:
    return shape_of(request.url.path)(error)


def shape_of(path: str) -> Callable[[ServingError], JSONResponse]:
    """How the API that owns `path` answers an error (OpenAI's unless another owns it)."""
    for paths, shape in (
        (anthropic_router.PATHS, anthropic_protocol.error_response),
        (ollama_router.PATHS, ollama_protocol.error_response),
    ):
        if path.startswith(paths):
            return shape
    return openai_protocol.error_response


def refusal(errors: Sequence[Any]) -> ServingError:
    """The first of a body's validation errors, naming the field."""
    first = errors[0]
    where = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return ServingError(400, f"the body is not valid JSON: {first.get('msg')}")
    param = ".".join(where) or None
    return ServingError(400, f"{param}: {first.get('msg')}" if param else str(first.get("msg")), param)


def serve_own_paths(app: FastAPI, llm: AsyncLLM, metrics: Metrics) -> None:
    """The server's own paths: `/health`, Prometheus' `/metrics` and the chat page at `/`."""
    chat_page = files("mlxkv.entrypoints").joinpath("chat.html").read_text(encoding="utf-8")

    @app.get("/health", response_model=None)
    async def health() -> dict[str, str] | JSONResponse:
        lost = llm.engine.lost  # a tensor-parallel group that failed: the server is ending
        if lost is not None:
            return JSONResponse({"status": "error", "error": str(lost), "version": VERSION}, 503)
        return {"status": "ok", "version": VERSION}

    @app.get("/metrics")
    def prometheus() -> Response:  # a plain def: FastAPI runs it off the event loop, as stats() takes the engine lock
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", response_class=HTMLResponse)
    async def page() -> str:
        return chat_page
