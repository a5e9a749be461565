"""How mlxkv runs each mlx-lm attention family over the paged cache.

Most families run their own attention module unchanged (`ModuleAdapter`, through
`attention_hook`). The families below with an adapter of their own predate that path or need
more: an adapter turns one layer's input into per-token queries, keys and values through the
layer's own modules (projections, norms, RoPE), and says how the layer attends: its scale,
sliding window, soft-cap and sinks. The model's own code computes everything else.
"""

from __future__ import annotations

from collections.abc import Callable
from copy import copy
from dataclasses import replace
from typing import Any, NamedTuple, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ChunkedKVCache, KVCache, RotatingKVCache

from ..attention.variant import Variant
from ..errors import ModelLoadError
from .attention_hook import install
from .rotary import Positions, Rotation
from .structure import (
    activation_dtype,
    attention_module,
    decoder,
    decoder_layers,
    hidden_size,
    mlx_lm_module,
    model_args,
)


def _first(module: object, *names: str) -> Any:
    return next(getattr(module, name) for name in names if hasattr(module, name))


class Projection(NamedTuple):
    """One layer's per-token queries `[tokens, heads, head_dim]`, keys and values `[tokens,
    kv_heads, head_dim]`, and the gate its attention output is multiplied by the sigmoid of
    before `o_proj` (`[1, tokens, heads * head_dim]`; None for ungated layers)."""

    queries: mx.array
    keys: mx.array
    values: mx.array
    gate: mx.array | None = None


class Adapter:
    """Separate q/k/v projections, optional q/k norms (per head or over the full width, as
    the norm's size says), the layer's own RoPE at each token's position (an identity
    for layers without it, as SmolLM3's), its scale, soft-cap (Gemma 2) and sinks (GPT-OSS)."""

    def __init__(self, attn: nn.Module, window: int | None) -> None:
        self.attn = attn
        self.heads = _first(attn, "n_heads", "num_heads", "num_attention_heads")
        self.kv_heads = _first(attn, "n_kv_heads", "num_key_value_heads")
        self.scale = float(_first(attn, "scale", "sm_scale"))
        self.variant = Variant(
            window=window, softcap=getattr(attn, "attn_logit_softcapping", None), sinks=getattr(attn, "sinks", None)
        )
        self._rotations: dict[tuple[Any, ...], Rotation | None] = {}
        norms = [(q, k) for q, k in (("q_norm", "k_norm"), ("q_layernorm", "k_layernorm")) if hasattr(attn, k)]
        self._norms = (getattr(attn, norms[0][0]), getattr(attn, norms[0][1])) if norms else None
        self.out_proj = _first(attn, "o_proj", "out_proj")  # LFM2's name
        # mlx-lm's own (an engine before may have wrapped it); None: a layer without RoPE (Nemotron-H's)
        self.rope = mlx_lm_module(attn, "rope") if hasattr(attn, "rope") else None

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        attn = self.attn
        return attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)

    def gate(self, queries: mx.array) -> tuple[mx.array, mx.array | None]:
        """The queries of `q_proj`'s output, and the output gate beside them (None: no gate)."""
        return queries, None

    def __call__(self, x: mx.array, positions: Positions) -> Projection:
        """The projection of the packed tokens `x` (`[1, tokens, hidden]`) at `positions`."""
        tokens, norms = x.shape[1], self._norms
        queries, keys, values = self.project(x)
        queries, gate = self.gate(queries)
        full_width = norms is not None and norms[0].weight.shape[0] == queries.shape[-1]
        if norms is not None and full_width:
            queries, keys = norms[0](queries), norms[1](keys)
        queries = queries.reshape(tokens, self.heads, -1)
        keys, values = keys.reshape(tokens, self.kv_heads, -1), values.reshape(tokens, self.kv_heads, -1)
        if norms is not None and not full_width:
            queries, keys = norms[0](queries), norms[1](keys)
        on_cpu = mx.default_device() == mx.cpu
        queries, keys = self._rotated(queries, positions, on_cpu), self._rotated(keys, positions, on_cpu)
        return Projection(queries, keys, values, gate)

    def _rotated(self, x: mx.array, positions: Positions, on_cpu: bool) -> mx.array:
        """`x` (`[tokens, heads, head_dim]`) through the layer's RoPE: by the step's shared tables
        where they equal it (see `rotary`), else by the module with one offset per token; at
        each M-RoPE axis in turn where the step has them."""
        if positions.axes is not None and self.rope is not None:
            return positions.select([self._rotated(x, axis, on_cpu) for axis in positions.by_axis()])
        key = (x.dtype, x.shape[-1], on_cpu)
        if key not in self._rotations:
            self._rotations[key] = Rotation.of(self.rope, x.shape[-1], x.dtype) if self.rope is not None else None
        rotation = self._rotations[key]
        if rotation is None:
            return x if self.rope is None else self.rope(x[:, :, None], offset=positions.array).squeeze(2)
        return positions.rotate(rotation, x)


