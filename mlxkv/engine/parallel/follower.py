"""What every rank but 0 of a tensor-parallel group runs: the forward pass of each step rank 0 plans,
over its own share of the weights and KV heads. It keeps no requests: rank 0 schedules and samples,
and shares the tokens it sampled at the end of each step, which the next plan's pending ids name."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext

import mlx.core as mx
import numpy as np

from ...cache.disk.peers import MISSING, READING
from ...cache.manager import KVCacheManager
from ...errors import TensorParallelError
from ..model_runner import ModelRunner
from .naps import Nap
from .rank_watchdog import RankWatchdog
from .step_plan import DiskQuestion, PlanChannel, StepPlan


def follow(
    runner: ModelRunner, channel: PlanChannel, watchdog: RankWatchdog, sleep: Callable[[float], None] = time.sleep
) -> None:
    """Run each plan rank 0 sends until it sends the stop, sleeping through the naps it sends while it
    has no step to run. Rank 0 owes the message after a nap at once (its own wait ends with the nap),
    so that wait is watched: `watchdog` ends this process if rank 0 stopped answering."""
    previous: mx.array | None = None  # the tokens rank 0 sampled in the step before
    napped = False
    try:
        while (plan := _receive(channel, watchdog if napped else None)) is not None:
            if isinstance(plan, Nap):
                sleep(plan.seconds)
            elif isinstance(plan, DiskQuestion):
                channel.answer(*answer_disk_question(runner.cache, plan))
            else:
                previous = _run(runner, channel, plan, previous)
            napped = isinstance(plan, Nap)
    except RuntimeError as exc:  # MLX's backends raise it for a lost peer
        raise TensorParallelError(f"rank 0 of the tensor-parallel group is gone: {exc}") from None


def _receive(channel: PlanChannel, watchdog: RankWatchdog | None) -> StepPlan | Nap | DiskQuestion | None:
    with watchdog.watching() if watchdog is not None else nullcontext():
        return channel.receive()


def _run(runner: ModelRunner, channel: PlanChannel, plan: StepPlan, previous: mx.array | None) -> mx.array | None:
    """Start `plan`'s forward pass: the same all-reduces as rank 0's, in the same order (rank 0 starts
    its forward pass at once too), writing this rank's K/V heads. Returns the tokens rank 0 samples
    in it (lazily), or `previous` if it samples none. What rank 0's disk tier did since the plan
    before is done first, as rank 0 did it before this step."""
    if plan.disk:
        runner.cache.follow_moves(plan.disk)
    hidden = runner.hidden(plan.inputs(previous), plan.kv, plan.own_kv)
    runner.cache.evaluate(hidden, wait=False)
    if not plan.samples:
        return previous
    tokens = channel.share_tokens(mx.zeros(plan.samples, mx.int32))
    mx.async_eval(tokens)
    return tokens


def answer_disk_question(cache: KVCacheManager, question: DiskQuestion) -> tuple[np.ndarray, np.ndarray]:
    """This rank's flags for the keys rank 0 asks about: still reading (a read ahead starts here), and
    lacking (not on its disk, its file damaged, or no disk tier at all)."""
    if cache.disk is None:
        return np.zeros(len(question.keys), np.int32), np.ones(len(question.keys), np.int32)
    cache.disk.prefetch(question.keys)
    status = np.array(cache.disk.status(question.keys), np.int32)
    return (status == READING).astype(np.int32), (status == MISSING).astype(np.int32)
