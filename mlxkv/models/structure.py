"""How an mlx-lm model is put together, as mlxkv runs it: its text model, decoder and embeddings,
and which decoder layers attend through the K/V pages and which keep a recurrent state.

A hybrid family (Qwen3.5, Qwen3-Next, LFM2, Granite 4, Nemotron-H) interleaves attention layers with layers
that keep a per-sequence state instead of K/V: a gated delta rule's state, a Mamba state, a
short convolution's last inputs. mlx-lm's own `make_cache` says which is which (an
`ArraysCache` for a recurrent layer), and each family names its recurrent module in one of a
few ways.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache

from ..cache.state_pool import StateShape
from ..errors import ModelLoadError

RECURRENT_MODULES = ("linear_attn", "conv", "mamba", "mixer")  # Qwen3.5, Qwen3-Next; LFM2; Granite 4; Nemotron-H
# Nemotron-H calls every block's module its mixer; GPT-2-style families theirs `attn` or `attention`.
ATTENTION_MODULES = ("self_attn", "mixer", "attn", "attention", "self_attention", "norm_attn_norm", "temporal_block")
DECODERS = ("model", "backbone", "transformer", "gpt_neox")  # Nemotron-H's; GPT-2-style families'
EMBEDDINGS = ("embed_tokens", "embeddings", "wte", "embed_in", "tok_embeddings", "word_embeddings", "token_embeddings")
HEADS = ("lm_head", "output", "embed_out")  # Llama 4's and GPT-NeoX's are not `lm_head`
ABSOLUTE_POSITIONS = ("wpe", "embed_positions")  # GPT-2-style decoders' learned position embeddings
FINAL_NORMS = ("norm", "ln_f", "final_layer_norm", "norm_f", "final_norm")
HIDDEN_SIZES = ("hidden_size", "n_embd", "d_model", "dim", "hidden_dim", "model_dim")  # AFM's; OpenELM's, Phixtral's
VOCAB_SIZES = ("vocab_size", "num_vocab")  # Phixtral's
LAYERS = ("layers", "h", "blocks")  # GPT-2-style families' `h`; DBRX's and Talkie's `blocks`
BLOCK_ROLES = {"*": "attention", "M": "recurrent"}  # Nemotron-H's block types; MLP blocks have neither


def text_model(model: nn.Module) -> nn.Module:
    """The model that maps token ids to logits: a multimodal checkpoint's `language_model`
    (Qwen3.5's), else `model` itself."""
    return model.language_model if hasattr(model, "language_model") else model


def decoder(model: nn.Module) -> nn.Module:
    """The module of a text model holding its embeddings, decoder layers and final norm:
    `model.model`, or as the family names it (`DECODERS`)."""
    return cast(nn.Module, next(getattr(model, name) for name in DECODERS if hasattr(model, name)))


def run_decoder(
    model: nn.Module, inputs: mx.array, cache: list[Any] | None, embedded: mx.array | None = None
) -> mx.array:
    """A text model's final hidden states for `inputs` over `cache`, its decoder called as the family
    declares it (Phixtral's takes a mask it does not make: None, the caches then mask); with
    `embedded`, the inputs' embeddings as given (an image's rows among them), not looked up."""
    inner = decoder(model)
    extra: dict[str, Any] = {"mask": None} if "mask" in inspect.signature(inner.__call__).parameters else {}
    if embedded is not None:
        extra["input_embeddings"] = embedded
    hidden: mx.array = inner(inputs, cache=cache, **extra)
    return hidden


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """A text model's decoder layers (GPT-2-style families call them `h`; PLaMo nests them once more)."""
    inner = decoder(model)
    layers = next(getattr(inner, name) for name in LAYERS if hasattr(inner, name))
    return cast("list[nn.Module]", layers.layers if isinstance(layers, nn.Module) else layers)


def model_args(model: nn.Module) -> Any:
    """A text model's mlx-lm arguments: `model.args`, or `model.config` where the family keeps them there."""
    return model.args if hasattr(model, "args") else model.config


def hidden_size(model: nn.Module) -> int:
    """The width of a text model's hidden states, by whichever name its arguments give it."""
    args = model_args(model)
    return int(next(getattr(args, name) for name in HIDDEN_SIZES if hasattr(args, name)))


def vocab_size(model: nn.Module) -> int:
    """How many tokens a text model's logits score, by whichever name its arguments give it."""
    args = model_args(model)
    return int(next(getattr(args, name) for name in VOCAB_SIZES if hasattr(args, name)))


def position_embeddings(model: nn.Module) -> str | None:
    """The attribute of a text model's decoder holding its learned absolute position embeddings
    (GPT-2's `wpe`); None where its positions are rotary."""
    return next((name for name in ABSOLUTE_POSITIONS if hasattr(decoder(model), name)), None)


def position_table(model: nn.Module) -> int | None:
    """How many positions a text model's learned absolute position embeddings hold; None where its
    positions are rotary, with no such bound."""
    name = position_embeddings(model)
    return None if name is None else int(mlx_lm_module(decoder(model), name).weight.shape[0])


def embeddings(model: nn.Module) -> nn.Module:
    """A text model's token embeddings, as the family names them (`EMBEDDINGS`)."""
    inner = decoder(model)
    return cast(nn.Module, next(getattr(inner, name) for name in EMBEDDINGS if hasattr(inner, name)))


def computes_logits(model: nn.Module) -> bool:
    """Whether a text model's decoder applies the head itself (GPT-NeoX's, Lille's), so that it
    returns logits, not the final hidden states: its output for one token is not as wide as the
    hidden states (only the shape is read: nothing is computed)."""
    out = run_decoder(model, mx.zeros((1, 1), mx.int32), None)
    return bool(out.shape[-1] != hidden_size(model))


def final_norm(model: nn.Module) -> str:
    """The attribute of a text model's decoder holding its final norm (`FINAL_NORMS`)."""
    inner = decoder(model)
    return next(name for name in FINAL_NORMS if hasattr(inner, name))


def logits(model: nn.Module, hidden: mx.array) -> mx.array:
    """`model`'s logits for final hidden states, as its own forward pass makes them: its head (or
    its decoder's, GPT-NeoX's, or the tied embeddings), then Granite's `logits_scaling` and Gemma
    2's final soft-cap. Neither moves the argmax, but both change what a temperature samples and
    the log-probabilities."""
    holders = (model, decoder(model))
    head = next((getattr(m, name) for m in holders for name in HEADS if hasattr(m, name)), None)
    out: mx.array
    if isinstance(head, mx.array):  # Talkie's is a bare matrix, scaled by a learned gain
        out = model.lm_head_gain(hidden @ head.T)
    else:
        out = (embeddings(model).as_linear if head is None else head)(hidden)
    if getattr(model, "logits_scaling", None):
        out = out / model.logits_scaling
    cap = getattr(model, "final_logit_softcapping", None)
    return mx.tanh(out / cap) * cap if cap else out


def held_arrays(model: nn.Module) -> list[mx.array]:
    """Every array `model`'s modules hold: the parameters and the private tables mlx-lm builds
    lazily at load (RoPE frequencies, ...). MLX evaluates a lazy array only on the thread that made
    it, so an engine evaluates these before another thread may run the model."""
    held = model.filter_and_map(lambda _, __, value: isinstance(value, (mx.array, nn.Module, dict, list)))
    return [value for _, value in cast("list[tuple[str, Any]]", tree_flatten(held)) if isinstance(value, mx.array)]


def activation_dtype(model: nn.Module) -> mx.Dtype:
    """The dtype of `model`'s activations (a text model): that of its decoder's first floating
    parameter (a norm's, or a quantized layer's scales: never its packed integers)."""
    parameters = cast("list[tuple[str, mx.array]]", tree_flatten(decoder(model).parameters()))
    dtype: mx.Dtype = next(a.dtype for _, a in parameters if a.dtype in (mx.float16, mx.bfloat16, mx.float32))
    return dtype


@dataclass(frozen=True)
class LayerRoles:
    """The decoder layers, by index, that attend through K/V pages of their own and that keep a
    recurrent state; the K/V cache numbers the first from 0 and the state pool the second.
    `shares` pairs each KV-shared layer (Gemma 4's last `num_kv_shared_layers`), which attends
    the pages of an earlier layer and keeps none, with that layer's index."""

    attention: tuple[int, ...]
    recurrent: tuple[int, ...]
    shares: tuple[tuple[int, int], ...] = ()

    @staticmethod
    def recurrent_module(layer: nn.Module) -> str | None:
        """The attribute of a recurrent decoder layer that holds its recurrent module; None where
        none does, and the layer runs whole (RWKV-7's time mixing and channel mixing share its state;
        Kimi Linear's and Ling-Linear's recurrent module is named as others name attention)."""
        return next((name for name in RECURRENT_MODULES if hasattr(layer, name)), None)

    @staticmethod
    def attention_slot(layer: nn.Module) -> tuple[nn.Module, str]:
        """Where an attention decoder layer holds its attention module: the module holding it and
        the attribute's name, a level down where the family nests it (EXAONE's `attn.attention`,
        DBRX's `norm_attn_norm.attn`)."""
        holder, name = layer, next(name for name in ATTENTION_MODULES if hasattr(layer, name))
        while (
            inner := next((n for n in ATTENTION_MODULES if _has_module(getattr(holder, name), n)), None)
        ) is not None:
            holder, name = getattr(holder, name), inner
        return holder, name


def attention_module(layer: nn.Module) -> nn.Module:
    """An attention decoder layer's attention module as mlx-lm made it (see `LayerRoles.attention_slot`)."""
    return mlx_lm_module(*LayerRoles.attention_slot(layer))


def mlx_lm_module(layer: nn.Module, name: str) -> nn.Module:
    """A module's submodule `name` (a decoder layer's attention, an attention's RoPE) as mlx-lm made
    it: mlxkv's wrappers keep it as `inner`."""
    module = getattr(layer, name)
    inner: nn.Module = getattr(module, "inner", module)
    return inner


def _has_module(module: nn.Module, name: str) -> bool:
    """Whether `module` holds a submodule called `name` (not a method of that name)."""
    return isinstance(getattr(module, name, None), nn.Module)


def _attends(layer: nn.Module) -> bool:
    """Whether a decoder layer has an attention (or recurrent) module at all."""
    return any(getattr(layer, name, None) is not None for name in RECURRENT_MODULES + ATTENTION_MODULES)


def run_recurrent(module: nn.Module, x: mx.array, mask: mx.array | None, cache: Any, given: dict[str, Any]) -> Any:
    """`module` (a recurrent module as mlx-lm made it) over `x` `[rows, length, hidden]`, updating
    `cache`. `mask` (which places of right-padded rows hold a token) goes only to a module that
    takes one (Mamba's and Jamba's take `(x, cache)` and see every place as a token); its other
    parameters get their value from `given`, a required one else None (what RWKV-7's first layer
    gets for the values it hands on)."""
    values = {"mask": mask, "cache": cache, **given}
    parameters = list(inspect.signature(module.__call__).parameters.values())[1:]
    named = (p for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    return module(x, **{p.name: values.get(p.name) for p in named if p.name in values or p.default is p.empty})


def recurrent_module(layer: nn.Module) -> nn.Module:
    """A recurrent decoder layer's recurrent module as mlx-lm made it: the one the layer names, else
    the layer itself (mlxkv's wrapper keeps either as `inner`)."""
    name = LayerRoles.recurrent_module(layer)
    return cast(nn.Module, getattr(layer, "inner", layer)) if name is None else mlx_lm_module(layer, name)


def layer_roles(model: nn.Module) -> LayerRoles:
    """Each decoder layer's role in `model` (a text model): by its block type where it has one
    (Nemotron-H, whose MLP blocks neither attend nor keep a state), else from the caches mlx-lm
    makes for it, skipping layers without an attention module; the layers past those caches read the
    K/V of the layer mlx-lm's `previous_kvs` names (Gemma 4's KV-shared layers)."""
    inner, layers = decoder(model), decoder_layers(model)
    if hasattr(layers[0], "block_type"):
        roles = [BLOCK_ROLES.get(layer.block_type) for layer in layers]
    else:
        caches = model.make_cache() if hasattr(model, "make_cache") else [None] * len(layers)
        roles = ["recurrent" if isinstance(cache, ArraysCache) else "attention" for cache in caches]
        if len(roles) < len(layers) and sum(map(_attends, layers)) == len(roles):
            kept = iter(roles)  # Nemotron-NAS: no cache for a layer whose attention is a no-op
            roles = [next(kept) if _attends(layer) else None for layer in layers]
    sources = getattr(inner, "previous_kvs", ())
    if len(sources) < len(layers) and len(roles) < len(layers):
        raise ModelLoadError(f"mlx-lm keeps caches for {len(roles)} of its {len(layers)} layers")
    return LayerRoles(
        tuple(i for i, role in enumerate(roles) if role == "attention"),
        tuple(i for i, role in enumerate(roles) if role == "recurrent"),
        tuple((i, sources[i]) for i in range(len(roles), len(layers))),
    )


def state_shapes(model: nn.Module, roles: LayerRoles) -> list[list[StateShape]]:
    """What each recurrent layer of `model` keeps per sequence, as mlx-lm's own caches hold it after
    the model's first token (a graph built, never evaluated): the shapes without the sequence axis,
    and the dtypes (mlx-lm keeps a gated delta rule's state in float32 whatever the weights are).
    The whole model runs, as a layer may need what an earlier one hands on (RWKV-7's first values)."""
    if not roles.recurrent:
        return []
    caches = model.make_cache()
    model(mx.zeros((1, 1), mx.int32), cache=caches)
    recurrent: list[Any] = [c for c in caches if isinstance(c, ArraysCache)]  # mlx-lm's class, not annotated
    return [[StateShape(tuple(array.shape[1:]), array.dtype) for array in cache.cache] for cache in recurrent]


def pads_exactly(model: nn.Module, roles: LayerRoles) -> bool:
    """Whether `model`'s recurrent layers leave a right-padded row's state as that row alone would:
    mlx-lm's layers do where they hand the rows' lengths on, Nemotron-H's Mamba mixer does not.
    Checked once, on random input, a 7-token row padded beside an 8-token one."""
    if not roles.recurrent:
        return True
    module = recurrent_module(decoder_layers(model)[roles.recurrent[0]])
    size = len(next(c for c in model.make_cache() if isinstance(c, ArraysCache)).cache)
    rows = mx.random.normal((2, 8, hidden_size(model)), key=mx.random.key(0))
    short, longer = rows.astype(activation_dtype(model))
    alone: Any = ArraysCache(size)
    run_recurrent(module, short[None, :7], None, alone, {})
    padded: Any = ArraysCache(size)
    padded.lengths = mx.array([7, 8])
    run_recurrent(module, mx.stack([short, longer]), mx.arange(8)[None] < padded.lengths[:, None], padded, {})
    # Equal on the CPU; a GPU kernel's masked and unmasked forms may round apart, never by this much.
    return all(
        bool((mx.abs(a[0] - b[0]).max() <= 1e-4 * (1 + mx.abs(a).max())).item())
        for a, b in zip(alone.cache, padded.cache)
    )
