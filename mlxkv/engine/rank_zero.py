"""Rank 0's side of a tensor-parallel group: each step's plan sent before its forward pass starts,
and the group's failure kept, whether a rank died (its sockets close, the step fails) or stopped
answering (`RankWatchdog`)."""

from __future__ import annotations

import atexit
import time
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx
import numpy as np

from ..errors import TensorParallelError
from .model_runner import ModelRunner
from .rank_watchdog import RankWatchdog
from .scheduler import ScheduledBatch
from .step_plan import PlanChannel, StepPlan


class RankZero:
    """Sends the plans of `group`'s steps; stops the other ranks at exit (or at `stop`)."""

    def __init__(self, group: mx.distributed.Group, timeout_s: float) -> None:
        self.channel = PlanChannel(group)
        self.size = group.size()
        self.lost: TensorParallelError | None = None  # set once the group cannot go on
        self.watchdog = RankWatchdog(timeout_s, self.lose)
        atexit.register(self.stop)

    @contextmanager
    def step(self) -> Iterator[None]:
        """One engine step, watched: the others must answer within the timeout."""
        self.watchdog.started = time.monotonic()
        try:
            yield
        finally:
            self.watchdog.started = None

    def forward(self, runner: ModelRunner, batch: ScheduledBatch, token_ids: mx.array) -> mx.array:
        """The batch's final hidden states, the step's plan sent first. The forward pass is started
        at once, so that every rank runs the same all-reduces in the same order whatever rank 0
        does next (sampling may fail a request)."""
        try:
            self.channel.send(StepPlan(np.array(token_ids), batch.kv, np.asarray(batch.own_kv, np.int32)))
            hidden = runner.hidden(token_ids, batch.kv, batch.own_kv)
            mx.async_eval(hidden, runner.cache.tensors)
            return hidden
        except Exception as exc:
            error = TensorParallelError(f"the tensor-parallel group of {self.size} processes failed: {exc}")
            self.lose(error)
            raise error from exc

    def lose(self, error: TensorParallelError) -> None:
        """The group failed: no request can run any more, nor be admitted."""
        self.lost = error

    def stop(self) -> None:
        """Tell the other ranks that rank 0 is done (they return from `follow`); no step runs after."""
        atexit.unregister(self.stop)
        if self.lost is None:
            self.channel.send(None)
            self.lose(TensorParallelError("the tensor-parallel group was stopped (stop_followers)"))
