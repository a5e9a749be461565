"""A rank's guard against a tensor-parallel group that stops answering: a collective waiting on a
process that is stopped (not dead: a dead one's socket closes and the step fails) would block forever.
Rank 0 watches each step; the other ranks watch their wait for rank 0 after a nap (see `naps`)."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ...errors import TensorParallelError

logger = logging.getLogger(__name__)
GRACE_S = 2.0  # how long a server's /health reports the failure before the process ends


class RankWatchdog:
    """Ends the process with a clear error when one wait `watching` has lasted more than `timeout_s`
    seconds; `report(error)` runs first (rank 0's engine marks itself lost, so /health answers 503),
    and the end comes `GRACE_S` later. The stuck collective cannot be interrupted, hence the hard
    exit. `waiter` and `awaited` name who waited on whom in the error."""

    def __init__(
        self,
        timeout_s: float,
        report: Callable[[TensorParallelError], None],
        waiter: str = "a step",
        awaited: str = "the other processes",
    ) -> None:
        self.timeout_s = timeout_s
        self.report = report
        self.waiter, self.awaited = waiter, awaited
        self.started: float | None = None  # when the wait in progress began (None: none is)
        threading.Thread(target=self._watch, name="mlxkv-rank-watchdog", daemon=True).start()

    @contextmanager
    def watching(self) -> Iterator[None]:
        """One wait, watched."""
        self.started = time.monotonic()
        try:
            yield
        finally:
            self.started = None

    def _watch(self) -> None:
        while True:
            started = self.started
            if started is not None and time.monotonic() - started > self.timeout_s:
                error = TensorParallelError(
                    f"the tensor-parallel group failed: {self.waiter} waited more than {self.timeout_s:g} s "
                    f"(rank_timeout_s) for {self.awaited}, which stopped answering"
                )
                logger.error("%s; this process ends", error)
                self.report(error)
                time.sleep(GRACE_S)
                print(f"error: {error}", file=sys.stderr, flush=True)
                os._exit(1)
            time.sleep(min(1.0, self.timeout_s / 4))
