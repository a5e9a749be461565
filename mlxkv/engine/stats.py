"""One snapshot of the engine for metrics and front ends, so that they never reach into its parts."""

from __future__ import annotations

from dataclasses import dataclass, replace

import mlx.core as mx

from ..cache.manager import KVCacheManager
from ..cache.prefix_cache import PrefixCacheStats
from ..cache.usage import KVUsage
from .memory.memory_budget import MemoryBudget
from .scheduler import Scheduler
from .speculative.speculation import SpeculationStats, Speculator


@dataclass(frozen=True)
class EngineStats:
    """Requests running and waiting, preemptions so far, the KV cache's use, and what the prefix cache
    reused (`prefix_caching` says whether it is on: off, or the contiguous layout, shares nothing),
    the draft tokens speculative decoding proposed and accepted (None when it is off), the memory
    budget's split, and the most memory MLX has held at once in this process (`peak_memory`)."""

    running: int
    waiting: int
    preemptions: int
    kv: KVUsage
    prefix_caching: bool
    prefix_cache: PrefixCacheStats
    speculation: SpeculationStats | None = None
    memory: MemoryBudget | None = None
    peak_memory: int = 0

    @classmethod
    def of(
        cls, scheduler: Scheduler, cache: KVCacheManager, speculator: Speculator | None, memory: MemoryBudget
    ) -> EngineStats:
        """The snapshot of an engine's parts, now."""
        return cls(
            len(scheduler.running),
            len(scheduler.waiting),
            scheduler.num_preemptions,
            cache.usage(),
            cache.prefix_caching,
            replace(scheduler.prefix_stats),
            speculator.stats if speculator is not None else None,
            memory,
            mx.get_peak_memory(),
        )
