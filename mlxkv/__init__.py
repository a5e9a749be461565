"""mlxkv: paged KV cache and continuous batching for LLM inference with MLX."""

from .attention import reference_attention
from .engine import LLMEngine, RequestOutput
from .block_table import BlockTable
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
    "LLM",
    "Completion",
    "LLMEngine",
    "ModelLoadError",
    "RequestOutput",
    "RequestTooLong",
    "SamplingParams",
    "load",
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
