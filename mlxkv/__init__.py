"""mlxkv: paged KV cache and continuous batching for LLM inference with MLX.

The package is layered, each layer importing only those below it:
`cache` (pages, page tables, K/V storage) < `attention` (reference path, Metal kernels)
< `engine` (requests, scheduler, model runner, sampling) < `entrypoints` (`LLM`, CLI, server);
`models` (loading) sits beside the engine; `settings`, `config`, `errors` and `deprecation` (old
names kept for one release) are shared.
"""

from .attention import reference_attention
from .cache import KVBatch, KVCacheManager, KVLayout, KVUsage, PagePool, PageTable, Pin, resolve_layout
from .config import EngineConfig
from .deprecation import module_getattr
from .engine import AsyncLLM, EngineStats, ImagePrompt, LLMEngine, RequestOutput, SamplingParams
from .entrypoints import LLM, Completion
from .errors import (
    KVCacheExhausted,
    MlxkvError,
    ModelLoadError,
    RequestFailed,
    RequestTooLong,
    SequenceTooLong,
    UnknownSequenceError,
)
from .models import load

__all__ = [
    "LLM",
    "AsyncLLM",
    "Completion",
    "EngineConfig",
    "EngineStats",
    "ImagePrompt",
    "KVBatch",
    "KVCacheExhausted",
    "KVCacheManager",
    "KVLayout",
    "KVUsage",
    "LLMEngine",
    "MlxkvError",
    "ModelLoadError",
    "PagePool",
    "PageTable",
    "Pin",
    "RequestFailed",
    "RequestOutput",
    "RequestTooLong",
    "SamplingParams",
    "SequenceTooLong",
    "UnknownSequenceError",
    "load",
    "reference_attention",
    "resolve_layout",
]

__getattr__ = module_getattr(__name__, {"BlockTable": ("PageTable", PageTable)})
