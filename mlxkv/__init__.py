"""mlxkv: paged KV cache and continuous batching for LLM inference with MLX."""

from .attention import reference_attention
from .block_table import BlockTable
from .errors import KVCacheExhausted, MlxkvError, SequenceTooLong, UnknownSequenceError
from .kv_cache import KVBatch, KVCacheManager
from .layout import KVLayout, resolve_layout
from .pool import PagePool

__all__ = [
    "BlockTable",
    "KVBatch",
    "KVCacheExhausted",
    "KVCacheManager",
    "KVLayout",
    "MlxkvError",
    "PagePool",
    "SequenceTooLong",
    "UnknownSequenceError",
    "reference_attention",
    "resolve_layout",
]
