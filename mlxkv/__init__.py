"""mlxkv: paged KV cache and continuous batching for LLM inference with MLX."""

from .attention import reference_attention
from .block_table import BlockTable
from .engine import LLMEngine, RequestOutput
from .errors import (
    KVCacheExhausted,
    MlxkvError,
    ModelLoadError,
    RequestTooLong,
    SequenceTooLong,
    UnknownSequenceError,
)
from .kv_cache import KVBatch, KVCacheManager
from .layout import KVLayout, resolve_layout
from .llm import LLM, Completion
from .loading import load
from .pool import PagePool
from .sampling import SamplingParams

__all__ = [
    "BlockTable",
    "Completion",
    "KVBatch",
    "KVCacheExhausted",
    "KVCacheManager",
    "KVLayout",
    "LLM",
    "LLMEngine",
    "MlxkvError",
    "ModelLoadError",
    "PagePool",
    "RequestOutput",
    "RequestTooLong",
    "SamplingParams",
    "SequenceTooLong",
    "UnknownSequenceError",
    "load",
    "reference_attention",
    "resolve_layout",
]
