"""The disk tier under the page pool: full pages filed on disk by their page keys, so that a prefix
outlives the pool and the process.

`run_file` is the file format (pages under their keys, a namespace, a checksum), `namespace` the
digest of what the pages belong to (the model, the cache's format), `writer` the thread that
writes them, `tier` the index over the files, what is restored from it and what is dropped,
least recently used first, beyond its size; `pages` the pages a cache manager files there and
may restore; `peers` what keeps a tensor-parallel group's tiers, one a rank, in step with rank 0's.
"""

from .namespace import DiskSpec, namespace
from .pages import DiskPages
from .peers import DiskMoves, PeerCheck
from .tier import DiskStats, DiskTier

__all__ = ["DiskMoves", "DiskPages", "DiskSpec", "DiskStats", "DiskTier", "PeerCheck", "namespace"]
