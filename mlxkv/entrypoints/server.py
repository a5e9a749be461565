"""`mlxkv serve`: OpenAI's chat and completions API over the async engine, metrics, and a chat page.

Each HTTP request becomes `n` engine requests on one `AsyncLLM`, so concurrent clients are
batched by the scheduler. A client that goes away (mid-prefill or mid-stream) is aborted at
once and its pages freed: streaming responses are cancelled by Starlette when the client
disconnects, and a watcher does the same for non-streaming ones.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from importlib.resources import files
from typing import Literal

from fastapi import Depends, FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from ..cache.prefix_cache import check_salt
from ..engine.async_llm import AsyncLLM
from ..engine.llm_engine import RequestOutput, Usage
from ..engine.sampling import MAX_LOGPROBS, SamplingParams, TokenLogprob
from ..errors import RequestFailed, RequestTooLong
from .prompts import prompt_ids

KEEPALIVE_S = 2.0  # a comment line this often while a stream has nothing to send (a long prefill)


class StreamOptions(BaseModel):
    include_usage: bool = False


class Body(BaseModel):
    """The fields chat and completions requests share (unknown fields are ignored, as OpenAI's
    clients send some of their own)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    user: str | None = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def as_template_input(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatBody(Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class CompletionBody(Body):
    prompt: str | list[int]
    logprobs: int | None = None


class APIError(Exception):
    """An error answered as OpenAI's `{"error": {...}}` with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.kind, self.headers = status, param, code, kind, headers

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class Metrics:
    """Prometheus figures: the engine's state read at scrape time, token counts and latencies as served."""

    def __init__(self, llm: AsyncLLM) -> None:
        engine, self.registry = llm.engine, CollectorRegistry()
        gauges = {
            "running_requests": ("Requests being computed", lambda: len(engine.scheduler.running)),
            "waiting_requests": ("Requests waiting to be admitted", lambda: len(engine.scheduler.waiting)),
            "kv_pages_used": ("KV pages held by requests", lambda: engine.cache.usage().pages_used),
            "kv_pages_total": ("KV pages in the pool", lambda: engine.cache.pool.capacity),
            "kv_bytes_holding_tokens": ("KV bytes holding tokens", lambda: engine.cache.usage().bytes_holding_tokens),
            "preemptions": ("Requests preempted so far", lambda: engine.scheduler.num_preemptions),
            "prefix_cache_hit_rate": ("Share of prompt tokens reused from the prefix cache",
                                      lambda: engine.prefix_stats.hit_rate),
        }
        for name, (doc, read) in gauges.items():
            Gauge(f"mlxkv_{name}", doc, registry=self.registry).set_function(read)
        self.prompt_tokens = Counter("mlxkv_prompt_tokens", "Prompt tokens served", registry=self.registry)
        self.generation_tokens = Counter("mlxkv_generation_tokens", "Tokens generated", registry=self.registry)
        self.ttft = Histogram("mlxkv_time_to_first_token_seconds", "Time to first token", registry=self.registry,
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        self.itl = Histogram("mlxkv_inter_token_latency_seconds", "Time between tokens", registry=self.registry,
                             buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))


class Server:
    """The app's state: one engine, one model id, and how requests become engine requests."""

    def __init__(self, llm: AsyncLLM, model_id: str, max_queue: int, keepalive_s: float) -> None:
        self.llm, self.model_id, self.max_queue, self.keepalive_s = llm, model_id, max_queue, keepalive_s
        self.created = int(time.time())
        self.metrics = Metrics(llm)

    def check(self, body: Body) -> None:
        if body.model is not None and body.model != self.model_id:
            raise APIError(404, f"model {body.model!r} does not exist; this server runs {self.model_id!r}",
                           "model", "model_not_found")
        if len(self.llm.engine.scheduler.waiting) + body.n > self.max_queue:
            raise APIError(503, f"the server is busy ({self.max_queue} requests waiting); retry shortly",
                           code="queue_full", kind="server_error", headers={"Retry-After": "1"})

    def params(self, body: Body, prompt: list[int], max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The engine's sampling parameters for `body`; `max_tokens` is cut to the room the prompt leaves."""
        room = self.llm.engine.max_request_tokens - len(prompt) + 1
        if room < 1:
            raise APIError(400, f"the prompt has {len(prompt)} tokens; this server holds at most "
                                f"{self.llm.engine.max_request_tokens} per request", None, "context_length_exceeded")
        limit = room if max_tokens is None else min(room, max_tokens) if max_tokens >= 1 else max_tokens
        try:
            check_salt(body.cache_salt)
            return SamplingParams(max_tokens=limit, temperature=body.temperature, top_p=body.top_p,
                                  top_k=body.top_k, min_p=body.min_p, stop=body.stop, seed=body.seed,
                                  logprobs=logprobs)
        except ValueError as exc:
            raise APIError(400, str(exc), str(exc).split()[0]) from None

    async def run(self, prompt: list[int], params: SamplingParams, n: int,
                  salt: str | None) -> AsyncIterator[tuple[int, RequestOutput] | None]:
        """The outputs of `n` choices for one prompt as they come, tagged by choice index; None
        every `keepalive_s` without any. Leaving early aborts every choice still running."""
        queue: asyncio.Queue = asyncio.Queue()
        stamp = [time.perf_counter()] * n
        first = [True] * n

        async def pump(index: int) -> None:
            try:
                async with aclosing(self.llm.outputs(prompt, params, cache_salt=salt)) as outputs:
                    async for output in outputs:
                        self._observe(index, output, stamp, first)
                        await queue.put((index, output, None))
            except Exception as exc:  # handed to the consumer, which raises it
                await queue.put((index, None, exc))

        tasks = [asyncio.create_task(pump(i)) for i in range(n)]
        try:
            finished = 0
            while finished < n:
                try:
                    index, output, error = await asyncio.wait_for(queue.get(), self.keepalive_s)
                except asyncio.TimeoutError:
                    yield None
                    continue
                if error is not None:
                    raise error
                finished += output.finished
                yield index, output
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _observe(self, index: int, output: RequestOutput, stamp: list[float], first: list[bool]) -> None:
        now, tokens = time.perf_counter(), len(output.token_ids)
        if tokens:
            (self.metrics.ttft if first[index] else self.metrics.itl).observe(now - stamp[index])
            stamp[index], first[index] = now, False
            self.metrics.generation_tokens.inc(tokens)
        if output.finished and output.usage is not None:
            self.metrics.prompt_tokens.inc(output.usage.prompt_tokens)


def usage_json(usages: list[Usage]) -> dict:
    prompt, completion = usages[0].prompt_tokens, sum(u.completion_tokens for u in usages)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": usages[0].cached_tokens}}


def sse(payload: dict | str) -> str:
    """One Server-Sent Events message."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def build_app(llm: AsyncLLM, model_id: str, *, api_key: str | None = None, allowed_origins: list[str] = (),
              max_queue: int = 1024, keepalive_s: float = KEEPALIVE_S) -> FastAPI:
    """The FastAPI app serving `llm` as `model_id`."""
    def authorize(request: HTTPRequest) -> None:
        """With an API key, every endpoint but /health wants it (a dependency: an HTTP middleware
        would hide client disconnects from the handlers)."""
        if api_key and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                raise APIError(401, "a valid API key is required (Authorization: Bearer <key>)",
                               code="invalid_api_key")

    app = FastAPI(title="mlxkv", docs_url=None, redoc_url=None, dependencies=[Depends(authorize)])
    server = Server(llm, model_id, max_queue, keepalive_s)
    tokenizer = llm.engine.tokenizer
    chat_page = files("mlxkv.entrypoints").joinpath("chat.html").read_text(encoding="utf-8")
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])

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
        return APIError(400, f"{param}: {first.get('msg')}" if param else first.get("msg"), param).response()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": server.created,
                                            "owned_by": "mlxkv"}]}

    @app.get("/", response_class=HTMLResponse)
    async def page() -> str:
        return chat_page

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: HTTPRequest):
        server.check(body)
        try:
            prompt = prompt_ids(tokenizer, [m.as_template_input() for m in body.messages])
        except Exception as exc:
            raise APIError(400, f"the messages do not fit the model's chat template: {exc}", "messages") from None
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}]", "top_logprobs")
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = server.params(body, prompt, limit, (body.top_logprobs or 0) if body.logprobs else None)
        return await respond(body, prompt, params, request, "chat.completion")

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: HTTPRequest):
        server.check(body)
        try:
            prompt = llm.engine.encode(body.prompt)
        except (TypeError, ValueError) as exc:
            raise APIError(400, str(exc), "prompt") from None
        if body.logprobs is not None and not 0 <= body.logprobs <= 5:
            raise APIError(400, "logprobs must be an integer in [0, 5]", "logprobs")
        params = server.params(body, prompt, 16 if body.max_tokens is None else body.max_tokens, body.logprobs)
        return await respond(body, prompt, params, request, "text_completion")

    async def respond(body: Body, prompt: list[int], params: SamplingParams, request: HTTPRequest, kind: str):
        ident = f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}"
        head = {"id": ident, "created": int(time.time()), "model": model_id}
        events = server.run(prompt, params, body.n, body.cache_salt)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(stream(events, head, kind, body.n, usage), media_type="text/event-stream")
        return await until_done(collect(events, head, kind, body.n), request)

    async def until_done(work, request: HTTPRequest):
        """Run `work`, cancelling it (which aborts its requests) the moment the client disconnects."""
        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pending in (task, watcher):
                pending.cancel()
            await asyncio.gather(task, watcher, return_exceptions=True)
        return task.result() if not task.cancelled() else Response(status_code=499)

    async def collect(events: AsyncIterator, head: dict, kind: str, n: int) -> dict:
        text, logprobs = [""] * n, [[] for _ in range(n)]
        reasons, usages = [None] * n, [None] * n
        async with aclosing(events):
            async for event in events:
                if event is None:
                    continue
                index, output = event
                text[index] += output.delta
                logprobs[index] += output.logprobs
                reasons[index], usages[index] = output.finish_reason, output.usage
        choices = [choice(kind, i, text[i], reasons[i], logprobs[i], final=True) for i in range(n)]
        return {**head, "object": kind, "choices": choices, "usage": usage_json(usages)}

    async def stream(events: AsyncIterator, head: dict, kind: str, n: int, include_usage: bool) -> AsyncIterator[str]:
        chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else kind
        usages = [None] * n
        async with aclosing(events):
            if kind == "chat.completion":
                for i in range(n):
                    yield sse({**head, "object": chunk_kind, "choices": [
                        {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}]})
            try:
                async for event in events:
                    if event is None:
                        yield ": keepalive\n\n"
                        continue
                    index, output = event
                    usages[index] = output.usage
                    if output.delta or output.finished or output.logprobs:
                        yield sse({**head, "object": chunk_kind, "choices": [
                            choice(kind, index, output.delta, output.finish_reason, list(output.logprobs))]})
            except RequestFailed as exc:  # the status line has gone: the error travels as an event
                yield sse(APIError(500, str(exc), kind="server_error").body())
                return
        if include_usage:
            yield sse({**head, "object": chunk_kind, "choices": [], "usage": usage_json(usages)})
        yield sse("[DONE]")

    def choice(kind: str, index: int, text: str, reason: str | None, scores: list[TokenLogprob],
               final: bool = False) -> dict:
        wanted = bool(scores)
        if kind == "chat.completion":
            part = {"role": "assistant", "content": text} if final else {"content": text}
            return {"index": index, "message" if final else "delta": part, "finish_reason": reason,
                    "logprobs": {"content": [chat_logprob(s) for s in scores]} if wanted else None}
        return {"index": index, "text": text, "finish_reason": reason,
                "logprobs": legacy_logprobs(scores) if wanted else None}

    def token_text(token: int) -> str:
        return tokenizer.decode([token])

    def chat_logprob(score: TokenLogprob) -> dict:
        top = [{"token": token_text(t), "logprob": lp, "bytes": list(token_text(t).encode())} for t, lp in score.top]
        text = token_text(score.token)
        return {"token": text, "logprob": score.logprob, "bytes": list(text.encode()), "top_logprobs": top}

    def legacy_logprobs(scores: list[TokenLogprob]) -> dict:
        tokens = [token_text(s.token) for s in scores]
        offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        return {"tokens": tokens, "token_logprobs": [s.logprob for s in scores],
                "top_logprobs": [{token_text(t): lp for t, lp in s.top} for s in scores], "text_offset": offsets}

    @app.exception_handler(RequestTooLong)
    async def too_long(_: HTTPRequest, exc: RequestTooLong) -> JSONResponse:
        return APIError(400, str(exc), None, "context_length_exceeded").response()

    @app.exception_handler(RequestFailed)
    async def failed(_: HTTPRequest, exc: RequestFailed) -> JSONResponse:
        return APIError(500, str(exc), kind="server_error").response()

    return app
