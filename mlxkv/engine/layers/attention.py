"""The layers mlxkv puts in place of an mlx-lm model's attention: each runs the layer's own projections
through its family's adapter and attends over the paged cache; handed mlx-lm's own cache, each is
the original layer."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ...attention.first_chunk import first_chunk_attention
from ...models.adapters import Adapter, Gemma4Adapter, LatentAdapter, ModuleAdapter
from .step_context import StepContext
from .wrapped import Wrapped


class PagedAttention(Wrapped):
    """An mlx-lm attention layer run over the paged cache through its family's adapter.

    Tokens of the packed batch sit on the batch axis, so RoPE takes one offset per token.
    Called with any other cache (mlx-lm's own), it is the original layer, so a model
    handed to mlxkv still runs under mlx-lm.
    """

    def __init__(self, inner: nn.Module, layer: int, adapter: Adapter | ModuleAdapter | LatentAdapter) -> None:
        super().__init__(inner)
        self.layer = layer  # the number of the pages it reads among the cache's layers
        self.adapter = adapter

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        step = StepContext.of(args, kwargs)
        if step is None:
            original: mx.array = self.inner(x, *args, **kwargs)
            return original
        adapter = self.adapter
        assert isinstance(adapter, Adapter), "the other adapters' layers have calls of their own"
        queries, keys, values, gate = adapter(x, step.positions)
        out = self.attend(step, queries, keys, values, write=True)
        projected: mx.array = adapter.out_proj(out if gate is None else out * mx.sigmoid(gate))
        return projected

    def attend(self, step: StepContext, queries: mx.array, keys: mx.array, values: mx.array, write: bool) -> mx.array:
        """`[1, tokens, heads * head_dim]`: the step's `queries` over this layer's pages, after
        writing the new tokens' `keys` and `values` there if `write`."""
        batch = step.batch.for_window(self.adapter.variant.window)
        if write:
            step.cache.write(self.layer, batch, keys, values)
        out = first_chunk_attention(
            step.attention,
            queries,
            keys,
            values,
            *step.cache.kv(self.layer),
            batch,
            step.own_kv,
            self.adapter.scale,
            self.adapter.variant,
        )
        return out.reshape(1, queries.shape[0], -1)


class SharingAttention(PagedAttention):
    """Gemma 4's attention, which hands its new K/V on to the layers that share them, as mlx-lm's
    does (it returns `(output, (keys, values), offset)`). A KV-shared layer (`shared`) attends the
    pages of the layer it shares with (`layer` is that one's number) and writes none: the cache
    keeps no pages for it."""

    adapter: Gemma4Adapter

    def __init__(self, inner: nn.Module, layer: int, adapter: Gemma4Adapter, shared: bool) -> None:
        super().__init__(inner, layer, adapter)
        self.shared = shared

    def __call__(  # type: ignore[override]  # mlx-lm's Gemma 4 layers return a tuple
        self, x: mx.array, *args: Any, shared_kv: tuple[mx.array, mx.array] | None = None, **kwargs: Any
    ) -> tuple[mx.array, tuple[mx.array, mx.array], Any]:
        step = StepContext.of(args, kwargs)
        if step is None:
            original: tuple[mx.array, tuple[mx.array, mx.array], Any] = self.inner(
                x, *args, shared_kv=shared_kv, **kwargs
            )
            return original
        if self.shared:
            assert shared_kv is not None, "a KV-shared layer is called after the layer it shares with"
            queries, (keys, values) = self.adapter.queries(x, step.positions), shared_kv
        else:
            queries, keys, values, _ = self.adapter(x, step.positions)
        out = self.attend(step, queries, keys, values, write=not self.shared)
        return self.adapter.out_proj(out), (keys, values), kwargs.get("offset")


class LatentAttention(PagedAttention):
    """Multi-head latent attention over the paged cache (see `LatentAdapter`): each token's latent
    row is written once, read as both its key and its value, and the output leaves through the
    layer's `unembed_out` and `o_proj`."""

    adapter: LatentAdapter

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        step = StepContext.of(args, kwargs)
        if step is None:
            original: mx.array = self.inner(x, *args, **kwargs)
            return original
        queries, rows, _, _ = self.adapter(x, step.positions)
        return self.adapter.output(self.attend(step, queries, rows, rows, write=True), x)
