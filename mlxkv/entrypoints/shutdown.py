"""How `mlxkv serve` ends on Ctrl-C (or SIGTERM): the first signal stops taking connections and
aborts every running request, so that each stream ends at once with finish reason "abort" and the
server exits within moments, quietly; a second signal ends the process at once.

Uvicorn alone waits for every open stream to finish generating before it exits, and a second
Ctrl-C then cancels the streams mid-write, printing a traceback for each.
"""

from __future__ import annotations

import logging
import os
import sys
from types import FrameType

import uvicorn

from .hosting import ModelHost

logger = logging.getLogger(__name__)


class Server(uvicorn.Server):
    """Uvicorn's server, ending the requests of `host`'s models on the first signal and the process
    on the second."""

    def __init__(self, config: uvicorn.Config, host: ModelHost) -> None:
        super().__init__(config)
        self.host = host
        self.stopping = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # The flag is set first: a second signal can run this handler again in the middle of the
        # first one, before uvicorn's `should_exit` is set (uvicorn then cancels every stream).
        if self.stopping:
            sys.stderr.write("mlxkv: interrupted again; exiting now\n")
            sys.stderr.flush()
            os._exit(130)
        self.stopping = True
        aborted = self.host.abort_all()
        logger.info("stopping: no new connections; %d running requests aborted", aborted)
        super().handle_exit(sig, frame)
