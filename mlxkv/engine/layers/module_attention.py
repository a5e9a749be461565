"""A family's own mlx-lm attention module run over the paged cache (see `models.attention_hook`).

The module is handed the packed tokens on its batch axis, one token a row, with a cache whose
`offset` is each token's position: its RoPE (and anything else it computes from the offset)
then takes each token's own position, and its mask, for one token a row, is None.
"""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx

from ...models.adapters import ModuleAdapter
from .attention import PagedAttention
from .step_context import StepContext

INPUTS = ("x", "inputs", "hidden_states")  # what families call the input when they pass it by name


class LayerCache:
    """What one layer's module is handed as its cache in a step: `update_and_fetch` writes its new
    tokens' K/V to the layer's pages, and `attend` (through `attention_hook`) attends them as
    cached (whatever the module spread or cast them to, see `ModuleAdapter.query_order`). A
    module that scales its queries by an offset it cannot take per token (Llama 4's NoPE layers)
    is handed offset 0, under which it leaves them as they are, and `attend` scales them."""

    def __init__(self, step: StepContext, layer: ModuleAttention) -> None:
        self.step = step
        self.layer = layer
        self.scales = layer.adapter.query_scale(step.positions.array)
        self.offset = step.positions.array if self.scales is None else 0  # `attend` scales the queries instead
        self.cached: tuple[mx.array, mx.array] | None = None  # the pages' keys and values: what `attend` reads

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write `keys` and `values` (`[tokens, kv_heads, 1, width]`) and hand them back, each as
        wide as the pages (zeros after a narrower one's own values)."""
        width = self.layer.adapter.head_dim
        keys, values = _widened(keys, width), _widened(values, width)
        batch = self.step.batch.for_window(self.layer.adapter.variant.window)
        self.cached = keys[:, :, 0], values[:, :, 0]
        self.step.cache.write(self.layer.layer, batch, *self.cached)
        return keys, values

    def attend(
        self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, sinks: mx.array | None
    ) -> mx.array:
        """`[tokens, heads, 1, head_dim]`: the step's queries over the layer's pages (the module's
        `scale` and `sinks` are those its adapter learned)."""
        tokens, heads = queries.shape[:2]
        if self.scales is not None:
            queries = (queries * self.scales[:, None, None, None]).astype(queries.dtype)
        assert self.cached is not None, "mlx-lm's modules cache their keys and values before attending"
        order = self.layer.adapter.query_order
        queries = _widened(queries, self.layer.adapter.head_dim)[:, :, 0]  # zero columns add nothing to a score
        if order is not None:
            queries = queries[:, order]
        out = self.layer.attend(self.step, queries, *self.cached, write=False).reshape(tokens, heads, -1)
        if order is not None:
            out = out[:, mx.argsort(order)]
        return out[:, :, None, : self.layer.adapter.value_dim]

    def make_mask(self, *args: object, **kwargs: object) -> None:
        return None


def _widened(x: mx.array, width: int) -> mx.array:
    """`x` with zeros after its last axis's values, to `width` (as it is when as wide)."""
    extra = width - x.shape[-1]
    return x if extra == 0 else mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


class ModuleAttention(PagedAttention):
    """An mlx-lm attention module run unchanged over the paged cache, its tokens on the batch axis.
    Called with any other cache (mlx-lm's own), it is the original module."""

    adapter: ModuleAdapter

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # GPT-J passes its input by name
        step = StepContext.of(args, kwargs)
        if step is None:
            original: mx.array = self.inner(*args, **kwargs)
            return original
        view = LayerCache(step, self)
        args = tuple(view if arg is step else arg for arg in args)
        kwargs = {name: view if value is step else value for name, value in kwargs.items()}
        name = next((n for n in INPUTS if n in kwargs), None)
        x = args[0] if name is None else kwargs[name]
        tokens, rows = x.shape[1], x.reshape(x.shape[1], 1, -1)
        args, kwargs = (args, {**kwargs, name: rows}) if name else ((rows, *args[1:]), kwargs)
        out = self.inner(*args, **kwargs)
        if isinstance(out, tuple):  # Hunyuan's hands its projections on to the next layer as they are
            return (out[0].reshape(1, tokens, -1), *out[1:])
        return cast(mx.array, out).reshape(1, tokens, -1)
