"""What every rank but 0 of a tensor-parallel group runs: the forward pass of each step rank 0 plans,
over its own share of the weights and KV heads. It keeps no requests: rank 0 schedules and samples,
and shares the tokens it sampled at the end of each step, which the next plan's pending ids name."""

from __future__ import annotations

import mlx.core as mx

from ...errors import TensorParallelError
from ..model_runner import ModelRunner
from .step_plan import PlanChannel


def follow(runner: ModelRunner, channel: PlanChannel) -> None:
    """Run each plan rank 0 sends until it sends the stop: the same all-reduces as rank 0's, in the
    same order (rank 0 starts its forward pass at once too), writing this rank's K/V heads."""
    previous: mx.array | None = None  # the tokens rank 0 sampled in the step before
    try:
        while (plan := channel.receive()) is not None:
            hidden = runner.hidden(plan.inputs(previous), plan.kv, plan.own_kv)
            runner.cache.evaluate(hidden, wait=False)
            if plan.samples:
                previous = channel.share_tokens(mx.zeros(plan.samples, mx.int32))
                mx.async_eval(previous)
    except RuntimeError as exc:  # MLX's backends raise it for a lost peer
        raise TensorParallelError(f"rank 0 of the tensor-parallel group is gone: {exc}") from None
