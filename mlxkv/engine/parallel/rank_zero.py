"""Rank 0's side of a tensor-parallel group: each step's plan sent before its forward pass starts,
its sampled tokens shared at its end, and the group's failure kept, whether a rank died (its
sockets close, the step fails) or stopped answering (`RankWatchdog`). An engine alone has `Alone`
in its place."""

from __future__ import annotations

import atexit
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import mlx.core as mx

from ...errors import TensorParallelError
from ..model_runner import ModelRunner
from .naps import Naps
from .rank_watchdog import RankWatchdog
from .step_plan import DiskQuestion, PlanChannel, StepPlan


class RankZero:
    """Sends the plans of `group`'s steps; stops the other ranks at exit (or at `stop`)."""

    def __init__(self, group: mx.distributed.Group, timeout_s: float, longest_nap_s: float) -> None:
        self.channel = PlanChannel(group)
        self.lost: TensorParallelError | None = None  # set once the group cannot go on
        self.owed = 0  # tokens the step being built samples, not shared yet
        self.watchdog = RankWatchdog(timeout_s, self.lose)
        self.naps = Naps(longest_nap_s)
        atexit.register(self.stop)

    @contextmanager
    def step(self) -> Iterator[None]:
        """One engine step, watched: the others must answer within the timeout."""
        with self.watchdog.watching():
            yield

    def forward(self, runner: ModelRunner, plan: StepPlan, previous: mx.array | None) -> mx.array:
        """The final hidden states of `plan`'s batch, the plan sent first (`previous`: the tokens of
        the step before, which its pending ids name). The forward pass is started at once, so that
        every rank runs the same all-reduces in the same order whatever rank 0 does next."""
        try:
            self.channel.send(replace(plan, disk=runner.cache.take_moves()))
            hidden = runner.hidden(plan.inputs(previous), plan.kv, plan.own_kv, plan.media)
            runner.cache.evaluate(hidden, wait=False)
            self.owed = plan.samples
            self.naps.reset()
            return hidden
        except Exception as exc:
            raise self.failed(exc) from exc

    def ask_disk(self, keys: list[bytes]) -> tuple[list[bytes], bool]:
        """The disk keys of `keys` some other rank lacks, and whether some other rank is still reading
        any (see `KVCacheManager.share_disk`). Asked as a step is scheduled, so watched with it."""
        try:
            reading, lacking = self.channel.ask(DiskQuestion(keys))
        except RuntimeError as exc:  # MLX's backends raise it for a lost peer
            raise self.failed(exc) from exc
        return [key for key, count in zip(keys, lacking.tolist()) if count], bool(reading.any())

    def rest(self) -> float | None:
        """Rank 0 has no step to run: the other ranks nap rather than wait in a collective (see
        `naps`). Returns how long to wait for a request before calling again (None: as long as it
        takes: the group failed, or naps are off). Watched like a step: it waits for them to finish
        the nap before."""
        if self.lost is not None or (nap := self.naps.next()) is None:
            return None
        try:
            with self.step():
                self.channel.send(nap)
        except RuntimeError as exc:  # MLX's backends raise it for a lost peer
            self.failed(exc)
            return None
        return nap.seconds

    def failed(self, cause: Exception) -> TensorParallelError:
        """The group's failure, kept, for a step that failed on rank 0 once its plan was sent (the
        ranks could not agree to undo it: a lost peer, or an evaluation that failed)."""
        size = self.channel.group.size()
        error = TensorParallelError(f"the tensor-parallel group of {size} processes failed: {cause}")
        self.lose(error)
        return error

    def share(self, tokens: mx.array) -> mx.array:
        """The step's sampled `tokens`, shared with the other ranks (lazily: in the step's graph)."""
        self.owed = 0
        return self.channel.share_tokens(tokens)

    def settle(self) -> None:
        """Share zeros for a step that failed after its forward pass started and before its tokens
        were shared: the other ranks wait for them (the next plan names none of them)."""
        if self.owed and self.lost is None:
            mx.eval(self.channel.share_tokens(mx.zeros(self.owed, mx.int32)))
            self.owed = 0

    def lose(self, error: TensorParallelError) -> None:
        """The group failed: no request can run any more, nor be admitted."""
        self.lost = error

    def stop(self) -> None:
        """Tell the other ranks that rank 0 is done (they return from `follow`); no step runs after.
        Watched like a step (a stopped rank would block it); ranks already gone need no telling."""
        atexit.unregister(self.stop)
        if self.lost is None:
            try:
                with self.step():
                    self.channel.send(None)
            except RuntimeError:  # MLX's backends raise it for a lost peer
                pass
            self.lose(TensorParallelError("the tensor-parallel group was stopped (stop_followers)"))


class Alone:
    """What stands for `RankZero` in an engine that is no tensor-parallel group's rank 0: its steps
    are its own, sent to nobody and never lost."""

    lost: TensorParallelError | None = None

    @contextmanager
    def step(self) -> Iterator[None]:
        yield

    def forward(self, runner: ModelRunner, plan: StepPlan, previous: mx.array | None) -> mx.array:
        """The final hidden states of `plan`'s batch (lazy)."""
        return runner.hidden(plan.inputs(previous), plan.kv, plan.own_kv, plan.media)

    def share(self, tokens: mx.array) -> mx.array:
        return tokens

    def settle(self) -> None:
        pass

    def rest(self) -> None:
        """Nobody to let nap: wait for a request as long as it takes."""
        return None

    def stop(self) -> None:
        pass
