"""The model host: which listed models are loaded (residents), loading one when a request names it
and letting go of idle ones, within one memory budget.

A request leases its model for as long as its response is being sent; a model with a lease is
never unloaded. A model loads within its own memory limit (its settings', else the whole budget):
idle residents are unloaded first, least recently used first, until that much is free; where
residents serving requests keep it from being free, the model loads in what is (its engine sizes
its KV cache and step reserve to it, as under a tight --memory-limit), or if that cannot hold it
the request is refused with a 503 and `Retry-After`, naming what holds the memory.

An idle resident is unloaded once its keep-alive has run out (Ollama's semantics: seconds after
its last request ends; negative: never; 0: at once). Loads run one at a time on a thread of their
own, so every other model keeps serving meanwhile.

Models live in this one process: MLX gives a process one device and a single memory limit, the
budget is then MLX's own count, and an engine's failure fails only its own requests. A crash of
the process itself (Metal aborting) takes every model down; see docs/serving-several-models.md.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import mlx.core as mx
from fastapi.responses import StreamingResponse

from ...engine.async_encoder import AsyncEncoder
from ...engine.async_llm import AsyncLLM
from ...engine.memory.memory_budget import gb
from ...errors import MemoryBudgetError
from ..core import ServingCore
from ..embedder import Embedder, EngineEmbeddings
from ..errors import ServingError
from ..replies import Waiting, failure
from .catalogue import Catalogue, ListedModel
from .checkpoints import facts_of

logger = logging.getLogger(__name__)
RETRY_AFTER_S = 5  # what a 503 for memory tells the client to wait
REAP_EVERY_S = 1.0  # how often idle residents' keep-alives are checked

Serving = TypeVar("Serving")


@dataclass(frozen=True)
class Loaded:
    """A model loaded: its engine, and the sampling fields its requests use where they give none
    (None: `sampling_defaults.CONVERSATION`); or an encoder embedding model, which has no engine."""

    llm: AsyncLLM | None
    sampling: Mapping[str, Any] | None = None
    encoder: AsyncEncoder | None = None


@dataclass
class Resident:
    """A loaded model: its engine (`llm`; an encoder embedding model's `encoder` instead), the serving
    core every chat API uses (a chat model's) or its `embedder` (an embedding model's), the bytes its
    memory budget plans to hold (`planned`, of which `cache` is MLX's buffer cache), its leases
    (requests whose responses are being sent), and when it unloads if idle (`expires`; None: never)."""

    listed: ListedModel
    llm: AsyncLLM | None
    encoder: AsyncEncoder | None
    core: ServingCore | None
    embedder: Embedder | None
    planned: int
    cache: int
    leases: int = 0
    expires: float | None = None
    servings: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.listed.name

    @property
    def idle(self) -> bool:
        return self.leases == 0 and (self.llm is None or not self.llm.engine.has_unfinished())

    def serving(self, api: str, make: Callable[[ServingCore], Serving]) -> Serving:
        """This model's serving object of one chat API (made once); a 400 for an embedding model."""
        if self.core is None:
            raise ServingError(
                400,
                f"model {self.name!r} is an embedding model: it writes no text; ask it for embeddings "
                "(/v1/embeddings, /api/embed)",
                "model",
            )
        if api not in self.servings:
            self.servings[api] = make(self.core)
        serving: Serving = self.servings[api]
        return serving

    def embedding(self) -> Embedder:
        """This model's embedding path; a 400 for a model that is no embedding model."""
        if self.embedder is None:
            raise ServingError(
                400,
                f"model {self.name!r} is not an embedding model (its checkpoint declares no sentence-transformers "
                "pooling); ask an embedding model",
                "model",
            )
        return self.embedder


class Build(Protocol):
    """How a host loads a listed model (on a loader thread)."""

    def __call__(self, listed: ListedModel, room: int) -> Loaded:
        """`listed` loaded within `room` bytes (`MemoryBudgetError` if they cannot hold it)."""
        ...

    def wants(self, listed: ListedModel) -> int:
        """The bytes `listed` loads within when it may have them: its own memory limit."""
        ...


MakeCore = Callable[[ListedModel, Loaded], ServingCore]  # the serving core of a model loaded


class ModelHost:
    """The listed models (`catalogue`) and the loaded ones (see the module). `build` loads a model
    within the bytes it is given; `budget` is the server's memory budget in bytes; `keep_alive` the
    seconds an idle model stays loaded unless its request or listing says otherwise; a `fixed`
    host keeps what it holds and loads nothing more (a tensor-parallel group's, an engine made
    elsewhere). `make_core` (`serve_with`) makes each model's serving core as it loads."""

    def __init__(
        self,
        catalogue: Catalogue,
        build: Build,
        budget: int,
        keep_alive: float,
        clock: Callable[[], float] = time.monotonic,
        fixed: bool = False,
    ) -> None:
        self.catalogue, self.budget, self.keep_alive, self.clock = catalogue, budget, keep_alive, clock
        self.fixed = fixed
        self.build = build
        self._make_core: MakeCore | None = None
        self.keepalive_s = 2.0  # how often a stream waiting for its model sends the API's keepalive
        self.residents: OrderedDict[str, Resident] = OrderedDict()  # least recently used first
        self._leaving = 0  # bytes of residents being unloaded
        self._load_lock = asyncio.Lock()

    def serve_with(self, make_core: MakeCore, keepalive_s: float) -> None:
        self._make_core, self.keepalive_s = make_core, keepalive_s

    def adopt(self, listed: ListedModel, loaded: Loaded) -> Resident:
        """Hold `loaded` (a model the caller loaded) as `listed`."""
        assert self._make_core is not None, "serve_with first"
        llm, encoder, embedder = loaded.llm, loaded.encoder, _embedder(listed.name, loaded)
        core = self._make_core(listed, loaded) if llm is not None and embedder is None else None
        memory = llm.engine.memory if llm is not None else None
        planned, cache = (memory.planned, memory.cache) if memory is not None else (0, 0)
        if encoder is not None:
            planned = encoder.encoder.weight_bytes
        resident = Resident(listed, llm, encoder, core, embedder, planned, cache)
        resident.expires = self._expiry(resident, None)  # idle from now
        self.residents[listed.name] = resident
        self.residents.move_to_end(listed.name)
        self.apply_memory()
        return resident

    @property
    def used(self) -> int:
        """Bytes the residents' budgets plan to hold (and those being unloaded still hold)."""
        return sum(r.planned for r in self.residents.values()) + self._leaving

    def listed(self, name: str | None) -> ListedModel:
        """The listed model `name` names (None: the default); a 404 if the catalogue lists none."""
        model = self.catalogue.find(name)
        if model is None:
            served = ", ".join(repr(m.name) for m in self.catalogue)
            raise ServingError(
                404,
                f"model {name!r} does not exist here; this server serves {served}",
                "model",
                "model_not_found",
                "not_found_error",
            )
        return model

    async def resident(self, name: str | None) -> Resident:
        """The loaded model `name` names, loading it first if it is not (see the module)."""
        listed = self.listed(name)
        resident = self.residents.get(listed.name)
        if resident is None:
            async with self._load_lock:
                resident = self.residents.get(listed.name) or await self._load(listed)
        self.residents.move_to_end(listed.name)
        return resident

    async def serve(
        self,
        name: str | None,
        api: str,
        make: Callable[[ServingCore], Serving],
        call: Callable[[Serving], Awaitable[Any]],
        keep_alive: float | None = None,
        waiting: Waiting | None = None,
    ) -> Any:
        """`call` the named model's serving object of `api` (made by `make`), holding a lease on
        the model until its response has been sent; then it stays loaded `keep_alive` seconds
        idle (None: as its listing or the server says). A stream (`waiting` says how it reads)
        whose model must load first starts at once, with the API's keepalives while it loads."""
        listed = self.listed(name)
        serving: Callable[[Resident], Serving] = lambda resident: resident.serving(api, make)  # noqa: E731
        if waiting is not None and listed.name not in self.residents:
            body = self._after_load(listed.name, serving, call, keep_alive, waiting)
            return StreamingResponse(body, media_type=waiting.media_type)
        return await self._call(await self.resident(name), serving, call, keep_alive)

    async def embed(
        self, name: str | None, call: Callable[[Embedder], Awaitable[Any]], keep_alive: float | None = None
    ) -> Any:
        """`call` the named model's embedding path, holding a lease on the model meanwhile (as `serve`)."""
        return await self._call(await self.resident(name), Resident.embedding, call, keep_alive)

    async def _after_load(
        self,
        name: str,
        serving: Callable[[Resident], Serving],
        call: Callable[[Serving], Awaitable[Any]],
        keep_alive: float | None,
        waiting: Waiting,
    ) -> AsyncIterator[str]:
        """A stream's body: `waiting`'s keepalive every `keepalive_s` while `name` loads, then the
        body of the stream `call` answers with, or the API's error event if it cannot start."""
        loading = asyncio.ensure_future(self.resident(name))  # loads on, should the client leave
        while not loading.done():
            await asyncio.wait({loading}, timeout=self.keepalive_s)
            if not loading.done():
                yield waiting.keepalive()
        try:
            response = await self._call(loading.result(), serving, call, keep_alive)
        except Exception as exc:
            for part in waiting.failed(failure(exc)):
                yield part
            return
        assert isinstance(response, StreamingResponse), "a streamed request is answered by a stream"
        async for chunk in response.body_iterator:
            yield chunk if isinstance(chunk, str) else bytes(chunk).decode()

    async def _call(
        self,
        resident: Resident,
        serving: Callable[[Resident], Serving],
        call: Callable[[Serving], Awaitable[Any]],
        keep_alive: float | None,
    ) -> Any:
        """`call` what `serving` finds of `resident`, under a lease released once the response is sent."""
        resident.leases += 1
        try:
            response = await call(serving(resident))
        except BaseException:
            self._release(resident, keep_alive)
            raise
        return self._held(response, resident, keep_alive)

    def _held(self, response: Any, resident: Resident, keep_alive: float | None) -> Any:
        """`response`, releasing the lease on `resident` once it is sent (a stream: at its end)."""
        if not isinstance(response, StreamingResponse):
            self._release(resident, keep_alive)
            return response
        body = response.body_iterator

        async def sent() -> Any:
            try:
                async for part in body:
                    yield part
            finally:
                self._release(resident, keep_alive)

        response.body_iterator = sent()
        return response

    def _release(self, resident: Resident, keep_alive: float | None) -> None:
        resident.leases -= 1
        resident.expires = self._expiry(resident, keep_alive)
        if resident.expires is not None and resident.expires <= self.clock() and resident.idle:
            asyncio.get_running_loop().create_task(self.reap())

    def _expiry(self, resident: Resident, keep_alive: float | None) -> float | None:
        """When `resident` unloads if it stays idle from now: after `keep_alive` seconds (None: its
        listing's, else the server's; negative: never, as in a fixed host)."""
        seconds = keep_alive if keep_alive is not None else resident.listed.keep_alive
        seconds = self.keep_alive if seconds is None else seconds
        return None if seconds < 0 or self.fixed else self.clock() + seconds

    async def load(self, name: str | None, keep_alive: float | None = None) -> Resident:
        """Load the named model (if it is not) and keep it `keep_alive` seconds idle from now."""
        resident = await self.resident(name)
        resident.leases += 1
        self._release(resident, keep_alive)
        return resident

    async def unload(self, name: str | None) -> bool:
        """Unload the named model once its requests are done (at once if it has none); whether it
        was loaded."""
        resident = self.residents.get(self.listed(name).name)
        if resident is None or self.fixed:
            return False
        resident.expires = self.clock()
        await self.reap()
        return True

    async def reap(self) -> None:
        """Unload every idle resident whose keep-alive has run out."""
        now = self.clock()
        for name in [n for n, r in self.residents.items() if r.expires is not None and r.expires <= now and r.idle]:
            await self._unload(name)

    async def reaping(self) -> None:
        """Reap for ever, every `REAP_EVERY_S` (the server runs this while it serves)."""
        while True:
            await asyncio.sleep(REAP_EVERY_S)
            await self.reap()

    async def _load(self, listed: ListedModel) -> Resident:
        """Load `listed`, unloading idle residents first, least recently used first, while the
        budget lacks what it wants (see the module)."""
        if self.fixed:
            raise ServingError(503, f"model {listed.name!r} is not loaded, and this server loads no other", "model")
        wants = min(self.build.wants(listed), self.budget)
        while self.budget - self.used < wants and await self._unload_one():
            pass
        need = await _on_thread(lambda: facts_of(listed).weight_bytes)
        if self.budget - self.used < need:
            raise self._no_room(listed, f"its weights take {gb(need)}")
        logger.info("loading %s within %s ...", listed.name, gb(self.budget - self.used))
        started = time.perf_counter()
        try:
            loaded = await self._fit(listed, wants)
        except ServingError:
            raise
        except Exception as exc:
            raise ServingError(
                503, f"model {listed.name!r} could not be loaded: {exc}", "model", kind="server_error"
            ) from None
        resident = self.adopt(listed, loaded)
        logger.info("loaded %s in %.1f s: %s", listed.name, time.perf_counter() - started, gb(resident.planned))
        return resident

    async def _fit(self, listed: ListedModel, wants: int) -> Loaded:
        """Build `listed` within what it `wants` of what is free, letting one more idle resident
        go after each try its budget cannot hold, until it fits or none is left (a 503)."""
        while True:
            try:
                return await _on_thread(self.build, listed, min(wants, self.budget - self.used))
            except MemoryBudgetError as exc:
                if not await self._unload_one():
                    raise self._no_room(listed, str(exc)) from None

    def _no_room(self, listed: ListedModel, why: str) -> ServingError:
        holders = ", ".join(f"{r.name} ({gb(r.planned)}, {r.leases} requests)" for r in self.residents.values())
        return ServingError(
            503,
            f"model {listed.name!r} does not fit in the memory budget of {gb(self.budget)} beside the models "
            f"serving requests ({holders or 'none'}): {why}; try again when they are done",
            "model",
            "model_overloaded",
            "overloaded_error",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )

    async def _unload_one(self) -> bool:
        """Unload the least recently used idle resident; whether there was one."""
        name = next((n for n, r in self.residents.items() if r.idle), None)
        if name is not None:
            await self._unload(name)
        return name is not None

    async def _unload(self, name: str) -> None:
        """Let `name` go: its engine stopped, its memory given back (on a thread; its bytes count
        as used until then)."""
        resident = self.residents.pop(name)
        planned = resident.planned
        self._leaving += planned
        try:
            await _on_thread(_stop, resident)
            del resident
            await _on_thread(_collect)
        finally:
            self._leaving -= planned
        self.apply_memory()
        logger.info("unloaded %s", name)

    def apply_memory(self) -> None:
        """MLX's limits for every resident together: the server's budget less the residents'
        buffer caches, which MLX keeps apart (an engine sets its own when it is built)."""
        cache = sum(r.cache for r in self.residents.values())
        mx.set_memory_limit(self.budget - cache)
        mx.set_cache_limit(cache)
        if mx.metal.is_available():
            mx.set_wired_limit(self.budget)

    def abort_all(self) -> int:
        """Abort every running request of every model (see `AsyncLLM.abort_all`); how many."""
        return sum(llm.abort_all() for llm in self.engines.values())

    @property
    def engines(self) -> dict[str, AsyncLLM]:
        """The residents' engines, by name (an encoder has none)."""
        return {name: r.llm for name, r in self.residents.items() if r.llm is not None}

    @property
    def lost(self) -> BaseException | None:
        """Why a resident's tensor-parallel group failed, if one did (the server then ends)."""
        return next((llm.engine.lost for llm in self.engines.values() if llm.engine.lost is not None), None)

    def shutdown(self) -> None:
        """Stop every resident's engine or encoder (at the server's end)."""
        for resident in list(self.residents.values()):
            _stop(resident)


def _embedder(name: str, loaded: Loaded) -> Embedder | None:
    """The embedding path of a model loaded: an encoder's, or an engine's that pools; None for a chat model."""
    if loaded.encoder is not None:
        return Embedder(name, loaded.encoder)
    if loaded.llm is not None and loaded.llm.engine.pooling is not None:
        return Embedder(name, EngineEmbeddings(loaded.llm))
    return None


def _stop(resident: Resident) -> None:
    """Stop a resident's engine and its disk tier (writing what is queued), or its encoder."""
    if resident.encoder is not None:
        resident.encoder.shutdown()
    if resident.llm is not None:
        resident.llm.shutdown()
        disk = resident.llm.engine.cache.disk
        if disk is not None:
            disk.close()
    resident.servings.clear()


def _collect() -> None:
    """Free what nothing holds any more, and MLX's buffers with it."""
    gc.collect()
    mx.clear_cache()


Result = TypeVar("Result")


async def _on_thread(function: Callable[..., Result], *args: Any) -> Result:
    """`function(*args)` on a thread of its own, which ends as MLX wants a thread to end."""
    future: Future[Result] = Future()

    def run() -> None:
        try:
            future.set_result(function(*args))
        except BaseException as exc:
            future.set_exception(exc)
        finally:
            mx.clear_streams()

    threading.Thread(target=run, name="mlxkv-loader", daemon=True).start()
    return await asyncio.wrap_future(future)
