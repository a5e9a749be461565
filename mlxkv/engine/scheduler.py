"""Which requests run in the next step, and how many of their tokens, within pages and budget."""

from __future__ import annotations

import itertools
import logging
from collections import deque
from dataclasses import dataclass, field

from ..cache.batch import KVBatch
from ..cache.manager import KVCacheManager
from ..cache.prefix_cache import Marks, PrefixCacheStats
from .memory.chunk_sizing import ChunkSizer, StepShape
from .request import NO_SEQUENCE, Request, Status

logger = logging.getLogger("mlxkv")
HOLD_STEPS = 8  # steps a prompt's first token may wait for the prompts beside it (see `Scheduler.schedule`)


@dataclass(frozen=True)
class ScheduledBatch:
    """One engine step: `counts[i]` tokens of `requests[i]`, K/V slots already reserved.
    `samples[i]`: row i reaches the end of its tokens this step and so needs a next token.
    `pools[i]`: row i ends an embedding request's prompt, whose last hidden state is pooled.
    `own_kv[i]`: how many of row i's first tokens attend their own K/V unquantized (see
    `Scheduler.own_kv_span`). `snapshots`: the sequences of a hybrid model whose row ends at their
    snapshot point, whose recurrent state the step keeps for the prefix cache. `drafts[i]`: the
    draft tokens that follow row i's last token in it (a speculating decode row), else none."""

    requests: list[Request]
    counts: list[int]
    kv: KVBatch
    samples: list[bool]
    pools: list[bool]
    own_kv: list[int]
    snapshots: list[int]
    drafts: list[list[int]]


@dataclass
class _Selection:
    """The step being built: tokens and pages picked per request."""

    budget: int
    counts: dict[Request, int] = field(default_factory=dict)
    pages: dict[Request, int] = field(default_factory=dict)
    preempted: set[Request] = field(default_factory=set)
    reserved: int = 0
    shape: StepShape = field(default_factory=StepShape)
    hold: bool = False  # prompts stop short of their first token (see `Scheduler.schedule`)
    held: set[Request] = field(default_factory=set)

    def pick(self, requests: list[Request], counts: list[int], pages: list[int], shape: StepShape) -> None:
        self.counts.update(zip(requests, counts))
        self.pages.update(zip(requests, pages))
        self.reserved += sum(pages)
        self.budget -= sum(counts)
        self.shape = shape

    def drop(self, request: Request) -> None:
        self.preempted.add(request)
        if request in self.counts:
            self.budget += self.counts.pop(request)
            self.reserved -= self.pages.pop(request)


