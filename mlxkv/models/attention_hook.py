"""Where mlx-lm's attention modules meet a cache that attends itself.

Every mlx-lm attention module hands its new keys and values to `cache.update_and_fetch`, then
calls `scaled_dot_product_attention(queries, keys, values, cache=cache, ...)`, a name its model
module imports from `mlx_lm.models.base`. `install` points that name, in the module that defines
an attention class, at `hooked_attention`: it hands the call to a cache with an `attend` method
and to mlx-lm's own function otherwise, so a model keeps running under mlx-lm's caches.
"""

from __future__ import annotations

import sys
from typing import Any, Protocol, runtime_checkable

import mlx.core as mx
from mlx_lm.models import base

NAME = "scaled_dot_product_attention"
_original = base.scaled_dot_product_attention


@runtime_checkable
class AttendingCache(Protocol):
    """A cache that computes attention itself, over keys and values its `update_and_fetch` took."""

    def attend(
        self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, sinks: mx.array | None
    ) -> mx.array: ...


def hooked_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: Any,
    scale: float,
    mask: Any,
    sinks: mx.array | None = None,
) -> mx.array:
    """mlx-lm's `scaled_dot_product_attention`, handed to `cache` when it attends itself (which
    masks by position itself: `mask` is then the model's, for mlx-lm's own caches)."""
    if isinstance(cache, AttendingCache):
        return cache.attend(queries, keys, values, scale, sinks)
    out: mx.array = _original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
    return out


def install(module_class: type) -> bool:
    """Route the attention of `module_class`'s model module through `hooked_attention`; False
    when that module does not call mlx-lm's function by the shared name (it attends some other way)."""
    namespace = sys.modules[module_class.__module__]
    current = getattr(namespace, NAME, None)
    if current is hooked_attention:
        return True
    if current is not _original:
        return False
    setattr(namespace, NAME, hooked_attention)
    return True
