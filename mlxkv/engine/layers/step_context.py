"""What every layer of a step is handed as its `cache`: where the step's tokens go and sit."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

from ...attention.backend import AttentionFn
from ...cache.batch import KVBatch
from ...cache.manager import KVCacheManager
from ...cache.state_batch import StateBatch
from ...models.rotary import Positions

if TYPE_CHECKING:
    from ..images import StepMedia


@dataclass(frozen=True)
class StepContext:
    """Handed to every layer as its `cache`: where this step's tokens go and sit, how many of
    each row's first tokens attend their own K/V as computed (`own_kv`), and, for a hybrid
    model's recurrent layers, the step's rows grouped with their state indices (`states`).

    `own_kv` is None when no row has such tokens, as in every step without quantized pages.
    Model code that asks a cache for a mask gets None (the paged attention masks by
    position itself, a recurrent layer by its row group), and one that reads `offset` gets 0
    (adapters use each token's own position instead)."""

    cache: KVCacheManager
    batch: KVBatch
    positions: Positions
    attention: AttentionFn
    own_kv: np.ndarray | None
    states: StateBatch | None = None
    offset: int = 0
    start_position: int = 0  # Llama 4's decoder reads it beside `offset` to make a mask mlxkv ignores
    final: list[mx.array] = field(default_factory=list)  # see `current`
    media: StepMedia | None = None  # what the step's images put in (see `images`)

    def make_mask(self, *args: object, **kwargs: object) -> None:
        return None

    def maybe_trim_front(self) -> None:
        """Llama 4's decoder trims its chunked caches before a step; pages need no trimming."""

    @staticmethod
    def of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> StepContext | None:
        """The step a wrapped layer was called in: its `cache` (a keyword, else a positional argument:
        Hunyuan's comes before the projections it hands on) when that is a `StepContext`; None when
        mlx-lm's own cache came instead."""
        cache = kwargs.get("cache")
        if isinstance(cache, StepContext):
            return cache
        return next((arg for arg in args if isinstance(arg, StepContext)), None)

    @contextmanager
    def entered(self) -> Iterator[StepContext]:
        """This step as `current()` while the decoder runs it."""
        token = _CURRENT.set(self)
        try:
            yield self
        finally:
            _CURRENT.reset(token)

    @staticmethod
    def current() -> StepContext | None:
        """The step the decoder is running now, for the modules it calls without a cache (GPT-2's
        position embeddings, the final norm of a decoder that computes the logits itself, which
        leaves the final hidden states in `final`); None outside one (mlx-lm running the model)."""
        return _CURRENT.get()


_CURRENT: ContextVar[StepContext | None] = ContextVar("step", default=None)
