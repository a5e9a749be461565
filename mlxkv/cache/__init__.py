"""The KV cache: host-side page pool and page tables, and the K/V tensors they index.

Read bottom-up: `pool` (which pages are free, who holds each, which free ones are still
cached) -> `prefix_cache` (content keys of full pages) -> `page_table` (one sequence's
logical-to-physical pages, started from its cached prefix) -> `storage` (every layer's K and V
pages) -> `batch` (one step's sequences, as attention reads them) -> `page_group` (a group of layers
with pages of their own: the full-attention layers, or a sliding window's) -> `manager` (the sequence
lifecycle over both layouts, chosen in `layout`), which reports its `usage`. Beside the pages:
`pins` keep a prompt prefix's pages from eviction for a while; a hybrid model's recurrent state is
kept per sequence in `state_pool`, read a step at a time through `state_batch`, and snapshotted
for the prefix cache in `state_snapshots`. Under the pool, `disk` files full pages on disk by their
keys, so that a prefix outlives the pool and the process.
"""

from ..deprecation import module_getattr
from .batch import KVBatch
from .layout import KVLayout, resolve_layout
from .manager import KVCacheManager
from .page_table import PageTable
from .pins import Pin
from .pool import PagePool
from .prefix_cache import PrefixCacheStats
from .storage import KVStorage, kv_bytes_per_token
from .usage import KVUsage

__all__ = [
    "KVBatch",
    "KVCacheManager",
    "KVLayout",
    "KVStorage",
    "KVUsage",
    "PagePool",
    "PageTable",
    "Pin",
    "PrefixCacheStats",
    "kv_bytes_per_token",
    "resolve_layout",
]

__getattr__ = module_getattr(__name__, {"BlockTable": ("PageTable", PageTable)})