class FusedAdapter(Adapter):
    """Phi-3: one `qkv_proj` whose output is the queries, then the keys, then the values."""

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        width = self.attn.head_dim
        bounds = [self.heads * width, (self.heads + self.kv_heads) * width]
        queries, keys, values = mx.split(self.attn.qkv_proj(x), bounds, axis=-1)
        return queries, keys, values


class GatedAdapter(Adapter):
    """Qwen3-Next and Qwen3.5: `q_proj` gives each head its query and an output gate side by side."""

    def gate(self, queries: mx.array) -> tuple[mx.array, mx.array | None]:
        tokens = queries.shape[1]
        queries, gate = mx.split(queries.reshape(1, tokens, self.heads, -1), 2, axis=-1)
        return queries.reshape(1, tokens, -1), gate.reshape(1, tokens, -1)


class Gemma4Adapter(Adapter):
    """Gemma 4: values through a norm without a scale (`v_norm`), and a global layer without
    `v_proj` (`attention_k_eq_v`) takes its values from the keys' projection before the norms. A
    KV-shared layer has no K/V projections at all: it projects its `queries` alone."""

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        attn = self.attn
        keys = attn.k_proj(x)
        return attn.q_proj(x), keys, attn.v_proj(x) if hasattr(attn, "v_proj") else keys

    def __call__(self, x: mx.array, positions: Positions) -> Projection:
        projected = super().__call__(x, positions)
        return projected._replace(values=self.attn.v_norm(projected.values))

    def queries(self, x: mx.array, positions: Positions) -> mx.array:
        """The queries alone, `[tokens, heads, head_dim]`, normed and rotated as `__call__`'s."""
        queries = self.attn.q_norm(self.attn.q_proj(x).reshape(x.shape[1], self.heads, -1))
        return self._rotated(queries, positions, mx.default_device() == mx.cpu)


class Ministral3Adapter(Adapter):
    """Ministral 3: queries scaled by 1 + beta * log(1 + floor(position / original context)),
    computed here per token (the model computes it from one offset for the whole batch)."""

    def __init__(self, attn: nn.Module, window: int | None, rope: dict[str, Any]) -> None:
        super().__init__(attn, window)
        self.beta = rope["llama_4_scaling_beta"]
        self.original = rope["original_max_position_embeddings"]

    def __call__(self, x: mx.array, positions: Positions) -> Projection:
        projected = super().__call__(x, positions)
        factor = 1 + self.beta * mx.log(1 + mx.floor(positions.array / self.original))
        return projected._replace(queries=projected.queries * factor[:, None, None].astype(projected.queries.dtype))


class _Probe:
    """The cache a `ModuleAdapter` runs its module with once, on one token, to learn its geometry."""

    offset = 0

    def __init__(self) -> None:
        self.fetched: tuple[mx.array, mx.array] | None = None
        self.attended: tuple[mx.array, mx.array, mx.array, float, mx.array | None] | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.fetched = keys, values
        return keys, values

    def attend(
        self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, sinks: mx.array | None
    ) -> mx.array:
        self.attended = queries, keys, values, scale, sinks
        return mx.zeros((*queries.shape[:-1], values.shape[-1]), queries.dtype)

    def make_mask(self, *args: object, **kwargs: object) -> None:
        return None


