"""`mlxkv serve`'s HTTP app: the routes of OpenAI's API (`openai/`), Anthropic's Messages API
(`anthropic/`) and Ollama's API (`ollama/`), each API's own router over the model host
(`hosting/`), which finds each request's model and its serving core (`core.py`); and `/metrics`,
`/health` and a chat page; the API key, CORS, and every error in the shape of the API it answers.

Concurrent clients of one model share its `AsyncLLM`, so their requests are batched by its scheduler.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from importlib.metadata import version
from importlib.resources import files
from typing import Any

from fastapi import Depends, FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.async_llm import AsyncLLM
from ..errors import RequestFailed, RequestTooLong
from .anthropic import protocol as anthropic_protocol
from .anthropic import router as anthropic_router
from .body_limit import BodyLimit
from .core import ServingCore
from .durations import KeepAlive
from .errors import ServingError
from .hosting import Catalogue, ListedModel, Loaded, ModelHost, facts_of
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
DEFAULT_CONTEXT = 131072  # tokens of a listed model whose context neither its settings nor its files say


def build_app(
    served: AsyncLLM | ModelHost,
    model_id: str = "mlxkv-demo",
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
    """The FastAPI app serving the models of a model host, or one engine (`served`) as `model_id`
    (requests may also name it by `aliases`), sampling with `sampling`'s fields where a request
    gives none (default: `sampling_defaults.CONVERSATION`; a host's models: as each was loaded
    with); the chat template reading `template_kwargs` where a request does not say, images at
    http(s) URLs fetched if `fetch_image_urls`; bodies over `max_request_bytes` (default: a few MiB
    above the longest prompt a model's context holds, `request_bytes_for`) are refused."""
    host = served if isinstance(served, ModelHost) else holding(served, ListedModel(model_id, None, tuple(aliases)))
    metrics = Metrics(lambda: {name: llm.engine for name, llm in host.engines.items()})

    def make_core(listed: ListedModel, loaded: Loaded) -> ServingCore:
        assert loaded.llm is not None, "a chat model has an engine"
        return ServingCore(
            loaded.llm,
            listed.name,
            metrics.of(listed.name),
            max_queue,
            keepalive_s,
            loaded.sampling,
            template_kwargs,
            fetch_image_urls,
        )

    host.serve_with(make_core, keepalive_s)
    if not isinstance(served, ModelHost):
        host.adopt(host.catalogue.default, Loaded(served, sampling))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        reaping = asyncio.create_task(host.reaping())  # idle models go when their keep-alive runs out
        try:
            yield
        finally:
            reaping.cancel()

    app = FastAPI(
        title="mlxkv", docs_url=None, redoc_url=None, dependencies=[Depends(authorizer(api_key))], lifespan=lifespan
    )
    limit = max_request_bytes if max_request_bytes is not None else body_limit(host)
    app.add_middleware(BodyLimit, limit=limit, refuse=lambda path, error: shape_of(path)(error))
    if allowed_origins:  # outermost, so that refusals carry the CORS headers too
        app.add_middleware(
            CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"], allow_headers=["*"]
        )
    handle_errors(app)
    serve_own_paths(app, host, metrics)
    for api in (openai_router, anthropic_router, ollama_router):
        app.include_router(api.router(host))
    return app


def holding(llm: AsyncLLM, listed: ListedModel) -> ModelHost:
    """A model host of the one engine `llm`, listed as `listed`: it stays, and nothing else loads."""
    return ModelHost(Catalogue([listed]), Fixed(), llm.engine.memory.limit, -1, fixed=True)


class Fixed:
    """The `build` of a host that loads nothing (`holding`)."""

    def __call__(self, listed: ListedModel, room: int) -> Loaded:
        raise AssertionError("a fixed host loads nothing")

    def wants(self, listed: ListedModel) -> int:
        return 0


def body_limit(host: ModelHost) -> int:
    """The default body limit: room for the longest prompt any listed model takes (as loaded, else
    as its settings or checkpoint say, else `DEFAULT_CONTEXT`), and for images if any reads them."""
    sizes = []
    for listed in host.catalogue:
        llm = host.engines.get(listed.name)
        if llm is not None:
            engine = llm.engine
            sizes.append(request_bytes_for(engine.max_request_tokens, engine.vision is not None))
        else:
            facts = facts_of(listed)
            tokens = listed.settings.get("max_model_len") or facts.context or DEFAULT_CONTEXT
            sizes.append(request_bytes_for(tokens, facts.images))
    return max(sizes)


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
    """The first of a body's validation errors, naming the field (a field's own check, raising
    ValueError, names it first in its message)."""
    first = errors[0]
    where = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return ServingError(400, f"the body is not valid JSON: {first.get('msg')}")
    param = ".".join(where) or None
    own = first.get("ctx", {}).get("error") if first.get("type") == "value_error" else None
    if own is not None:
        return ServingError(400, str(own), param)
    return ServingError(400, f"{param}: {first.get('msg')}" if param else str(first.get("msg")), param)


class ModelBody(BaseModel):
    """The body of `/models/load` and `/models/unload`: a listed model's name (None: the default),
    and how long it stays loaded idle (seconds or a duration; the server's unless given)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    keep_alive: KeepAlive = None


def serve_own_paths(app: FastAPI, host: ModelHost, metrics: Metrics) -> None:
    """The server's own paths: `/health`, `/models/load` and `/models/unload`, Prometheus'
    `/metrics` and the chat page at `/`."""
    chat_page = files("mlxkv.entrypoints").joinpath("chat.html").read_text(encoding="utf-8")

    @app.get("/health", response_model=None)
    async def health() -> dict[str, str] | JSONResponse:
        lost = host.lost  # a tensor-parallel group that failed: the server is ending
        if lost is not None:
            return JSONResponse({"status": "error", "error": str(lost), "version": VERSION}, 503)
        return {"status": "ok", "version": VERSION}

    @app.post("/models/load")
    async def load(body: ModelBody) -> dict[str, Any]:
        """Load a listed model now (as llama.cpp's router does), kept `keep_alive` seconds idle."""
        resident = await host.load(body.model, body.keep_alive)
        return {"success": True, "model": resident.name}

    @app.post("/models/unload")
    async def unload(body: ModelBody) -> dict[str, Any]:
        """Unload a listed model once its requests are done; `loaded`: whether it was."""
        return {"success": True, "model": host.listed(body.model).name, "loaded": await host.unload(body.model)}

    @app.get("/metrics")
    def prometheus() -> Response:  # a plain def: FastAPI runs it off the event loop, as stats() takes the engine lock
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", response_class=HTMLResponse)
    async def page() -> str:
        return chat_page
