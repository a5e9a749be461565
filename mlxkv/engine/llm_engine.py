"""The engine loop: add requests, step (schedule, run, sample), report outputs."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..attention.kernels import PagedAttentionKernels
from ..cache.pins import Pin
from ..cache.prefix_cache import PrefixCacheStats
from ..config import EngineConfig
from ..deprecation import warn
from ..errors import TensorParallelError, UnknownSequenceError, counted
from ..models.pooling import Pooling
from ..models.structure import vocab_size
from .builder import build_engine
from .images import ImagePrompt, PlacedPrompt, PromptImages, place_images, step_media
from .inputs import embedding_request, encode_prompt, new_request, request_key
from .output_processor import OutputProcessor
from .outputs import RequestOutput
from .parallel.follower import follow
from .parallel.rank_watchdog import RankWatchdog
from .parallel.rank_zero import RankZero
from .parallel.step_plan import PlanChannel, StepPlan
from .recent_outputs import RecentOutputs
from .recovery import StepRecovery
from .request import PENDING, Request, Status
from .sampling.params import SamplingParams
from .sampling.reasoning import ThinkMarkers, reasoning_for
from .sampling.sampler import SamplingFailed, draw
from .scheduler import ScheduledBatch
from .stats import EngineStats

logger = logging.getLogger(__name__)
DISK_WAIT_S = 0.01  # the longest a step with nothing to run waits for a read ahead (a new request waits as long)


@dataclass
class InFlight:
    """A step started on the device whose sampled tokens the host has not read yet."""

    batch: ScheduledBatch  # what it computes
    sampling: list[Request]  # the requests of its rows that sample, in order
    indices: list[int]  # the output number each row samples first (a `PENDING` placeholder until read)
    drafts: list[list[int]]  # each row's draft tokens: it draws `1 + len(draft)` tokens, one row of `tokens` each
    tokens: mx.array  # the draws (lazy until read)
    scored: tuple[mx.array, ...]  # the log-probabilities asked for: chosen, top ids, top values (or none)
    embedding: list[Request]  # the embedding requests whose prompts it ends
    vectors: mx.array | None  # their vectors, a row each (lazy until read); None without any
    launched: float  # seconds from the step's start (drafting included) until its evaluation was started


def _masked_after(request: Request) -> bool:
    """Whether `request`'s mask this step depends on the token still pending from the step before:
    it follows a constraint, or its thinking may have to close within its budget."""
    if not request.num_pending:
        return False
    reasoning = request.reasoning
    free = reasoning.free(request.num_pending) if reasoning is not None else None
    return request.constraint is not None or (free is not None and free <= 0)


NO_DRAWS: tuple[mx.array, tuple[mx.array, ...]] = (mx.array([], mx.uint32), ())  # a step in which no row samples


class Resolved(NamedTuple):
    """What reading a step gave: its requests' outputs, and whether its tokens could be read at all."""

    outputs: list[RequestOutput]
    read: bool