def _probed(attn: nn.Module, x: mx.array) -> _Probe:
    """The probing cache `attn` was run with on `x` (the cache by name, and no mask: PLaMo's
    module calls its mask attention_mask)."""
    probe = _Probe()
    try:
        attn(x, cache=probe)
    except Exception as exc:
        raise ModelLoadError(f"its attention ({type(attn).__name__}) does not run over mlxkv's pages: {exc}") from None
    return probe


SPREADS: dict[str, Callable[[mx.array, int], mx.array]] = {  # how a module may spread its KV heads over its queries
    "repeat": lambda cached, n: mx.repeat(cached, n, axis=1),  # grouped-query attention's grouping
    "tile": lambda cached, n: mx.tile(cached, (1, n, 1, 1)),  # PLaMo's
}


def _spread(attn: nn.Module, width: int, dtype: mx.Dtype) -> mx.array | None:
    """The query order under which the pages stand for what `attn` attends when that is not what it
    cached: cast to another float type (StableLM attends in float32) or spread over its query heads,
    repeated (None: the order as it is) or tiled (PLaMo's: query head h reads KV head h mod
    kv_heads). Checked on one random token, the one probe that computes anything."""
    probe = _probed(attn, mx.random.normal((1, 1, width), key=mx.random.key(0)).astype(dtype))
    assert probe.attended is not None and probe.fetched is not None
    queries, attended, fetched = probe.attended[0], probe.attended[1:3], probe.fetched
    for name, spread in SPREADS.items():
        if all(_cast_of(a, spread(f, a.shape[1] // f.shape[1])) for a, f in zip(attended, fetched)):
            return None if name == "repeat" else _tiled_order(queries.shape[1], fetched[0].shape[1])
    raise ModelLoadError(
        f"its attention ({type(attn).__name__}) transforms the cached keys and values before attending"
    )


def _cast_of(attended: mx.array, cached: mx.array) -> bool:
    """Whether `attended` is `cached`, at most cast to another dtype."""
    return attended.shape == cached.shape and bool(mx.array_equal(attended, cached.astype(attended.dtype)).item())


def _tiled_order(heads: int, kv_heads: int) -> mx.array:
    """The order of `heads` query heads that puts tiled KV heads (head h reads KV head h mod
    `kv_heads`) into the pages' groups (head j reads KV head j // (heads // kv_heads))."""
    group = heads // kv_heads
    return mx.array([(j % group) * kv_heads + j // group for j in range(heads)])


class ModuleAdapter:
    """A layer run through its own mlx-lm attention module, unchanged: its heads, head dim, value
    width, scale and sinks are what the module hands the cache when run once on one token (lazily:
    nothing is computed). Refused with `ModelLoadError` when the module attends some other way than handing
    the keys and values it cached to mlx-lm's `scaled_dot_product_attention`."""

    def __init__(self, attn: nn.Module, variant: Variant, width: int, dtype: mx.Dtype) -> None:
        self.attn = attn
        name = type(attn).__name__
        if not install(type(attn)):
            raise ModelLoadError(f"its attention ({name}) does not call mlx-lm's scaled_dot_product_attention")
        probe = _probed(attn, mx.zeros((1, 1, width), dtype))
        if probe.attended is None or probe.fetched is None:
            raise ModelLoadError(f"its attention ({name}) does not attend the keys and values it caches")
        queries, keys, values, scale, sinks = probe.attended
        self.query_order: mx.array | None = None  # see `_spread`
        if keys is not probe.fetched[0] or values is not probe.fetched[1]:
            self.query_order = _spread(attn, width, dtype)
        keys, values = probe.fetched
        self.heads, self.kv_heads = queries.shape[1], keys.shape[1]
        self.value_dim = values.shape[-1]  # DeepSeek V2's (and MiniCPM 3's) are narrower than its keys
        self.head_dim = max(keys.shape[-1], self.value_dim)  # the pages' width: the narrower is zero-padded
        self.scale = float(scale)
        self.variant = replace(variant, sinks=sinks)
        tuned = getattr(attn, "attn_temperature_tuning", False) and not getattr(attn, "use_rope", True)
        self.temperature = (attn.floor_scale, attn.attn_scale) if tuned else None

    @classmethod
    def like(cls, other: ModuleAdapter, attn: nn.Module, variant: Variant) -> ModuleAdapter:
        """An adapter for `attn` with `other`'s geometry, scale and sinks, attending as `variant` says."""
        adapter = copy(other)
        adapter.attn, adapter.variant = attn, replace(variant, sinks=other.variant.sinks)
        return adapter

    def query_scale(self, positions: mx.array) -> mx.array | None:
        """Each token's query scale, `[tokens]`, where the module scales its queries by position
        (Llama 4's NoPE layers: `1 + attn_scale * log(1 + floor((position + 1) / floor_scale))`),
        which it computes from one offset for all its rows; else None."""
        if self.temperature is None:
            return None
        floor_scale, attn_scale = self.temperature
        scales: mx.array = mx.log(mx.floor((positions + 1) / floor_scale) + 1.0) * attn_scale + 1.0
        return scales


class LatentAdapter:
    """Multi-head latent attention (DeepSeek V3, Kimi K2, GLM-4.7-Flash) in the absorbed form, as
    mlx-lm's decode step computes it: a token's cache is its normed latent and its RoPE key, one row
    shared by every head and read as its own value (the cache's `keys_only` layers); each head's
    query is its `embed_q`-absorbed no-RoPE part beside its rotated part, and the first `rank`
    values of each head's output go through `unembed_out` (see `LatentAttention`)."""

    def __init__(self, attn: nn.Module) -> None:
        self.attn = attn
        self.heads, self.kv_heads = attn.num_heads, 1
        self.rank, self.rope_dim = attn.kv_lora_rank, attn.qk_rope_head_dim
        self.head_dim = self.rank + self.rope_dim
        self.scale = float(attn.scale)
        self.variant = Variant()
        self.out_proj = attn.o_proj if hasattr(attn, "o_proj") else attn.dense  # Ling's is `dense`

    def __call__(self, x: mx.array, positions: Positions) -> Projection:
        """The queries `[tokens, heads, rank + rope]` and the latent rows `[tokens, 1, rank + rope]`
        (as keys and values) of the packed tokens `x` (`[1, tokens, hidden]`)."""
        attn, tokens = self.attn, x.shape[1]
        x = x.reshape(tokens, 1, -1)
        low_rank = getattr(attn, "q_lora_rank", None) is not None
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))) if low_rank else attn.q_proj(x)
        q_nope, q_pe = mx.split(q.reshape(tokens, self.heads, 1, -1), [attn.qk_nope_head_dim], axis=-1)
        latent, k_pe = mx.split(attn.kv_a_proj_with_mqa(x), [self.rank], axis=-1)
        if hasattr(attn, "rope"):  # Kimi Linear's and Kimi K3's latent attention use no positions
            q_pe = attn.rope(q_pe, positions.array)
            k_pe = attn.rope(k_pe[:, None], positions.array)[:, 0]
        queries = mx.concatenate([attn.embed_q(q_nope), q_pe], axis=-1)[:, :, 0]
        rows = mx.concatenate([attn.kv_a_layernorm(latent), k_pe], axis=-1)
        return Projection(queries, rows, rows)

    def output(self, out: mx.array, x: mx.array) -> mx.array:
        """The layer's output `[1, tokens, hidden]` from the attention's `[1, tokens, heads * (rank + rope)]`
        for the layer's input `x`, by which Kimi K3 gates each value and Ling 2.5 each head."""
        tokens = out.shape[1]
        latent = out.reshape(tokens, self.heads, 1, self.head_dim)[..., : self.rank]
        values = self.attn.unembed_out(latent).reshape(1, tokens, self.heads, -1)
        if hasattr(self.attn, "g_proj") and getattr(self.attn, "use_gate", True):
            gate = self.attn.g_proj(x)
            if gate.shape[-1] == self.heads:  # one gate a head, in float32 as Ling computes it
                values = values * mx.sigmoid(gate.astype(mx.float32)).astype(values.dtype)[..., None]
            else:
                values = values * mx.sigmoid(gate).reshape(values.shape)
        return self.out_proj(values.reshape(1, tokens, -1))  # type: ignore[no-any-return]


KEPT = {  # what the mlx-lm caches that no page stands for hold
    "CacheList": "several caches (mlx-lm's CacheList)",
}


def _cache_variant(model: nn.Module, index: int) -> Variant:
    """Layer `index`'s window or chunk as mlx-lm's caches for `model` say: a rotating cache's size,
    a chunked cache's chunk (Llama 4's chunked local attention)."""
    cache = model.make_cache()[index] if hasattr(model, "make_cache") else KVCache()
    if isinstance(cache, RotatingKVCache):
        return Variant(window=cache.max_size)
    if isinstance(cache, ChunkedKVCache):
        return Variant(chunk=cache.chunk_size)
    if type(cache) is not KVCache:
        kept = KEPT.get(type(cache).__name__, f"mlx-lm's {type(cache).__name__}")
        raise ModelLoadError(f"its layer {index} keeps {kept}, which mlxkv's pages do not stand for yet")
    return Variant()


def _window(model: nn.Module, attn: nn.Module, index: int) -> int | None:
    """The layer's sliding window as mlx-lm applies it: `layer_types` (Llama-style configs, and
    GPT-OSS, whose model fills in its default alternation) or Gemma 3's pattern; mlx-lm
    ignores other window fields, and so does mlxkv."""
    args = model_args(model)
    layer_types = getattr(decoder(model), "layer_types", None) or getattr(args, "layer_types", None)
    if layer_types:
        return cast(int, args.sliding_window) if layer_types[index] == "sliding_attention" else None
    if getattr(attn, "is_sliding", False):
        return cast(int, args.sliding_window)
    return None


FAMILIES = (
    "llama",
    "mistral",
    "ministral3",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "mixtral",
    "phi3",
    "gemma2",
    "gemma3_text",
    "granite",
    "smollm3",
    "olmo2",
    "glm4",
    "gpt_oss",
    "gemma4",
    "gemma4_text",
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_moe",
    "lfm2",
    "lfm2_moe",
    "granitemoehybrid",
    "nemotron_h",
)


def _gated(attn: nn.Module) -> bool:
    """Whether `q_proj` gives twice the queries: each head's output gate beside its query."""
    heads, head_dim = _first(attn, "n_heads", "num_heads", "num_attention_heads"), getattr(attn, "head_dim", None)
    return head_dim is not None and hasattr(attn, "q_proj") and attn.q_proj.weight.shape[0] == 2 * heads * head_dim


def _module_adapter(model: nn.Module, index: int, attn: nn.Module) -> ModuleAdapter:
    """A `ModuleAdapter` for layer `index`; a module that cannot run alone but is of its previous
    layer's class takes that layer's geometry (Hunyuan's cross-layer attention layers project no
    keys or values, and attend the previous layer's projections the decoder hands them)."""
    variant, width, dtype = _cache_variant(model, index), hidden_size(model), activation_dtype(model)
    try:
        return ModuleAdapter(attn, variant, width, dtype)
    except ModelLoadError:
        previous = _attention_module(model, index - 1) if index > 0 else None
        if type(previous) is not type(attn):
            raise
        return ModuleAdapter.like(_module_adapter(model, index - 1, cast(nn.Module, previous)), attn, variant)


def _attention_module(model: nn.Module, index: int) -> nn.Module | None:
    """Layer `index`'s attention module as mlx-lm made it, if it has one."""
    try:
        return attention_module(decoder_layers(model)[index])
    except StopIteration:
        return None


def adapter_for(model: nn.Module, index: int, attn: nn.Module) -> Adapter | ModuleAdapter | LatentAdapter:
    """The adapter of layer `index`'s attention module `attn` in `model` (an mlx-lm text model)."""
    args = model_args(model)
    if hasattr(attn, "indexer"):
        raise ModelLoadError("its sparse indexer (each query attends only the tokens it ranks highest)")
    if hasattr(attn, "kv_lora_rank") and hasattr(attn, "embed_q"):
        return LatentAdapter(attn)
    if args.model_type not in FAMILIES:
        return _module_adapter(model, index, attn)
    window = _window(model, attn, index)
    if hasattr(attn, "qkv_proj"):
        return FusedAdapter(attn, window)
    if args.model_type == "ministral3":
        return Ministral3Adapter(attn, window, args.rope_parameters)
    if args.model_type == "gemma4_text":
        return Gemma4Adapter(attn, window)
    if _gated(attn):
        return GatedAdapter(attn, window)
    return Adapter(attn, window)
