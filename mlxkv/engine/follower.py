"""What every rank but 0 of a tensor-parallel group runs: the forward pass of each step rank 0 plans,
over its own share of the weights and KV heads. It keeps no requests: rank 0 schedules, samples
and sends the tokens it sampled in the next step's plan."""

from __future__ import annotations

import mlx.core as mx

from ..errors import TensorParallelError
from .model_runner import ModelRunner
from .step_plan import PlanChannel


def follow(runner: ModelRunner, channel: PlanChannel) -> None:
    """Run each plan rank 0 sends until it sends the stop: the same all-reduces as rank 0's, in the
    same order (rank 0 evaluates its forward pass at once too), writing this rank's K/V heads."""
    try:
        while (plan := channel.receive()) is not None:
            hidden = runner.hidden(plan.token_ids, plan.kv, plan.own_kv)
            mx.async_eval(hidden, runner.cache.tensors)
    except RuntimeError as exc:  # MLX's backends raise it for a lost peer
        raise TensorParallelError(f"rank 0 of the tensor-parallel group is gone: {exc}") from None
