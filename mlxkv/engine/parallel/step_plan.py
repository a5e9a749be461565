"""The step plan: one step's forward pass as host arrays (the packed token ids, the page tables and
lengths attention reads, each row's own-K/V span). Rank 0 of a tensor-parallel group sends it to
the other ranks each step, so that every rank runs the same forward pass over identical page
tables, and only rank 0 keeps requests."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ...cache.batch import KVBatch
from ...cache.disk.peers import KEY_WORDS, DiskMoves
from ..images import StepMedia
from ..model_kv import ModelKV
from ..request import PENDING, Request
from ..scheduler import ScheduledBatch
from .naps import Nap


def _row(request: Request, count: int) -> list[int]:
    """The next `count` tokens of `request` as its row of a step: zeros in place of a pending token
    an abort dropped after the step was scheduled (the row's results are dropped with it)."""
    ids = request.pending(count)
    return ids + [0] * (count - len(ids))


@dataclass(frozen=True)
class StepPlan:
    """One step's forward pass: `token_ids` packed row after row as `kv` says, the first `own_kv[b]`
    tokens of row b attending their own K/V as computed. The ids at `pending` are not known yet: the
    step before samples them, as its tokens' rows `sources`. The step samples `samples` tokens.
    `media`: what its images put in (only rank 0 reads it: images are not served across processes).
    `disk`: what rank 0's disk tier did since the plan before, for the others' to do before the step."""

    token_ids: np.ndarray
    kv: KVBatch
    own_kv: np.ndarray
    pending: np.ndarray
    sources: np.ndarray
    samples: int
    media: StepMedia | None = None
    disk: DiskMoves | None = None

    @classmethod
    def of(
        cls, batch: ScheduledBatch, previous: Sequence[Request], samples: int, media: StepMedia | None = None
    ) -> StepPlan:
        """`batch`'s forward pass as a plan, sampling `samples` tokens: its input tokens packed, those
        still `PENDING` to be taken from the step before, whose sampling rows were `previous`."""
        host = np.fromiter(
            itertools.chain.from_iterable(
                _row(r, n - len(d)) + d for r, n, d in zip(batch.requests, batch.counts, batch.drafts)
            ),
            np.int32,
        )
        pending = np.flatnonzero(host == PENDING).astype(np.int32)
        sources = np.zeros(0, np.int32)
        if pending.size:
            rows = {id(r): i for i, r in enumerate(previous)}  # only the step before samples a pending token
            owners = np.repeat(np.arange(len(batch.requests)), batch.counts)[pending]
            sources = np.array([rows[id(batch.requests[o])] for o in owners], np.int32)
            host[pending] = 0
        return cls(host, batch.kv, np.asarray(batch.own_kv, np.int32), pending, sources, samples, media)

    def inputs(self, previous: mx.array | None) -> mx.array:
        """The packed token ids, the pending ones taken lazily from `previous` (the tokens the step
        before sampled), so that a step can start before the one before is read."""
        if not self.pending.size:
            return mx.array(self.token_ids)
        assert previous is not None, "only the step before samples a token its successor reads"
        in_order = self.sources.size == previous.size and np.array_equal(self.sources, np.arange(previous.size))
        taken = (previous if in_order else previous[mx.array(self.sources)]).astype(mx.int32)
        if self.pending.size == self.token_ids.size:  # every token pending: a step of decodes only
            return taken
        ids = mx.array(self.token_ids)
        ids[mx.array(self.pending)] = taken
        return ids

    def encode(self) -> np.ndarray:
        """The plan as one int32 vector: a run of arrays, each after its length."""
        kv = self.kv
        windows = kv.by_window or {}
        parts = [
            np.array([kv.page_size, len(windows), self.samples]),
            np.array(kv.seq_ids),
            kv.query_lens,
            self.own_kv,
            self.token_ids,
            self.pending,
            self.sources,
            *_pages(kv),
        ]
        for window, batch in windows.items():
            parts += [np.array([window]), *_pages(batch)]
        parts.append(self.disk.encode() if self.disk else np.zeros(0, np.int32))
        return np.concatenate([np.concatenate([[np.size(p)], np.ravel(p)]) for p in parts]).astype(np.int32)

    @staticmethod
    def decode(message: np.ndarray) -> StepPlan:
        arrays, at = [], 0
        while at < len(message):
            size = int(message[at])
            arrays.append(message[at + 1 : at + 1 + size])
            at += 1 + size
        (page_size, num_windows, samples), seq_ids, query_lens, own_kv, token_ids, pending, sources = arrays[:7]
        rows = len(seq_ids)

        def batch(context_lens: np.ndarray, tables: np.ndarray, by_window: dict[int, KVBatch] | None = None) -> KVBatch:
            ids = tuple(seq_ids.tolist())
            return KVBatch(ids, query_lens, context_lens, tables.reshape(rows, -1), int(page_size), by_window)

        windows = {int(arrays[i][0]): batch(arrays[i + 1], arrays[i + 2]) for i in range(9, 9 + 3 * num_windows, 3)}
        kv = batch(arrays[7], arrays[8], windows or None)
        moves = arrays[9 + 3 * num_windows]
        disk = DiskMoves.decode(moves) if moves.size else None
        return StepPlan(token_ids, kv, own_kv, pending, sources, int(samples), disk=disk)


def _pages(batch: KVBatch) -> list[np.ndarray]:
    return [batch.context_lens, batch.page_tables]


def check_tensor_parallel(model: ModelKV) -> None:
    """Raise ValueError for what a plan cannot run yet: recurrent layers (their state indices, and
    the snapshots the prefix cache keeps of them, are not in it)."""
    if model.state_shapes:
        raise ValueError(
            "this model has recurrent layers, which tensor parallel does not run yet; run it in one process"
        )


@dataclass(frozen=True)
class DiskQuestion:
    """Rank 0 asks the other ranks which of the disk keys `keys` they lack or are still reading (each
    starts reading those it holds): they answer with `PlanChannel.answer`."""

    keys: list[bytes]


class PlanChannel:
    """Rank 0's messages to the other ranks of `group`: a header of three int32 (a step plan's length,
    a nap's milliseconds, a disk question's length; all 0: stop), then the plan or question if
    there is one, each as an all-sum (the others add zeros) on the CPU stream (host data). A nap is
    the header alone: one rendezvous, which an idle group pays at each nap. A question is answered
    by one more all-sum, where rank 0 adds zeros. `sent_bytes`: the last message's size on the wire."""

    def __init__(self, group: mx.distributed.Group) -> None:
        self.group = group
        self.sent_bytes = 0

    def send(self, plan: StepPlan | Nap | None) -> None:
        """Send `plan` (a `Nap`: the followers sleep; None: they stop)."""
        message = plan.encode() if isinstance(plan, StepPlan) else np.zeros(0, np.int32)
        nap_ms = max(1, round(1000 * plan.seconds)) if isinstance(plan, Nap) else 0
        self._share(np.array([len(message), nap_ms, 0], np.int32))
        if len(message):
            self._share(message)
        self.sent_bytes = 4 * (3 + len(message))

    def ask(self, question: DiskQuestion) -> np.ndarray:
        """Rank 0: ask the other ranks `question`; returns how many of them are still reading each key
        (row 0) and how many lack it (row 1)."""
        words = np.frombuffer(b"".join(question.keys), "<i4")
        self._share(np.array([0, 0, len(words)], np.int32))
        self._share(words.astype(np.int32))
        return self._share(np.zeros(2 * len(question.keys), np.int32)).reshape(2, -1)

    def answer(self, reading: np.ndarray, lacking: np.ndarray) -> None:
        """A rank's answer to the question just received: a flag a key for each of the two."""
        self._share(np.concatenate([reading, lacking]).astype(np.int32))

    def share_tokens(self, tokens: mx.array) -> mx.array:
        """Rank 0's sampled `tokens` on every rank, lazily, within the step's graph (the other ranks
        pass zeros of the plan's `samples`), so that the next step may start before they are read."""
        return mx.distributed.all_sum(tokens.astype(mx.int32), group=self.group).astype(mx.uint32)

    def receive(self) -> StepPlan | Nap | DiskQuestion | None:
        """The next plan rank 0 sends (a `Nap`: sleep; a `DiskQuestion`: answer it; None: stop)."""
        size, nap_ms, question = self._share(np.zeros(3, np.int32)).tolist()
        if question:
            words = self._share(np.zeros(question, np.int32)).astype("<i4")
            return DiskQuestion([row.tobytes() for row in words.reshape(-1, KEY_WORDS)])
        if size:
            return StepPlan.decode(self._share(np.zeros(size, np.int32)))
        return Nap(nap_ms / 1000) if nap_ms else None

    def _share(self, host: np.ndarray) -> np.ndarray:
        total = mx.distributed.all_sum(mx.array(host), group=self.group, stream=mx.cpu)
        mx.eval(total)
        return np.array(total)