class Scheduler:
    """Continuous batching over a KV cache, in the spirit of vLLM v1's scheduler.

    Each step takes running requests first, decodes before prefill chunks, then admits
    waiting requests in arrival order while the token budget, the sequence cap and free
    pages allow; an admitted request starts from the cached pages of its prefix and
    computes only the rest. A prefill that does not fit the budget is split and its rest
    runs next step. When a running request needs a page and none is free, the most
    recently admitted running request is preempted by recompute: its pages are freed (the
    full ones stay cached, so its recompute is mostly hits) and it goes back to the front
    of the waiting queue with its generated tokens kept.

    Under a latency target (`ChunkSizer.has_target`), a step in which nothing decodes, with more
    prompt left to compute than the step's budget, holds each prompt back from its last token
    (for at most `HOLD_STEPS` steps): prompts that arrive together then start decoding together,
    instead of the first ones decoding while the chunks of the others are cut to the target.

    With quantized pages a request's first chunk holds at least its `own_kv_span`, so that
    span is computed in one step whatever else runs. A hybrid model's prefill chunk stops at its
    prompt's snapshot point (`KVCacheManager.snapshot_point`), where the step keeps its recurrent
    state for later requests that share the prompt. A chunk never ends inside a block of tokens that
    attend each other both ways (Gemma 4's image spans), nor at its last token (`whole_blocks`).
    """

    def __init__(
        self,
        cache: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        sizer: ChunkSizer | None = None,
    ) -> None:
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.sizer = sizer or ChunkSizer()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_stats = PrefixCacheStats()

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        """Pick the next step's work and reserve its KV slots; None when there is nothing to run."""
        selection = _Selection(self.max_num_batched_tokens)
        decode: list[Request] = []
        prefill: list[Request] = []
        for request in self.running:
            if not request.done_sampling:
                (decode if request.is_decode else prefill).append(request)
        admissible = list(itertools.islice(self.waiting, max(0, self.max_num_seqs - len(self.running))))
        selection.shape.joining = len(prefill) + len(admissible)
        selection.hold = not decode and self.sizer.has_target and self._backlog(prefill + admissible) > selection.budget
        running = decode + prefill  # prefill chunks after every decode
        if not self._pick(selection, running) and not self._pick_without_drafts(selection, decode, prefill):
            for request in running:
                if selection.budget and request not in selection.preempted:
                    self._make_room(selection, request)
        passed = 0  # waiting requests whose pages are still being read from disk: the next go first
        while (
            len(self.waiting) > passed
            and selection.budget
            and len(self.running) < self.max_num_seqs
            and self.cache.num_sequences < self.cache.max_num_seqs
        ):
            request = self.waiting[passed]
            if self._restoring(request):
                passed += 1
                continue
            if not self._admit(selection, request):
                break
            del self.waiting[passed]
            request.status = Status.RUNNING
            self.running.append(request)
        if selection.hold and not selection.counts:  # nothing could run beside the held first tokens: they go now
            selection.hold = False
            self._pick(selection, prefill)
        for request in selection.held:
            request.held_steps += 1
        requests, counts = list(selection.counts), list(selection.counts.values())
        drafts = [r.draft for r in requests]
        for request in self.running:  # a draft is proposed for one step
            request.draft = []
        if not selection.counts:
            return None
        ends = [n == r.num_remaining + len(d) for r, n, d in zip(requests, counts, drafts)]
        snapshots = [r.seq_id for r, n in zip(requests, counts) if 0 < self._snapshot_point(r) == r.num_computed + n]
        return ScheduledBatch(
            requests,
            counts,
            self.cache.append([r.seq_id for r in requests], counts),
            [end and not r.embeds for r, end in zip(requests, ends)],
            [end and r.embeds for r, end in zip(requests, ends)],
            self._own_kv_spans(requests),
            snapshots,
            drafts,
        )

    @staticmethod
    def _backlog(requests: list[Request]) -> int:
        """The prompt tokens `requests` (in prefill or waiting) still have to compute, less their last."""
        return sum(r.num_remaining - 1 for r in requests)

    def _holds(self, selection: _Selection, request: Request, count: int) -> bool:
        """Whether `selection` holds back `request`'s first token, which `count` tokens would reach (see `schedule`)."""
        return selection.hold and count == request.num_remaining and request.held_steps < HOLD_STEPS

    def _snapshot_point(self, request: Request) -> int:
        return self.cache.snapshot_point(len(request.prompt_ids))

    def own_kv_span(self, request: Request) -> int:
        """How many of `request`'s first tokens its next chunk computes from their own unquantized
        K/V (its own-K/V span): with quantized pages and nothing computed yet, the prompt but its
        last token (as mlx-lm's first prefill chunk), at most what one step holds beside a decode
        token of every other sequence; otherwise none, and every token attends the pages."""
        if self.cache.kv_bits is None or request.num_computed:
            return 0
        return whole_blocks(request, 0, max(0, min(len(request.prompt_ids) - 1, self.room)), self.room)

    @property
    def room(self) -> int:
        """The most tokens one row is sure to get in a step: the budget less a decode token of every other sequence."""
        return self.max_num_batched_tokens - (self.max_num_seqs - 1)

    def _own_kv_spans(self, requests: list[Request]) -> list[int]:
        """`own_kv_span` of each request (none with float pages)."""
        if self.cache.kv_bits is None:
            return [0] * len(requests)
        return [self.own_kv_span(r) for r in requests]

    def commit(self, step: ScheduledBatch) -> None:
        """Count `step`'s tokens as computed, now that their K/V are queued, and cache the pages
        they filled (requests aborted meanwhile are skipped). A speculating row counts only once
        its drafts are verified (`commit_verified`)."""
        seq_ids: list[int] = []
        tokens: list[list[int]] = []
        computed: list[int] = []
        for request, count, draft in zip(step.requests, step.counts, step.drafts):
            if request.status is Status.RUNNING and not draft:
                request.num_computed += count
                seq_ids.append(request.seq_id)
                tokens.append(request.all_token_ids)
                computed.append(request.num_computed)
        self.cache.publish(seq_ids, tokens, computed)
        for request in step.requests:
            pin = request.pin
            if pin is not None and request.pinned_tokens is None and request.status is Status.RUNNING:
                wanted = min(pin.tokens, len(request.prompt_ids))
                if request.num_computed >= wanted:
                    request.pinned_tokens = self.cache.pin(request.seq_id, wanted, pin.ttl_s)

    def commit_verified(self, request: Request, count: int) -> None:
        """Count a speculating row's last token and its accepted draft tokens (`count` in all) as
        computed, and give back the slots of the rejected ones."""
        request.num_computed += count
        self.cache.rewind(request.seq_id, request.num_computed)
        self.cache.publish([request.seq_id], [request.all_token_ids], [request.num_computed])

    def finish(self, request: Request, reason: str) -> None:
        """End a request (done or aborted) and free its pages."""
        if request in self.running:
            self.running.remove(request)
            self.cache.release(request.seq_id)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.seq_id = NO_SEQUENCE
        request.status = Status.FINISHED
        request.finish_reason = reason
        request.draft = []

    def _admit(self, selection: _Selection, request: Request) -> bool:
        """Open a sequence for `request` from its cached prefix and pick its first tokens, if
        their pages are free; otherwise leave everything as it was."""
        (request.seq_id,) = self.cache.claim(1)
        request.num_computed = self.cache.reuse_prefix(
            request.seq_id,
            request.all_token_ids,
            request.cache_salt,
            _marks(request),
            self._restore_pays,
            request.page_keys,
        )
        if not self._pick(selection, [request]):
            self.cache.release(request.seq_id)
            request.seq_id, request.num_computed = NO_SEQUENCE, 0
            return False
        request.page_keys = None  # its tokens grow from here on
        if request.num_cached_tokens is None:
            request.num_cached_tokens = request.num_computed
            self.prefix_stats.record(len(request.prompt_ids), request.num_computed)
        return True

    def _restoring(self, request: Request) -> bool:
        """Whether `request`'s prefix pages are still being read from the disk tier (see
        `KVCacheManager.restoring`); its page keys are computed once while it waits."""
        if self.cache.disk is None:
            return False
        if request.page_keys is None:
            request.page_keys = self.cache.prompt_keys(request.all_token_ids, request.cache_salt, _marks(request))
        return self.cache.restoring(request.page_keys, self._restore_pays)

    def _restore_pays(self, start: int, count: int, read_seconds: float) -> bool:
        """Whether reading `count` tokens' pages from disk (`read_seconds`) beats computing them after
        the `start` in place, by the fitted step time (before there is a fit: it does)."""
        step_time = self.sizer.step_time
        if step_time is None or step_time.coefficients is None:
            return True
        _, per_token, per_pair = step_time.coefficients
        return read_seconds < per_token * count + per_pair * count * (start + count / 2)

    def _pick(self, selection: _Selection, requests: list[Request]) -> bool:
        """Pick `requests` in order, each as many tokens as the budget leaves (a prompt's chunk as
        many as `sizer` lets the step hold), if all their pages are free and each takes its
        own-K/V span (one pass over the cache for the lot); otherwise pick none."""
        picked, counts, left, shape = [], [], selection.budget, selection.shape.copy()
        for request in requests:
            count = min(request.num_remaining + len(request.draft), left)
            del request.draft[max(0, count - request.num_remaining) :]  # as many drafts as the budget leaves
            stop = self._snapshot_point(request)
            if request.num_computed < stop:
                count = min(count, stop - request.num_computed)
            if count and not request.is_decode:
                count = min(count, max(self.sizer.chunk(shape, count, request.num_computed), self.own_kv_span(request)))
                if self._holds(selection, request, count):
                    selection.held.add(request)
                    count -= 1
                count = whole_blocks(request, request.num_computed, count, left)
            if count:
                picked.append(request)
                counts.append(count)
                left -= count
                self._add(shape, request, count)
        pages = self.cache.pages_needed([r.seq_id for r in picked], counts)
        if sum(pages) + selection.reserved > self.cache.free_pages:
            self.cache.make_room(sum(pages) + selection.reserved)  # pins lapse before any request waits
        if sum(pages) > self.cache.free_pages - selection.reserved or any(
            n < e for n, e in zip(counts, self._own_kv_spans(picked))
        ):
            return False
        selection.pick(picked, counts, pages, shape)
        return True

    def _add(self, shape: StepShape, request: Request, count: int) -> None:
        """Count `count` tokens of `request` into a step's `shape`."""
        samples = 1 + len(request.draft)
        shape.add(count, request.num_computed + count, samples, request.is_decode, self.sizer.memory)

    def _shape(self, counts: dict[Request, int], joining: int) -> StepShape:
        """The shape of a step of `counts` tokens of each request, `joining` more to decode beside them."""
        shape = StepShape(joining=joining)
        for request, count in counts.items():
            self._add(shape, request, count)
        return shape

    def _pick_without_drafts(self, selection: _Selection, decode: list[Request], prefill: list[Request]) -> bool:
        """Pick the running requests with no draft tokens (if any had some), before anyone is
        preempted for pages that drafts would take."""
        if not any(r.draft for r in decode):
            return False
        for request in decode:
            request.draft = []
        return self._pick(selection, decode + prefill)

    def _make_room(self, selection: _Selection, request: Request) -> None:
        """Pick `request`, preempting the newest running requests until it fits (maybe itself)."""
        while not self._pick(selection, [request]):
            victim = self._preempt_newest()
            selection.drop(victim)
            selection.shape = self._shape(selection.counts, selection.shape.joining)
            if victim is request:
                return

    def roll_back(self, requests: list[Request]) -> None:
        """Undo a step that failed: its running requests go back to the front of the waiting
        queue in their order, pages freed, to be recomputed as after a preemption."""
        undone = set(requests)
        for request in reversed([r for r in self.running if r in undone]):
            self.running.remove(request)
            self._requeue(request)

    def _preempt_newest(self) -> Request:
        request = self.running.pop()
        logger.debug(
            "preempting request %s (%d tokens computed): no free KV page for the running requests",
            request.request_id,
            request.num_computed,
        )
        self._requeue(request)
        self.num_preemptions += 1
        return request

    def _requeue(self, request: Request) -> None:
        request.draft = []
        self.cache.release(request.seq_id)
        request.seq_id = NO_SEQUENCE
        request.num_computed = 0
        request.status = Status.WAITING
        self.waiting.appendleft(request)


def whole_blocks(request: Request, start: int, count: int, most: int) -> int:
    """`count` tokens of `request` from `start`, changed so that they do not end inside a block
    of its images (`PromptImages.blocks`) or at a block's last token, whose queries need every
    key of the block, and the own-K/V span the whole block: cut back to the block's start, or,
    where that leaves nothing, run on past its end (if `most` tokens allow, else none)."""
    if request.images is None:
        return count
    end = start + count
    for first, stop in request.images.blocks:
        if first < end <= stop:
            if first > start:
                return first - start
            past = min(stop + 1, len(request.all_token_ids)) - start
            return past if past <= most else 0
    return count


def _marks(request: Request) -> Marks:
    """What `request`'s page keys fold in besides its tokens: its images' digests."""
    return request.images.marks if request.images is not None else ()
