"""What happens when a step fails: it is undone, and only the requests that caused it fail.

The batch's requests go back to the waiting queue as if preempted: their pages are freed, so K/V
the step may have half-written is never read, and they recompute to the same tokens (sampling keys
depend only on a request's seed and progress; with quantized pages, a recompute that finds only part
of its pages cached attends quantized K/V where it first attended its own, see
`Scheduler.own_kv_span`). If the KV tensors themselves cannot be evaluated any more, every running
request is rolled back and the tensors start afresh, and so does the prefix cache whose pages they
held. A step that ran out of memory fails no request: the requests retry in smaller chunks, up to
`OUT_OF_MEMORY_RETRIES` steps in a row.
"""

from __future__ import annotations

import logging

import mlx.core as mx

from ..cache.manager import KVCacheManager
from ..errors import is_out_of_memory
from .output_processor import OutputProcessor
from .outputs import RequestOutput
from .request import Request, Status
from .scheduler import Scheduler

logger = logging.getLogger(__name__)
OUT_OF_MEMORY_RETRIES = 4  # steps in a row that may run out of memory before their requests fail


class StepRecovery:
    """Undoes failed steps over `scheduler` and `cache`, failing requests through `outputs` (under the
    engine's lock, which its caller holds)."""

    def __init__(self, scheduler: Scheduler, cache: KVCacheManager, outputs: OutputProcessor) -> None:
        self.scheduler, self.cache, self.outputs = scheduler, cache, outputs
        self.out_of_memory = 0  # steps run out of memory in a row

    def undo(
        self, batch: list[Request], culprits: list[Request] | None, error: Exception | None
    ) -> list[RequestOutput]:
        """Undo the failed step of `batch`, then fail the requests that caused it (all of `batch` when
        that cannot be told; none when `error` is None: interrupted, not failed)."""
        self.scheduler.roll_back(batch)
        try:
            self.cache.evaluate()
        except Exception:
            self.scheduler.roll_back(list(self.scheduler.running))
            self.cache.reset()
        if error is None:
            return []
        if is_out_of_memory(error) and self.out_of_memory < OUT_OF_MEMORY_RETRIES:
            self._retry_smaller(error)
            return []
        failed = batch if culprits is None else culprits
        return [self.outputs.fail(r, error) for r in failed if r.status is not Status.FINISHED]

    def _retry_smaller(self, error: Exception) -> None:
        """After a step ran out of memory (and was undone): halve the step reserve that prefill chunks
        are cut to and free MLX's buffer cache, so the requests retry in smaller steps."""
        self.out_of_memory += 1
        self.scheduler.sizer = self.scheduler.sizer.cut()
        mx.clear_cache()
        logger.warning(
            "a step ran out of memory (%s); it was undone and its requests retry, with prefill chunks "
            "cut to fit %s bytes of temporaries",
            error,
            self.scheduler.sizer.reserve,
        )
