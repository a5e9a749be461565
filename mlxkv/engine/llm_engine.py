"""The engine loop: add requests, step (schedule, run, sample, detokenize), report outputs."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..attention.backend import planned_temporary_bytes, temporary_bytes_of
from ..attention.kernels import PagedAttentionKernels
from ..attention.reference import reference_attention
from ..cache.pins import Pin
from ..cache.prefix_cache import PrefixCacheStats, check_salt
from ..config import EngineConfig
from ..deprecation import warn
from ..errors import MlxkvError, RequestTooLong, TensorParallelError, UnknownSequenceError, is_out_of_memory
from ..models.structure import held_arrays, text_model
from .inputs import encode_prompt, request_key
from .memory.chunk_sizing import ChunkSizer
from .memory.kv_budget import agreed, build_kv_cache
from .memory.memory_budget import plan_memory
from .memory.step_memory import StepMemory
from .memory.step_time import StepTime
from .model_kv import attention_for, attention_heads, model_kv
from .model_runner import ModelRunner
from .outputs import RequestOutput, Usage
from .parallel.follower import follow
from .parallel.rank_zero import RankZero
from .parallel.step_plan import PlanChannel, StepPlan, check_tensor_parallel
from .request import PENDING, Request, Status
from .sampling.params import SamplingParams
from .sampling.sampler import SamplingFailed, TokenLogprob, logprobs, sample
from .sampling.structured_output import StructuredOutput
from .sampling.text import TextStream
from .scheduler import ScheduledBatch, Scheduler
from .speculative.draft_model import DraftModel
from .speculative.prompt_lookup import PromptLookup
from .speculative.speculation import Speculator, accepted_prefix
from .stats import EngineStats

logger = logging.getLogger("mlxkv")
OUT_OF_MEMORY_RETRIES = 4  # steps in a row that may run out of memory before their requests fail


@dataclass
class InFlight:
    """A step started on the device whose sampled tokens the host has not read yet. Row i of
    `sampling` draws `1 + len(drafts[i])` tokens, from its output number `indices[i]` (a `PENDING`
    placeholder until read) on, one row of `tokens` each: a speculating row's draws where its
    draft tokens were proposed, and one past them."""

    batch: ScheduledBatch
    sampling: list[Request]
    indices: list[int]
    drafts: list[list[int]]
    tokens: mx.array
    scored: tuple[mx.array, ...]
    launched: float  # seconds from the step's start (drafting included) until its evaluation was started

    @property
    def positions(self) -> list[Request]:
        """The request of each row of `tokens`."""
        return [r for r, d in zip(self.sampling, self.drafts) for _ in range(1 + len(d))]


class LLMEngine:
    """Continuous batching over a paged (or contiguous) KV cache for one mlx-lm model.

    Steps are pipelined as mlx-lm's `generate_step` is: each `step` schedules and starts step N
    (one forward pass over the packed batch, sampling, one `mx.async_eval`), feeding each
    continuing request the token step N-1 sampled for it as a lazy array, and only then reads
    step N-1's tokens, accepts them (EOS, stop strings, max tokens) and returns their outputs,
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
    ) -> None:
        """`kernels` replaces MLX's Metal kernels, whatever `config.attention` says (the tests pass
        the kernels running in the CPU simulator). `group`: the tensor-parallel group `model` was
        sharded over (see `models.sharding`); on its rank 0 this engine schedules and sends each
        step's plan, on the others `follow` runs the plans."""
        self.config = config or EngineConfig()
        self.tokenizer = tokenizer
        self.group = group if group is not None and group.size() > 1 else None
        model = text_model(model)
        shape = model_kv(model)
        if self.group is not None:
            check_tensor_parallel(shape)
        draft = DraftModel.checkpoint(self.config, tokenizer) if self.config.draft_model is not None else None
        planned = StepMemory.of(model, attention_heads(model), planned_temporary_bytes(self.config.attention, kernels))
        self.memory, plan = plan_memory(self.config, shape, planned, draft[1] if draft is not None else None)
        if self.group is not None:
            plan = agreed(plan, self.group)
        self.cache = build_kv_cache(self.config, shape, plan)
        attention = attention_for(model, self.cache, self.config.attention, kernels)
        self.memory.apply()
        logger.info(
            "KV cache: %s; attention: %s; memory: %s",
            self.cache.usage(),
            "reference" if attention is reference_attention else "Metal kernels",
            self.memory,
        )
        self.runner = ModelRunner(model, self.cache, attention)
        # Whichever thread steps the engine: nothing it was built with is a lazy graph of this one's.
        mx.eval(held_arrays(model), held_arrays(draft[0]) if draft is not None else [])
        self.rank_zero: RankZero | None = None  # this process schedules a tensor-parallel group
        if self.group is not None and self.group.rank() == 0:
            self.rank_zero = RankZero(self.group, self.config.rank_timeout_s)
        self.vocab_size = model.args.vocab_size
        self.step_time = StepTime()
        self.speculator = self._speculator(draft[0] if draft is not None else None, kernels)
        self.structured = StructuredOutput(tokenizer, model.args.vocab_size)
        itl = self.config.max_itl_ms
        sizer = ChunkSizer(
            replace(planned, attention=temporary_bytes_of(attention)),
            self.memory.reserve,
            self.step_time,
            itl / 1000 if itl else None,
            self.config.max_itl_factor or None,
        )
        self.scheduler = Scheduler(self.cache, self.config.max_num_seqs, self.config.max_num_batched_tokens, sizer)
        self.requests: dict[str, Request] = {}
        self.reset_peak_usage()
        self._ids = itertools.count()
        self._lock = threading.RLock()
        self.last_step_wait = 0.0  # seconds the last step was blocked in MLX evaluation (the rest: host work)
        self._inflight: InFlight | None = None
        self._out_of_memory = 0  # steps run out of memory in a row

    def _speculator(self, draft: nn.Module | None, kernels: PagedAttentionKernels | None) -> Speculator | None:
        """The speculative decoding `config` asks for, if any (`draft`: the draft model's, loaded); a
        hybrid model's recurrent state cannot be rewound past rejected draft tokens, so it cannot
        speculate."""
        config = self.config
        if not config.prompt_lookup and config.draft_model is None:
            return None
        name = "prompt_lookup" if config.prompt_lookup else "draft_model"
        if self.cache.states is not None:
            raise ValueError(
                f"speculative decoding ({name}) needs a model whose every layer keeps K/V; this one has "
                "recurrent layers, whose state cannot be rewound past rejected draft tokens"
            )
        if draft is None:
            return Speculator(PromptLookup(), config.num_draft_tokens, self.step_time)
        drafter = DraftModel.build(config, draft, self.cache, self.vocab_size, kernels)
        return Speculator(drafter, config.num_draft_tokens, self.step_time)

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
            return EngineStats(
                len(self.scheduler.running),
                len(self.scheduler.waiting),
                self.scheduler.num_preemptions,
                self.cache.usage(),
                self.cache.prefix_caching,
                replace(self.scheduler.prefix_stats),
                self.speculator.stats if self.speculator is not None else None,
                self.memory,
                mx.get_peak_memory(),
            )

    @property
    def prefix_stats(self) -> PrefixCacheStats:
        warn("LLMEngine.prefix_stats", "LLMEngine.stats().prefix_cache")
        return self.scheduler.prefix_stats

    def encode(self, prompt: str | Sequence[int] | np.ndarray) -> list[int]:
        """Token ids for a prompt given as text or ids (text gets the tokenizer's BOS, as in mlx-lm)."""
        return encode_prompt(self.tokenizer, prompt, self.vocab_size)

    def new_request_id(self) -> str:
        """An automatic request id that no live request uses."""
        with self._lock:
            while (request_id := str(next(self._ids))) in self.requests:
                pass
            return request_id

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | int | None = None,
        cache_salt: str | None = None,
        pin: Pin | None = None,
    ) -> Request:
        """Queue a prompt; raises `RequestTooLong` if it could never fit the KV cache, and ValueError
        if its constraint (`params.json_schema`, ...) cannot be compiled. Requests reuse each
        other's cached prefix pages only when their `cache_salt`s are equal. With `pin`, the pages of
        the prompt's first `pin.tokens` tokens stay cached for `pin.ttl_s` seconds once computed
        (see `PrefixPins`)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if pin is not None and not isinstance(pin, Pin):
            raise TypeError(f"pin must be a Pin or None, got {type(pin).__name__}")
        if self.lost is not None:
            raise self.lost
        request = Request(
            self.new_request_id() if request_id is None else request_key(request_id),
            self.encode(prompt),
            params,
            check_salt(cache_salt),
            pin,
        )
        if request.max_length > self.max_request_tokens:
            raise RequestTooLong(
                f"prompt of {len(request.prompt_ids)} tokens plus max_tokens={params.max_tokens} makes "
                f"{request.max_length} tokens; one request can have at most {self.max_request_tokens}"
            )
        request.stream = TextStream(self.tokenizer.detokenizer, params.stop)
        request.matcher = self.structured.matcher(params)
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
            elif not missing_ok:
                raise UnknownSequenceError(request_id)

    def has_unfinished(self) -> bool:
        with self._lock:
            return self.scheduler.has_work() or self._inflight is not None

    def step(self) -> list[RequestOutput]:
        """Start the next batch, then return an output for every request whose token from the
        batch before produced text or finished it.

        A step that fails (in the forward pass, sampling or evaluation) changes nothing for
        the requests that did not cause it: see `_recover`.
        """
        if self.rank_zero is None:
            return self._step()
        with self.rank_zero.step():
            return self._step()

    def _step(self) -> list[RequestOutput]:
        self.last_step_wait = 0.0
        with self._lock:
            previous, self._inflight = self._inflight, None
            self.cache.expire_pins()
            drafting = self._draft_lengths()
        outputs: list[RequestOutput] | None = None
        if previous is not None and (drafting or any(previous.drafts)):  # drafts need every token known
            outputs, previous = self._resolve(previous)[0], None
        started = time.perf_counter()
        if drafting:  # without the lock: a draft model runs here
            self._propose(drafting)
        with self._lock:
            batch = self.scheduler.schedule()
            if batch is not None:
                self._track_usage()
        failed, read = self._launch(batch, previous, started) if batch is not None else ([], None)
        if outputs is None:
            outputs = read if read is not None else self._resolve(previous)[0] if previous is not None else []
        with self._lock:
            current = self._inflight
            if current is not None:  # its K/V are queued, and its input tokens now all known
                self.scheduler.commit(current.batch)
            if not self.config.pipeline:
                self._inflight = None
        if current is not None and not self.config.pipeline:
            outputs += self._resolve(current)[0]
        return outputs + failed

    def _draft_lengths(self) -> dict[Request, int]:
        """How many draft tokens each running decode request proposes in the next step (those
        proposing any), as `Speculator.lengths` decides."""
        if self.speculator is None:
            return {}
        decode = [r for r in self.scheduler.running if r.is_decode and not r.done_sampling]
        prefill = sum(r.num_remaining for r in self.scheduler.running if not r.is_decode)
        budget = self.config.max_num_batched_tokens - len(decode)
        other = min(budget, prefill + (budget if self.scheduler.waiting else 0))
        return self.speculator.lengths(decode, other)

    def _propose(self, lengths: dict[Request, int]) -> None:
        """Give each request still decoding its draft tokens, cut at the first its constraint forbids.
        A drafter that fails costs this step its drafts, never a request: it starts afresh."""
        assert self.speculator is not None
        live = [r for r in lengths if r.status is Status.RUNNING and r.is_decode]
        try:
            self.speculator.propose(live, [lengths[r] for r in live])
        except Exception as exc:
            logger.warning("drafting failed (%s); this step runs without draft tokens", exc)
            for request in live:
                request.draft = []
            self.speculator.drafter.reset()
        for request in live:
            if request.matcher is not None and request.draft:
                del request.draft[request.matcher.validate_tokens(request.draft) :]

    def _launch(
        self, batch: ScheduledBatch, previous: InFlight | None, started: float
    ) -> tuple[list[RequestOutput], list[RequestOutput] | None]:
        """Build `batch`'s forward pass and sampling and start evaluating them (the step having
        started at `started`, drafting included); returns the outputs of the requests that failed
        to (none when it started), and `previous`' outputs when it had to be read first (else None).

        A constrained row's mask needs every earlier token of its request, so when one's last
        token comes from `previous`, the forward pass is started, `previous` read while it runs
        (its tokens accepted, the matchers advanced), and only then the sampling built."""
        sampling = [r for r, s in zip(batch.requests, batch.samples) if s]
        drafts = [d for d, s in zip(batch.drafts, batch.samples) if s]
        indices = [len(r.output_ids) for r in sampling]  # the output number each row samples first
        widths = [1 + len(d) for d in drafts]
        firsts = np.cumsum(widths) - widths  # each row's first row of logits
        read: list[RequestOutput] | None = None
        try:
            hidden = self._forward(self._plan(batch, previous, sum(widths)), previous)
            logits = self.runner.logits(batch, hidden)  # None when no row samples
            if batch.snapshots:
                self.cache.capture(batch.snapshots)
            constrained = [row for row, request in enumerate(sampling) if request.matcher is not None]
            if constrained and logits is not None:
                if previous is not None and any(sampling[row].num_pending for row in constrained):
                    self.cache.evaluate(logits, wait=False)
                    read, ok = self._resolve(previous, batch.requests)
                    if not ok:  # `previous` failed, and this batch, which read its tokens, is undone
                        self._settle()
                        return [], read
                logits = self.structured.masked(
                    logits, [(sampling[row].matcher, int(firsts[row]), drafts[row]) for row in constrained]
                )
            tokens = (
                sample(
                    logits,
                    [r.sampler for r, w in zip(sampling, widths) for _ in range(w)],
                    [n + i for n, w in zip(indices, widths) for i in range(w)],
                )
                if logits is not None
                else mx.array([], mx.uint32)
            )
            if self.rank_zero is not None and logits is not None:
                tokens = self.rank_zero.share(tokens)
            wanted = [r.params.logprobs for r in sampling if r.params.logprobs is not None]
            scored = logprobs(logits, tokens, max(wanted)) if logits is not None and wanted else ()
            waiting = time.perf_counter()
            self.cache.evaluate(tokens, *scored, wait=False)  # on a CPU build this runs most of the graph
            self.last_step_wait += time.perf_counter() - waiting
        except SamplingFailed as exc:
            self._settle()
            return self._recover(batch.requests, [sampling[exc.row]], exc.cause), read
        except TensorParallelError:
            raise
        except Exception as exc:
            self._settle()
            return self._recover(batch.requests, None, exc), read
        except BaseException:  # e.g. Ctrl-C: undo the step, fail no request, let it through
            self._settle()
            self._recover(batch.requests, [], None)
            raise
        with self._lock:
            for request in sampling:
                if request.status is not Status.FINISHED:  # not aborted since it was scheduled
                    request.append_output(PENDING)
            launched = time.perf_counter() - started
            self._inflight = InFlight(batch, sampling, indices, drafts, tokens, scored, launched)
        return [], read

    def _forward(self, plan: StepPlan, previous: InFlight | None) -> mx.array:
        """The final hidden states of `plan`'s batch (lazy; under tensor parallel, see `RankZero.forward`)."""
        tokens = previous.tokens if previous is not None else None
        if self.rank_zero is None:
            return self.runner.hidden(plan.inputs(tokens), plan.kv, plan.own_kv)
        return self.rank_zero.forward(self.runner, plan, tokens)

    def _settle(self) -> None:
        """A step failed on rank 0: the other ranks still get its tokens (see `RankZero.settle`)."""
        if self.rank_zero is not None:
            self.rank_zero.settle()

    @property
    def lost(self) -> TensorParallelError | None:
        """Why this engine's tensor-parallel group cannot go on, once it cannot (rank 0)."""
        return self.rank_zero.lost if self.rank_zero is not None else None

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
        follow(self.runner, PlanChannel(self.group))

    def stop_followers(self) -> None:
        """Tell the other ranks that rank 0 is done (they return from `follow`); called at exit if
        not before. The engine runs no more steps."""
        if self.rank_zero is not None:
            self.rank_zero.stop()

    @staticmethod
    def _plan(batch: ScheduledBatch, previous: InFlight | None, samples: int) -> StepPlan:
        """The batch's forward pass as a plan: its input tokens packed, those still `PENDING` to be
        taken from the step before, which sampled them."""
        host = np.fromiter(
            itertools.chain.from_iterable(
                r.pending(n - len(d)) + d for r, n, d in zip(batch.requests, batch.counts, batch.drafts)
            ),
            np.int32,
        )
        pending = np.flatnonzero(host == PENDING).astype(np.int32)
        sources = np.zeros(0, np.int32)
        if pending.size:
            assert previous is not None  # only the step before samples a token its successor reads
            rows = {id(r): i for i, r in enumerate(previous.sampling)}
            owners = np.repeat(np.arange(len(batch.requests)), batch.counts)[pending]
            sources = np.array([rows[id(batch.requests[o])] for o in owners], np.int32)
            host[pending] = 0
        return StepPlan(host, batch.kv, np.asarray(batch.own_kv, np.int32), pending, sources, samples)

    def _resolve(self, step: InFlight, later: list[Request] | None = None) -> tuple[list[RequestOutput], bool]:
        """Read `step`'s tokens (waiting for the device) and accept them; False if they could not
        be read, in which case the requests of the step after it (in flight, or `later`, being
        launched), which read them, are undone too."""
        try:
            started = time.perf_counter()
            mx.eval(step.tokens, *step.scored)
            waited = time.perf_counter() - started
            self.last_step_wait += waited
            sampled = cast("list[int]", step.tokens.tolist())
            scored = [cast("list[list[Any]]", a.tolist()) for a in step.scored]
        except Exception as exc:
            if self.rank_zero is not None:  # the other ranks ran this step: it cannot be undone alone
                raise self.rank_zero.failed(exc) from exc
            return self._recover_pipeline(step, exc, later or []), False
        except BaseException:
            self._recover_pipeline(step, None, later or [])
            raise
        now = time.perf_counter()
        with self._lock:
            kv = step.batch.kv
            attended = int(np.dot(kv.query_lens, kv.context_lens))
            self.step_time.record(kv.num_tokens, attended, step.launched + waited)  # why: see `StepTime`
            self._out_of_memory = 0
            scores = _token_logprobs(step.positions, sampled, scored)
            outputs, first = [], 0
            for request, index, draft in zip(step.sampling, step.indices, step.drafts):
                row, first = slice(first, first + 1 + len(draft)), first + 1 + len(draft)
                if request.status is not Status.FINISHED:
                    outputs.append(self._verify(request, index, draft, sampled[row], scores[row], now))
            return outputs, True

    def _verify(
        self, request: Request, index: int, draft: list[int], sampled: list[int], scores: list[Any], now: float
    ) -> RequestOutput:
        """Accept a row's draws from output number `index` on: its first draw, and one more for
        each draft token equal to the draw before it (the drafts so accepted are computed: their
        K/V stay; the rest are given back)."""
        if not draft:
            return self._accept(request, index, sampled, scores, now)
        assert self.speculator is not None
        accepted = accepted_prefix(draft, sampled)
        self.speculator.record(request, len(draft), accepted)
        output = self._accept(request, index, sampled[: accepted + 1], scores[: accepted + 1], now)
        if request.status is Status.RUNNING:
            self.scheduler.commit_verified(request, 1 + accepted)
        return output

    def fail_all(self, error: Exception) -> list[RequestOutput]:
        """End every unfinished request with `error` (for a failure no request can be blamed for)."""
        with self._lock:
            return [self._fail(request, error) for request in list(self.requests.values())]

    def _recover_pipeline(self, step: InFlight, error: Exception | None, later: list[Request]) -> list[RequestOutput]:
        """`step` failed to evaluate, and so did the step started after it (in flight, or being
        launched for `later`), which read its tokens: both are undone (their placeholders
        dropped) and `step`'s requests fail."""
        with self._lock:
            inflight, self._inflight = self._inflight, None
            undone = step.batch.requests + (inflight.batch.requests if inflight else later)
            for request in undone:
                request.drop_pending()
            return self._recover(list(dict.fromkeys(undone)), step.batch.requests if error else [], error)

    def _recover(
        self, batch: list[Request], culprits: list[Request] | None, error: Exception | None
    ) -> list[RequestOutput]:
        """Undo a failed step, then fail the requests that caused it (all of `batch` when that
        cannot be told).

        The batch's requests go back to the waiting queue as if preempted: their pages are
        freed, so K/V the step may have half-written is never read, and they recompute to
        the same tokens (sampling keys depend only on a request's seed and progress; with
        quantized pages, a recompute that finds only part of its pages cached attends
        quantized K/V where it first attended its own, see `Scheduler.own_kv_span`). If the
        KV tensors themselves cannot be evaluated any more, every running request is rolled
        back and the tensors start afresh, and so does the prefix cache whose pages they held.
        """
        with self._lock:
            self.scheduler.roll_back(batch)
            try:
                self.cache.evaluate()
            except Exception:
                self.scheduler.roll_back(list(self.scheduler.running))
                self.cache.reset()
            if error is None:  # interrupted, not failed
                return []
            if is_out_of_memory(error) and self._out_of_memory < OUT_OF_MEMORY_RETRIES:
                self._retry_smaller(error)
                return []
            failed = batch if culprits is None else culprits
            return [self._fail(r, error) for r in failed if r.status is not Status.FINISHED]

    def _retry_smaller(self, error: Exception) -> None:
        """After a step ran out of memory (and was undone): halve the step reserve that prefill chunks
        are cut to and free MLX's buffer cache, so the requests retry in smaller steps."""
        self._out_of_memory += 1
        sizer = self.scheduler.sizer
        self.scheduler.sizer = sizer.cut()
        mx.clear_cache()
        logger.warning(
            "a step ran out of memory (%s); it was undone and its requests retry, with prefill chunks "
            "cut to fit %s bytes of temporaries",
            error,
            self.scheduler.sizer.reserve,
        )

    def _fail(self, request: Request, error: Exception) -> RequestOutput:
        request.error = error
        return self._finish(request, "error")

    def _accept(self, request: Request, index: int, tokens: list[int], scores: list[Any], now: float) -> RequestOutput:
        """Make `tokens`, read at time `now`, outputs number `index`, `index + 1`, ... (the first
        in its placeholder), and end the request at the first that finishes it (dropping what
        comes after, and what a later step computed for it)."""
        if request.first_token_time is None:
            request.first_token_time = now
        for count, token in enumerate(tokens):
            reason = self._take(request, index + count, token)
            if reason is not None:
                kept = count + (reason not in ("eos", "error"))
                return self._finish(
                    request, "stop" if reason == "eos" else reason, tuple(tokens[:kept]), _present(scores[:kept])
                )
        return self._output(request, tuple(tokens), _present(scores))

    def _take(self, request: Request, index: int, token: int) -> str | None:
        """Make `token` output number `index` (its placeholder, or the next output); the reason it
        ends the request, if it does ("eos": the token is not an output)."""
        if token in self.tokenizer.eos_token_ids and not request.params.ignore_eos:
            request.truncate_outputs(index)
            return "eos"
        if index < len(request.output_ids):
            request.set_output(index, token)
        else:
            request.append_output(token)
        matcher = request.matcher
        if matcher is not None and not matcher.consume_token(token):  # the mask allowed it: a bug
            request.error = MlxkvError(f"structured output failed: {matcher.get_error()}")
            return "error"
        assert request.stream is not None  # every request the engine admits has its stream
        if request.stream.add(token):
            request.truncate_outputs(index + 1)
            return "stop"
        if matcher is not None and matcher.is_stopped():  # its constraint allows nothing more
            return "stop"
        if index + 1 >= request.params.max_tokens:
            return "length"
        return None

    def _finish(
        self, request: Request, reason: str, token_ids: tuple[int, ...] = (), scores: tuple[TokenLogprob, ...] = ()
    ) -> RequestOutput:
        request.drop_pending()
        if self.speculator is not None:
            self.speculator.drafter.forget(request)
        assert request.stream is not None
        request.stream.finish()
        request.finish_time = time.perf_counter()
        self.scheduler.finish(request, reason)
        del self.requests[request.request_id]
        return self._output(request, token_ids, scores)

    @staticmethod
    def _output(
        request: Request, token_ids: tuple[int, ...] = (), scores: tuple[TokenLogprob, ...] = ()
    ) -> RequestOutput:
        usage = Usage(
            len(request.prompt_ids), request.num_outputs, request.num_cached_tokens or 0, request.pinned_tokens or 0
        )
        assert request.stream is not None
        return RequestOutput(
            request.request_id,
            request.stream.take_delta(),
            request.status is Status.FINISHED,
            request.finish_reason,
            request.error,
            token_ids,
            scores,
            usage,
            request.stream.stop_string,
        )

    def reset_peak_usage(self) -> None:
        """Start tracking the KV cache's peak use afresh (e.g. per chat turn)."""
        self.peak_usage = self.cache.usage()

    def _track_usage(self) -> None:
        """Keep the usage snapshot of the step holding the most pages (summing tokens over every
        sequence only when it may be one)."""
        if self.cache.pool.used_count >= self.peak_usage.pages_used:
            self.peak_usage = self.cache.usage()


def _present(scores: list[TokenLogprob | None]) -> tuple[TokenLogprob, ...]:
    """The log-probabilities asked for (a request that asked none has None for each token)."""
    return tuple(score for score in scores if score is not None)


def _token_logprobs(sampling: list[Request], tokens: list[int], scored: list[list[Any]]) -> list[TokenLogprob | None]:
    """Each sampled row's `TokenLogprob`, for the requests that asked (None for the others)."""
    if not scored:
        return [None] * len(sampling)
    chosen, ids, values = scored
    return [
        None
        if r.params.logprobs is None
        else TokenLogprob(
            token, chosen[row], tuple(sorted(zip(ids[row], values[row]), key=lambda p: -p[1])[: r.params.logprobs])
        )
        for row, (r, token) in enumerate(zip(sampling, tokens))
    ]