class LLMEngine:
    """Continuous batching over a paged (or contiguous) KV cache for one mlx-lm model.

    Steps are pipelined as mlx-lm's `generate_step` is: each `step` schedules and starts step N
    (one forward pass over the packed batch, sampling, one `mx.async_eval`), feeding each
    continuing request the token step N-1 sampled for it as a lazy array, and only then reads
    step N-1's tokens and hands them to the output processor (EOS, stop strings, max tokens),
    while the device computes step N. A request that turns out to have finished at N-1 drops
    what step N computed for it.

    Threads: `add_request` and `abort` may be called from any thread while another
    thread runs `step`; one lock guards the queues and the pool, and is not held during
    the forward pass, so an abort frees its pages at once. Only the thread calling
    `step` touches MLX.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: TokenizerWrapper,
        config: EngineConfig | None = None,
        kernels: PagedAttentionKernels | None = None,
        group: mx.distributed.Group | None = None,
        shares_memory: bool = False,
        pooling: Pooling | None = None,
    ) -> None:
        """`kernels` replaces MLX's Metal kernels, whatever `config.attention` says (the tests pass
        the kernels running in the CPU simulator). `group`: the tensor-parallel group `model` was
        sharded over (see `models.sharding`); on its rank 0 this engine schedules and sends each
        step's plan, on the others `follow` runs the plans. `shares_memory`: other engines run in
        this process, so MLX's memory limits are left to their host (see `MemoryBudget.apply`).
        `pooling`: the model is an embedding model that pools so (`models.pooling.pooling_of` reads
        a checkpoint's); its embedding requests run beside the others (`add_embedding`)."""
        if pooling is not None and pooling.mode != "last":
            raise ValueError(
                f"pooling: a decoder embedding model runs in the engine with last-token pooling "
                f"(Qwen3-Embedding's), not {pooling.mode!r}"
            )
        self.pooling = pooling
        self.config = config or EngineConfig()
        self.tokenizer = tokenizer
        self.think_markers = ThinkMarkers.of(tokenizer)  # once: reading a 200k vocabulary takes 0.1 s
        self.group = group if group is not None and group.size() > 1 else None
        if pooling is not None and self.group is not None:
            raise ValueError("pooling: tensor parallel runs no embedding models yet; serve it on one process")
        parts = build_engine(model, tokenizer, self.config, kernels, self.group, apply_memory=not shares_memory)
        self.cache, self.memory, self.runner, self.vision = parts.cache, parts.memory, parts.runner, parts.vision
        self.step_time, self.speculator, self.structured = parts.step_time, parts.speculator, parts.structured
        self.scheduler, self.rank_zero = parts.scheduler, parts.rank_zero
        self.vocab_size: int = vocab_size(self.runner.model)
        self.requests: dict[str, Request] = {}
        tokens = self.cache.pool.capacity * self.cache.page_size
        self.recent = (
            RecentOutputs(tokens, tokenizer.decode, tokenizer.bos_token_id) if self.cache.prefix_caching else None
        )
        self.outputs = OutputProcessor(tokenizer, self.scheduler, self.speculator, self.requests, self.recent)
        self.recovery = StepRecovery(self.scheduler, self.cache, self.outputs)
        self._ids = itertools.count()
        self._lock = threading.RLock()
        self.last_step_wait = 0.0  # seconds the last step was blocked in MLX evaluation (the rest: host work)
        self._inflight: InFlight | None = None

    @property
    def max_request_tokens(self) -> int:
        """The most tokens, prompt and output, one request may have: the context, or the whole pool
        if that is smaller."""
        return min(self.cache.max_model_len, self.cache.pool.capacity * self.cache.page_size)

    @property
    def num_waiting(self) -> int:
        """Requests waiting to be admitted, read without the lock (for a server's queue limit)."""
        return len(self.scheduler.waiting)

    def stats(self) -> EngineStats:
        """A snapshot of the requests, the KV cache and the prefix cache, for metrics and front ends."""
        with self._lock:
            return EngineStats.of(self.scheduler, self.cache, self.speculator, self.memory)

    @property
    def prefix_stats(self) -> PrefixCacheStats:
        warn("LLMEngine.prefix_stats", "LLMEngine.stats().prefix_cache")
        return self.scheduler.prefix_stats

    def encode(
        self, prompt: str | Sequence[int] | np.ndarray, cache_salt: str | None = None, templated: bool = False
    ) -> list[int]:
        """Token ids for a prompt given as text or ids: text gets the tokenizer's BOS as in mlx-lm
        (`templated` text, rendered by a chat template, has its special tokens written out and gets
        none), and where it quotes an output of this engine (under `cache_salt`), that output's ids."""
        return encode_prompt(self.tokenizer, prompt, self.vocab_size, self.recent, cache_salt, templated)

    def place_images(self, prompt: ImagePrompt, cache_salt: str | None = None, templated: bool = False) -> PlacedPrompt:
        """`prompt`'s token ids (as `encode` makes its text's) with its images placed in them;
        ValueError for a model that takes no images, or a prompt whose markers and images disagree."""
        if self.vision is None:
            raise ValueError("images: this model takes no images (it has no vision tower mlxkv can run)")
        return place_images(self.tokenizer, self.vision, prompt, self.recent, cache_salt, templated)

    def _check_images(self, images: PromptImages) -> None:
        """Refuse (ValueError) images the step reserve cannot encode, as each is encoded in a step,
        and blocks (Gemma 4's image spans) that a step cannot hold whole with one token more."""
        assert self.vision is not None
        longest = max((end - first for first, end in images.blocks), default=0)
        if longest >= self.scheduler.room:
            raise ValueError(
                f"images: {counted(len(images.images), 'image')}, one with {counted(longest, 'placeholder')} "
                f"that attend each other both ways, need a step of {longest + 1} tokens beside a decode token "
                f"of every other sequence, more than the {self.scheduler.room} that max_num_batched_tokens and "
                "max_num_seqs leave; "
                "send smaller images or raise max_num_batched_tokens"
            )
        need = max(self.vision.encode_bytes(placed.image) for placed in images.images)
        if need > self.memory.reserve:
            biggest = max(placed.image.placeholders.size for placed in images.images)
            raise ValueError(
                f"images: {counted(len(images.images), 'image')}, the largest of {counted(biggest, 'placeholder')}, "
                f"need about {need / 1e9:.2f} GB to encode, more than the step reserve of "
                f"{self.memory.reserve / 1e9:.2f} GB; send smaller images or raise memory_limit"
            )

    def new_request_id(self) -> str:
        """An automatic request id that no live request uses."""
        with self._lock:
            while (request_id := str(next(self._ids))) in self.requests:
                pass
            return request_id

    def add_request(
        self,
        prompt: str | Sequence[int] | ImagePrompt | PlacedPrompt,
        params: SamplingParams | None = None,
        request_id: str | int | None = None,
        cache_salt: str | None = None,
        pin: Pin | None = None,
        continuation: bool = False,
    ) -> Request:
        """Queue a prompt; raises `RequestTooLong` if it could never fit the KV cache, and ValueError
        if its constraint (`params.json_schema`, ...) cannot be compiled. Requests reuse each
        other's cached prefix pages only when their `cache_salt`s are equal. With `pin`, the pages of
        the prompt's first `pin.tokens` tokens stay cached for `pin.ttl_s` seconds once computed
        (see `PrefixPins`). With `continuation` the text continues the prompt's exactly (a
        completion: a first token's leading space kept), else it starts a reply (after a chat
        template: as mlx-lm's detokenizer gives it). A prompt with images is an `ImagePrompt`, or
        one `place_images` placed already."""
        if self.lost is not None:
            raise self.lost
        request_id = self.new_request_id() if request_id is None else request_key(request_id)
        if isinstance(prompt, ImagePrompt):
            prompt = self.place_images(prompt, cache_salt)
        prompt_ids = list(prompt) if isinstance(prompt, PlacedPrompt) else self.encode(prompt, cache_salt)
        request = new_request(
            request_id,
            prompt_ids,
            params,
            cache_salt,
            pin,
            self.max_request_tokens,
            self.tokenizer,
            self.structured,
            continuation,
        )
        request.images = prompt.images if isinstance(prompt, PlacedPrompt) else None
        if request.images is not None:
            self._check_images(request.images)
        if not continuation and self.think_markers is not None:
            request.reasoning = reasoning_for(self.think_markers, request, self.tokenizer.detokenizer)
        return self._queue(request)

    def add_embedding(
        self, prompt: str | Sequence[int], request_id: str | int | None = None, cache_salt: str | None = None
    ) -> Request:
        """Queue an embedding request: its prompt (text, tokenized as sentence-transformers does, with
        the tokenizer's special tokens; or ids) is computed in chunks beside other requests, and its
        last output carries the vector `pooling` makes of its last token's final hidden state.
        ValueError for a model without pooling, `RequestTooLong` for a prompt the cache cannot hold."""
        if self.lost is not None:
            raise self.lost
        if self.pooling is None:
            raise ValueError("input: this model is not an embedding model (its checkpoint declares no pooling)")
        request_id = self.new_request_id() if request_id is None else request_key(request_id)
        ids = self.embedding_ids(prompt)
        request = embedding_request(request_id, ids, cache_salt, self.max_request_tokens, self.tokenizer)
        return self._queue(request)

    def embedding_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """An embedding input's token ids: text tokenized as sentence-transformers does (with the
        tokenizer's special tokens), ids checked against the vocabulary."""
        if not isinstance(prompt, str):
            return self.encode(prompt)
        ids: list[int] = self.tokenizer.encode(prompt, verbose=False)
        return ids

    def _queue(self, request: Request) -> Request:
        """Hand `request` to the scheduler, under an id no live request has."""
        with self._lock:
            if request.request_id in self.requests:
                raise ValueError(f"request id {request.request_id!r} is already in use")
            self.requests[request.request_id] = request
            self.scheduler.add(request)
        return request

    def abort(self, request_id: str | int, missing_ok: bool = False) -> None:
        """Drop a request wherever it is; its pages are free when this returns. An id that is
        not live (unknown, or already finished) raises `UnknownSequenceError` unless `missing_ok`."""
        with self._lock:
            request = self.requests.pop(request_key(request_id), None)
            if request is not None:
                request.drop_pending()
                self.scheduler.finish(request, "abort")
                if self.recent is not None and request.stream is not None:  # a stopped reply may be sent back
                    self.recent.remember(request, whole=False)
            elif not missing_ok:
                raise UnknownSequenceError(request_id)

    def has_unfinished(self) -> bool:
        with self._lock:
            return self.scheduler.has_work() or self._inflight is not None

    def fail_all(self, error: Exception) -> list[RequestOutput]:
        """End every unfinished request with `error` (for a failure no request can be blamed for)."""
        with self._lock:
            return [self.outputs.fail(request, error) for request in list(self.requests.values())]

    def step(self) -> list[RequestOutput]:
        """Start the next batch, then return an output for every request whose token from the
        batch before produced text or finished it.

        A step that fails (in the forward pass, sampling or evaluation) changes nothing for
        the requests that did not cause it: see `StepRecovery`.
        """
        with self.rank_zero.step():
            return self._step()

    def _step(self) -> list[RequestOutput]:
        self.last_step_wait = 0.0
        with self._lock:
            previous, self._inflight = self._inflight, None
            self.cache.expire_pins()
            speculator, budget = self.speculator, self.config.max_num_batched_tokens
            running, waiting = self.scheduler.running, bool(self.scheduler.waiting)
            drafting = speculator.step_lengths(running, waiting, budget) if speculator is not None else {}
        outputs: list[RequestOutput] | None = None
        if previous is not None and (drafting or any(previous.drafts)):  # drafts need every token known
            outputs, previous = self._resolve(previous).outputs, None
        started = time.perf_counter()
        if speculator is not None and drafting:  # without the lock: a draft model runs here
            live = [r for r in drafting if r.status is Status.RUNNING and r.is_decode]
            speculator.propose(live, [drafting[r] for r in live])
        with self._lock:
            batch = self.scheduler.schedule()
        failed, read = self._launch(batch, previous, started) if batch is not None else ([], None)
        if batch is None and previous is None and self.cache.disk is not None:
            self.cache.disk.wait(DISK_WAIT_S)  # requests wait for their pages from disk: no step to spin on
        if outputs is None:
            outputs = read if read is not None else self._resolve(previous).outputs if previous is not None else []
        with self._lock:
            current = self._inflight
            if current is not None:  # its K/V are queued, and its input tokens now all known
                self.scheduler.commit(current.batch)
            if not self.config.pipeline:
                self._inflight = None
        if current is not None and not self.config.pipeline:
            outputs += self._resolve(current).outputs
        return outputs + failed

    def _launch(
        self, batch: ScheduledBatch, previous: InFlight | None, started: float
    ) -> tuple[list[RequestOutput], list[RequestOutput] | None]:
        """Build `batch`'s forward pass and sampling and start evaluating them (the step having
        started at `started`, drafting included); returns the outputs of the requests that failed
        to (none when it started), and `previous`' outputs when it had to be read first (else None)."""
        sampling = [r for r, s in zip(batch.requests, batch.samples) if s]
        embedding = [r for r, p in zip(batch.requests, batch.pools) if p]
        drafts = [d for d, s in zip(batch.drafts, batch.samples) if s]
        indices = [len(r.output_ids) for r in sampling]  # the output number each row samples first
        read: list[RequestOutput] | None = None
        try:
            samples = sum(1 + len(d) for d in drafts)
            media = step_media(self.vision, batch.requests, batch.counts, batch.kv.positions, self.memory.reserve)
            plan = StepPlan.of(batch, previous.sampling if previous else [], samples, media)
            hidden = self.rank_zero.forward(self.runner, plan, previous.tokens if previous else None)
            logits = self.runner.logits(batch, hidden)  # None when no row samples
            vectors = self._vectors(batch, hidden)
            if batch.snapshots:
                self.cache.capture(batch.snapshots)
            resolved = self._read_for_masks(logits, batch, sampling, previous)
            read = resolved.outputs if resolved is not None else None
            if resolved is not None and not resolved.read:  # `previous` failed; this batch read its tokens
                self.rank_zero.settle()
                return [], read
            tokens, scored = (
                draw(logits, sampling, indices, drafts, self.structured) if logits is not None else NO_DRAWS
            )
            if logits is not None:
                tokens = self.rank_zero.share(tokens)
            waiting = time.perf_counter()
            pooled = () if vectors is None else (vectors,)
            self.cache.evaluate(tokens, *scored, *pooled, wait=False)  # on a CPU build this runs most of the graph
            self.last_step_wait += time.perf_counter() - waiting
        except SamplingFailed as exc:
            self.rank_zero.settle()
            return self._undo(batch.requests, [sampling[exc.row]], exc.cause), read
        except TensorParallelError:
            raise
        except Exception as exc:
            self.rank_zero.settle()
            return self._undo(batch.requests, None, exc), read
        except BaseException:  # e.g. Ctrl-C: undo the step, fail no request, let it through
            self.rank_zero.settle()
            self._undo(batch.requests, [], None)
            raise
        with self._lock:
            for request in sampling:
                if request.status is not Status.FINISHED:  # not aborted since it was scheduled
                    request.append_output(PENDING)
            launched = time.perf_counter() - started
            self._inflight = InFlight(batch, sampling, indices, drafts, tokens, scored, embedding, vectors, launched)
        return [], read

    def _vectors(self, batch: ScheduledBatch, hidden: mx.array) -> mx.array | None:
        """The vectors of the embedding requests whose prompts `batch` ends (lazy); None without any."""
        rows = self.runner.pooled_rows(batch, hidden)
        if rows is None:
            return None
        assert self.pooling is not None
        return self.pooling.finish(rows)

    def _read_for_masks(
        self, logits: mx.array | None, batch: ScheduledBatch, sampling: list[Request], previous: InFlight | None
    ) -> Resolved | None:
        """A constrained row's mask (a lazy one's too: was its last token the trigger?) needs every
        earlier token of its request: when one's last token comes from `previous`, start this step's
        forward pass and read `previous` while it runs (its tokens accepted, the constraints
        advanced). None when no row has to wait."""
        if logits is None or previous is None or not any(_masked_after(r) for r in sampling):
            return None
        self.cache.evaluate(logits, wait=False)
        return self._resolve(previous, batch.requests)

    def _resolve(self, step: InFlight, later: list[Request] | None = None) -> Resolved:
        """Read `step`'s tokens (waiting for the device) and accept them; if they could not be read,
        the requests of the step after it (in flight, or `later`, being launched), which read them,
        are undone too."""
        try:
            started = time.perf_counter()
            pooled = () if step.vectors is None else (step.vectors,)
            mx.eval(step.tokens, *step.scored, *pooled)
            waited = time.perf_counter() - started
            self.last_step_wait += waited
            sampled = cast("list[int]", step.tokens.tolist())
            scored = [cast("list[list[Any]]", a.tolist()) for a in step.scored]
            vectors = cast("list[list[float]]", step.vectors.tolist()) if step.vectors is not None else []
        except Exception as exc:
            if isinstance(self.rank_zero, RankZero):  # the other ranks ran this step: it cannot be undone alone
                raise self.rank_zero.failed(exc) from exc
            return Resolved(self._recover_pipeline(step, exc, later or []), False)
        except BaseException:
            self._recover_pipeline(step, None, later or [])
            raise
        now = time.perf_counter()
        with self._lock:
            kv = step.batch.kv
            attended = int(np.dot(kv.query_lens, kv.context_lens))
            self.step_time.record(kv.num_tokens, attended, step.launched + waited)  # why: see `StepTime`
            self.recovery.out_of_memory = 0
            rows = list(zip(step.sampling, step.indices, step.drafts))
            outputs = self.outputs.accept_step(rows, sampled, scored, now)
            return Resolved(outputs + self.outputs.accept_vectors(step.embedding, vectors, now), True)

    def _undo(
        self, batch: list[Request], culprits: list[Request] | None, error: Exception | None
    ) -> list[RequestOutput]:
        """Undo a failed step (see `StepRecovery`)."""
        with self._lock:
            return self.recovery.undo(batch, culprits, error)

    def _recover_pipeline(self, step: InFlight, error: Exception | None, later: list[Request]) -> list[RequestOutput]:
        """`step` failed to evaluate, and so did the step started after it (in flight, or being
        launched for `later`), which read its tokens: both are undone (their placeholders
        dropped) and `step`'s requests fail."""
        with self._lock:
            inflight, self._inflight = self._inflight, None
            undone = step.batch.requests + (inflight.batch.requests if inflight else later)
            for request in undone:
                request.drop_pending()
            return self.recovery.undo(list(dict.fromkeys(undone)), step.batch.requests if error else [], error)

    @property
    def lost(self) -> TensorParallelError | None:
        """Why this engine's tensor-parallel group cannot go on, once it cannot (rank 0)."""
        return self.rank_zero.lost

    @property
    def rank(self) -> int:
        """This process's rank in its tensor-parallel group (0 when alone)."""
        return self.group.rank() if self.group is not None else 0

    @property
    def group_size(self) -> int:
        return self.group.size() if self.group is not None else 1

    def follow(self) -> None:
        """Run the plans rank 0 sends until it stops (on every rank but 0)."""
        assert self.group is not None and self.rank != 0
        watchdog = RankWatchdog(self.config.rank_timeout_s, lambda error: None, f"rank {self.rank}", "rank 0")
        follow(self.runner, PlanChannel(self.group), watchdog)

    def rest(self) -> float | None:
        """Called by an engine thread with no request to run: on rank 0 of a tensor-parallel group,
        the other ranks nap instead of polling for the next plan (see `parallel.naps`). Returns how
        long to wait for a request before calling again (None: as long as it takes)."""
        return self.rank_zero.rest()

    def stop_followers(self) -> None:
        """Tell the other ranks that rank 0 is done (they return from `follow`); called at exit if
        not before. The engine runs no more steps."""
        self.rank_zero.stop()
