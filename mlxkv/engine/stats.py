"""One snapshot of the engine for metrics and front ends, so that they never reach into its parts."""

from __future__ import annotations

from dataclasses import dataclass

from ..cache.prefix_cache import PrefixCacheStats
from ..cache.usage import KVUsage
from .memory.memory_budget import MemoryBudget
from .speculative.speculation import SpeculationStats


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
