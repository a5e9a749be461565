"""The KV cache: host-side page pool and block tables, and the K/V tensors they index.

Read bottom-up: `pool` (which pages are free, who holds each, which free ones are still
cached) -> `prefix_cache` (content keys of full pages) -> `block_table` (one sequence's
logical-to-physical map, started from its cached prefix) -> `storage` (the per-layer K/V
pools) -> `manager` (the sequence lifecycle over both layouts, chosen in `layout`).
Imports only `errors`.
"""

from .block_table import BlockTable
from .layout import KVLayout, resolve_layout
from .manager import KVBatch, KVCacheManager, KVUsage
from .pool import PagePool
from .prefix_cache import PrefixCacheStats
from .storage import KVStorage, kv_bytes_per_token

__all__ = ["BlockTable", "KVBatch", "KVCacheManager", "KVLayout", "KVStorage", "KVUsage", "PagePool",
           "PrefixCacheStats", "kv_bytes_per_token", "resolve_layout"]
