"""One memory budget for everything an engine holds: weights, KV pages, a draft model, the reserve
for a step's temporaries and MLX's buffer cache, within what the device can use.

On a Mac, memory the GPU cannot get does not fail a request: the machine stalls or panics. So the
engine never plans past the budget: the KV pool is what is left after the rest, a step's temporaries
are bounded by the reserve (the scheduler cuts prefill chunks to fit it), MLX's buffer cache keeps no
more than the reserve, and MLX's memory limit is set to the budget, past which MLX waits for memory
to be freed before it allocates more.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import mlx.core as mx

from ...config import EngineConfig
from ...errors import MemoryBudgetError
from ..model_kv import ModelKV
from .chunk_sizing import LEAST_CHUNK
from .kv_budget import KVCacheSizing, context_length, size_kv_cache
from .step_memory import StepMemory

logger = logging.getLogger(__name__)


def device_memory() -> int:
    """Bytes the device running the model can use: Metal's recommended working set on a Mac,
    physical memory elsewhere."""
    info = mx.device_info()
    if "max_recommended_working_set_size" in info:
        return int(info["max_recommended_working_set_size"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_limit(config: EngineConfig, device: int) -> int:
    """The budget's size: `config.memory_limit` (a share of `device`, or bytes), else all of `device`;
    more than the device can use is refused."""
    asked = config.memory_limit
    if asked is None:
        return device
    assert not isinstance(asked, str), "EngineConfig converts memory_limit to a share or bytes"
    if isinstance(asked, float):
        return int(asked * device)
    if asked > device:
        raise ValueError(
            f"memory_limit={gb(asked)} is more than the {gb(device)} this device can use; "
            "give at most that, or a share such as 0.8"
        )
    return asked


def gb(size: int) -> str:
    """A size for people: GB from one GB up, MB from one MB up, else kB."""
    for unit, scale, digits in (("GB", 1e9, 2), ("MB", 1e6, 1)):
        if abs(size) >= scale:
            return f"{size / scale:.{digits}f} {unit}"
    return f"{size / 1e3:.1f} kB"


@dataclass(frozen=True)
class MemoryBudget:
    """How the budget (`limit` bytes, of the `device`'s) is split. `kv` holds every KV page and
    recurrent state of the model and of its draft model; `reserve` bounds one step's temporaries and
    `cache` MLX's buffer cache of freed ones; `vision` holds a multimodal model's vision tower and
    its cache of encoded images."""

    device: int
    limit: int
    weights: int
    draft_weights: int
    kv: int
    reserve: int
    cache: int
    vision: int = 0

    @property
    def planned(self) -> int:
        return self.weights + self.draft_weights + self.vision + self.kv + self.reserve + self.cache

    def parts(self) -> dict[str, int]:
        """Each part's bytes, by the name `/metrics` and the chat page give it."""
        return {
            "weights": self.weights,
            "draft_weights": self.draft_weights,
            "vision": self.vision,
            "kv": self.kv,
            "reserve": self.reserve,
            "cache": self.cache,
        }

    def __str__(self) -> str:
        draft = f", draft model {gb(self.draft_weights)}" if self.draft_weights else ""
        draft += f", vision {gb(self.vision)}" if self.vision else ""
        return (
            f"{gb(self.planned)} of a {gb(self.limit)} budget: weights {gb(self.weights)}{draft}, "
            f"KV {gb(self.kv)}, step reserve {gb(self.reserve)}, buffer cache {gb(self.cache)}"
        )

    def apply(self) -> None:
        """Make MLX keep to the budget: its memory limit at what the budget plans to hold (past it,
        MLX waits for the work in flight to free memory before it computes more, so a step's
        temporaries stay within the reserve), its buffer cache at `cache`, and on a Mac the memory
        kept wired (resident for the GPU) raised to the budget, as mlx-lm raises it for a model
        near the working set, so its pages are not evicted between steps."""
        mx.set_memory_limit(self.planned - self.cache)  # the cache is not counted as active memory
        mx.set_cache_limit(self.cache)
        if mx.metal.is_available():
            mx.set_wired_limit(self.limit)
            logger.info("MLX wired limit set to the memory budget, %s", gb(self.limit))
            if self.weights + self.draft_weights > 0.9 * self.device:
                logger.warning(
                    "the weights take %s of the %s the GPU can use: generation may be slow",
                    gb(self.weights + self.draft_weights),
                    gb(self.device),
                )


@dataclass(frozen=True)
class Reserve:
    """The step reserve and buffer cache a budget holds back from the KV pool: what the worst step
    the scheduler may build needs (`wanted`), at most `cap`, never less than the smallest step that
    still makes progress (`least`)."""

    wanted: int
    least: int

    def within(self, room: int, kv_share: float = 0.0, kv_fixed: int | None = None) -> int:
        """The reserve, taking `wanted` if `room` (the budget less the weights) allows it beside the
        KV pool (`kv_fixed` bytes if its size was given, else `kv_share` of what is left), else as
        much as is left to it; the cache gets as much again."""
        cap = (room - kv_fixed if kv_fixed is not None else int(room * (1 - kv_share))) // 2
        reserve = min(self.wanted, cap)
        if reserve < self.least:
            raise MemoryBudgetError(
                f"the memory budget leaves {gb(max(cap, 0))} for a step's temporaries beside the weights "
                f"and the KV cache; the smallest step needs {gb(self.least)}: raise memory_limit, "
                "or lower max_num_seqs or the KV cache's size"
            )
        return reserve


def split_memory(
    config: EngineConfig, model: ModelKV, step: StepMemory, draft: ModelKV | None = None, vision: int = 0
) -> tuple[MemoryBudget, KVCacheSizing]:
    """The budget for `model` (and its `draft` model, and `vision` bytes for a vision tower and its
    encoded images) under `config`, and the KV cache it buys: weights first, then the step reserve
    and as much again for MLX's buffer cache, the KV pool from the rest. The reserve holds a full
    token budget's chunk over as many keys as it has tokens
    (a prompt's first chunk; later chunks over longer contexts are cut to fit) beside every other
    sequence decoding at full context, and at least a step of those decodes and a little prefill at
    full context; less if the budget is tight, but never less than the latter."""
    device = device_memory()
    limit = memory_limit(config, device)
    draft_weights = draft.weights_bytes if draft is not None else 0
    room = limit - model.weights_bytes - draft_weights - vision
    if room <= 0:
        raise MemoryBudgetError(
            f"the weights take {gb(model.weights_bytes + draft_weights + vision)}, more than the memory budget "
            f"of {gb(limit)} (memory_limit); raise it"
        )
    context = context_length(config.max_model_len, model.context)
    seqs = config.max_num_seqs
    samples = seqs * (1 + (config.num_draft_tokens if config.prompt_lookup or config.draft_model else 0))
    least = step.worst(seqs + LEAST_CHUNK, seqs, context, samples)
    budget = config.max_num_batched_tokens
    wanted = max(least, step.worst(budget, seqs, context, samples, chunk_context=min(context, budget)))
    reserve = Reserve(wanted, least)
    if config.num_pages is not None or config.kv_cache_memory is not None:
        sizing = size_kv_cache(config, model, room, draft)
        kept = reserve.within(room, kv_fixed=sizing.bytes)
    else:
        kept = reserve.within(room, kv_share=config.kv_cache_fraction)
        sizing = size_kv_cache(config, model, room - 2 * kept, draft)
    split = MemoryBudget(device, limit, model.weights_bytes, draft_weights, sizing.bytes, kept, kept, vision)
    return split, sizing
