"""The exceptions mlxkv raises on purpose; every one derives from `MlxkvError`. And how an
out-of-memory error from MLX is told from the others."""

import re


class MlxkvError(Exception):
    """Base class of mlxkv's own errors."""


class KVCacheExhausted(MlxkvError):
    """Not enough free KV pages (or room for another sequence) for a request; nothing was changed."""

    def __init__(self, requested: int, free: int, what: str = "pages") -> None:
        super().__init__(f"KV cache exhausted: asked for {requested} {what}, {free} free")
        self.requested = requested
        self.free = free


class UnknownSequenceError(MlxkvError, LookupError):
    """A sequence or request id that is not live (never claimed, or already released)."""

    def __init__(self, seq_id: object) -> None:
        super().__init__(f"unknown sequence id {seq_id!r}: it was never claimed or was already released")
        self.seq_id = seq_id


class SequenceTooLong(MlxkvError, ValueError):
    """A sequence would outgrow the most tokens one sequence may hold."""

    def __init__(self, seq_id: object, length: int, limit: int) -> None:
        super().__init__(f"sequence {seq_id!r} would hold {counted(length, 'token')}, more than max_model_len={limit}")
        self.seq_id = seq_id
        self.length = length
        self.limit = limit


class ModelLoadError(MlxkvError):
    """A model that cannot be loaded: missing path, no config.json, unsupported architecture."""


class MemoryBudgetError(MlxkvError, ValueError):
    """The memory budget cannot hold what the settings ask beside the weights (the KV cache, the
    smallest step): more memory would make it fit, other settings need not change."""


class RequestTooLong(MlxkvError, ValueError):
    """A request whose prompt plus max_tokens can never fit the KV cache."""


class TensorParallelError(MlxkvError):
    """The tensor-parallel group cannot go on (a rank died or stopped answering): every request fails."""


class RequestFailed(MlxkvError):
    """A request ended by an error in the step that ran it; the other requests went on."""

    def __init__(self, request_id: str, cause: BaseException) -> None:
        super().__init__(f"request {request_id!r} failed: {cause}")
        self.request_id = request_id


_OUT_OF_MEMORY = re.compile(
    r"out ?of ?memory|insufficient memory|unable to allocate|attempting to allocate|bad_alloc|resource limit",
    re.IGNORECASE,
)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is MLX (or the system) failing to allocate: Metal's "Insufficient Memory"
    command buffers, its allocator's refusals, a C++ `bad_alloc`, Python's `MemoryError`."""
    return isinstance(error, MemoryError) or bool(_OUT_OF_MEMORY.search(str(error)))


def counted(count: int, noun: str) -> str:
    """`count` of `noun` as a message says it: "1 token", "3 tokens"."""
    return f"{count} {noun}{'' if count == 1 else 's'}"
