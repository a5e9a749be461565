"""mlxkv: paged KV cache and continuous batching for LLM inference with MLX.

The package is layered, each layer importing only those below it:
`cache` (pages, block tables, K/V storage) < `attention` (reference path, Metal kernels)
< `engine` (requests, scheduler, model runner, sampling) < `entrypoints` (`LLM`, CLI);
`models` (loading) sits beside the engine, `config` and `errors` are shared.
"""

from .attention import reference_attention
from .cache import (
    BlockTable,
    KVBatch,
    KVCacheManager,
    KVLayout,
    PagePool,
    resolve_layout,
)
from .config import EngineConfig
from .engine import AsyncLLM, LLMEngine, RequestOutput
from .engine.sampling import SamplingParams
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
    "AsyncLLM",
    "BlockTable",
    "Completion",
    "EngineConfig",
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
    "RequestFailed",
    "UnknownSequenceError",
    "load",
    "reference_attention",
    "resolve_layout",
]
