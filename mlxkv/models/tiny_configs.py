"""Tiny config.json dicts, one per mlx-lm model_type, from which mlx-lm builds a small random model of that family.

`tiny_config(model_type)` fills the family's `ModelArgs` fields from `TINY_BASE` by name, fills its other
required fields by type, then applies the family's `OVERRIDES`. Wrapper (multimodal) families get a tiny
`text_config` filled the same way from their text model's args.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import importlib
import pkgutil
import types
import typing
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm.models
from mlx_lm.utils import MODEL_REMAPPING

from .random_model import TINY

# Generic tiny sizes by the field names families use for them (HF names first).
TINY_BASE: dict[str, Any] = dict(
    TINY,
    head_dim=16,
    num_vocab=320,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    # The same sizes under other names.
    n_embd=64,
    d_model=64,
    hidden_dim=64,
    model_dim=64,
    n_layer=2,
    n_layers=2,
    num_layers=2,
    num_transformer_layers=2,
    n_head=4,
    n_heads=4,
    num_heads=4,
    num_query_heads=4,
    n_kv_heads=2,
    num_kv_heads=2,
    n_inner=128,
    ffn_hidden_size=128,
    ff_intermediate_size=128,
    intermediate_size_mlp=128,
    n_ctx=1024,
    n_positions=1024,
    block_size=1024,
    model_max_length=1024,
    layer_norm_eps=1e-5,
    layer_norm_epsilon=1e-5,
    layernorm_epsilon=1e-5,
    norm_eps=1e-5,
    # Mixture of experts: 4 experts, 2 per token, 1 shared, the first layer dense.
    moe_intermediate_size=32,
    expert_ffn_hidden_size=32,
    shared_expert_intermediate_size=32,
    shared_intermediate_size=32,
    moe_shared_expert_intermediate_size=32,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    moe_num_experts=4,
    num_experts_per_tok=2,
    num_experts_per_token=2,
    moe_topk=2,
    n_shared_experts=1,
    num_shared_experts=1,
    num_shared_expert=1,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    routed_scaling_factor=1.0,
    # Multi-head latent attention.
    kv_lora_rank=64,
    q_lora_rank=32,
    qk_rope_head_dim=32,
    qk_nope_head_dim=32,
    v_head_dim=32,
    # State-space and linear-attention layers.
    state_size=16,
    ssm_state_size=16,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_expand=2,
    conv_kernel=4,
    conv_L_cache=3,  # LFM2: a one-token window would leave its convolution no state
    time_step_rank=8,
    mamba_num_heads=8,
    mamba_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    # Sliding-window attention, small enough that a short prompt crosses it.
    sliding_window=8,
    sliding_window_size=8,
    attention_window_size=8,
    sliding_window_pattern=2,
    layer_types=["sliding_attention", "full_attention"],
    # Hybrid stacks in groups of layers: a group of 2 with 1 norm group.
    layer_group_size=2,
    group_norm_size=1,
    num_dense_layers=1,
    full_attention_interval=2,
    rotary_dim=8,
    kv_channels=16,
    n_shared_head=2,
    moe_top_k=2,
)

ROPE: dict[str, Any] = dict(rope_type="default", rope_theta=10000.0)
# RoPE settings per layer type, for families that take them so.
ROPE_BY_LAYER_TYPE: dict[str, dict[str, Any]] = {
    "sliding_attention": ROPE,
    "full_attention": ROPE,
}

# Per-family fields the generic fill gets wrong; wrappers' `text_config` entries merge into their filled one.
OVERRIDES: dict[str, dict[str, Any]] = {
    "baichuan_m1": dict(conv_window=2, sliding_window_layers=[0]),
    "dbrx": dict(
        ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2),
        attn_config=dict(kv_n_heads=2, clip_qkv=8.0, rope_theta=10000.0),
    ),
    "deepseek_v2": dict(rope_scaling=dict(type="yarn", factor=1.0, original_max_position_embeddings=1024)),
    "deepseek_v41": dict(head_dim=64, o_groups=2, o_lora_rank=32, index_n_heads=2, index_head_dim=16, index_topk=8),
    "exaone4": dict(sliding_window_pattern="LG", layer_types=["sliding_attention", "full_attention"]),
    "exaone_moe": dict(is_moe_layer=[False, True]),
    "gemma3n": dict(
        text_config=dict(
            num_hidden_layers=4,
            layer_types=["sliding_attention", "full_attention"] * 2,
            num_kv_shared_layers=2,
            vocab_size_per_layer_input=320,
            hidden_size_per_layer_input=8,
            activation_sparsity_pattern=[0.0] * 4,
            altup_num_inputs=2,
            altup_active_idx=0,
            altup_coef_clip=120.0,
            laurel_rank=8,
            final_logit_softcapping=30.0,
            rope_local_base_freq=10000.0,
        )
    ),
    # Gemma 4 E2B's shape: the last layers reuse the K/V of the first ones.
    "gemma4_text": dict(
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
        num_kv_shared_layers=2,
        vocab_size_per_layer_input=320,
        hidden_size_per_layer_input=8,
        global_head_dim=32,
    ),
    "glm_moe_dsa": dict(
        rope_parameters=ROPE, index_n_heads=2, index_head_dim=32, topk_method="noaux_tc", scoring_func="sigmoid"
    ),
    "granitemoehybrid": dict(
        layer_types=["mamba", "attention"],
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_n_groups=1,
        mamba_proj_bias=False,
        mamba_conv_bias=True,
        num_local_experts=4,
        shared_intermediate_size=32,
    ),
    # Cross-layer attention: layer 1 attends layer 0's projections.
    "hunyuan": dict(rope_scaling=dict(type="dynamic", factor=1.0, alpha=1000.0), use_cla=True, cla_share_factor=2),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
    "kimi_linear": dict(linear_attn_config=dict(kda_layers=[1], num_heads=4, head_dim=16, short_conv_kernel_size=4)),
    "kimi_k3": dict(
        text_config=dict(
            linear_attn_config=dict(kda_layers=[1], num_heads=4, head_dim=16, short_conv_kernel_size=4),
            mla_use_output_gate=True,  # its latent attention's output gate, which Kimi K3 may switch on
        )
    ),
    "lfm2": dict(layer_types=["conv", "full_attention"], block_dim=64),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    # Llama 4 makes its global mask from layer 3: 4 layers, every 4th global, MoE every 2nd, one expert per token.
    "llama4": dict(
        text_config=dict(
            num_hidden_layers=4,
            attention_chunk_size=8,
            interleave_moe_layer_step=2,
            num_experts_per_tok=1,
            floor_scale=4,  # NoPE layers scale their queries from position 3 on
        )
    ),
    "llama4_text": dict(no_rope_layers=[1, 0]),
    "longcat_flash": dict(mla_scale_q_lora=True, mla_scale_kv_lora=True, zero_expert_type="identity"),
    "longcat_flash_ngram": dict(mla_scale_q_lora=True, mla_scale_kv_lora=True, ngram_vocab_size_ratio=2),
    "mamba2": dict(num_heads=8, time_step_limit=[0.001, 100.0]),  # num_heads * head_dim = 2 * hidden_size
    "mellum": dict(rope_parameters=ROPE_BY_LAYER_TYPE),
    "mimo_v2_flash": dict(
        hybrid_layer_pattern=[1, 0],
        moe_layer_freq=[0, 1],
        swa_num_attention_heads=4,
        swa_num_key_value_heads=2,
        swa_head_dim=16,
        swa_v_head_dim=16,
        v_head_dim=16,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
    ),
    "minicpm3": dict(
        rope_scaling=dict(original_max_position_embeddings=1024, short_factor=[1.0] * 16, long_factor=[1.0] * 16)
    ),
    "ministral3": dict(
        rope_parameters=dict(rope_theta=10000.0, llama_4_scaling_beta=0.1, original_max_position_embeddings=1024)
    ),
    "mistral4": dict(
        rope_parameters=dict(rope_theta=10000.0, llama_4_scaling_beta=0.1, original_max_position_embeddings=1024)
    ),
    # transformers' config (read when the tokenizer loads) checks the audio encoder's width against the text's.
    "muse_spark": dict(
        text_config=dict(
            num_shared_experts=0,
            rope_parameters=ROPE,
            layer_rope_theta=[10000.0, 10000.0],
            moe_hidden_size=64,
            post_norm_eps=1e-5,
            final_logit_softcapping=30.0,
        ),
        audio_config=dict(out_hidden_size=64),
    ),
    "nemotron": dict(hidden_act="relu2"),
    "nemotron-nas": dict(
        block_configs=[
            dict(attention=dict(n_heads_in_group=2), ffn=dict(ffn_mult=1.0)),
            dict(attention=dict(no_op=True), ffn=dict(ffn_mult=1.0)),
        ]
    ),
    "nemotron_h": dict(layer_types=["mamba", "moe", "attention", "mlp"], num_hidden_layers=4),
    "olmo_hybrid": dict(layer_types=["linear_attention", "full_attention"]),
    "openelm": dict(num_query_heads=[4, 4], num_kv_heads=[2, 2], ffn_multipliers=[2.0, 2.0]),
    "phi3small": dict(dense_attention_every_n_layers=2, gegelu_limit=20.0),
    "recurrent_gemma": dict(block_types=["recurrent", "attention"], attention_window_size=8),
    "spark2_5": dict(rope_parameters=ROPE_BY_LAYER_TYPE),
    "step3p5": dict(num_attention_groups=2),  # two KV heads, so that it splits over two processes
    # olmo's module exits on import without ai2-olmo, so its args cannot be read: all its fields are here.
    "olmo": dict(d_model=64, n_layers=2, n_heads=4, mlp_hidden_size=128, embedding_size=320),
}

# Wrapper families whose module has no text-args class of its own: the module whose `ModelArgs` their
# `text_config` follows.
TEXT_MODULES: dict[str, str] = {
    "gemma3": "gemma3_text",
    "gemma4": "gemma4_text",
    "lfm2-vl": "lfm2",
    "mistral3": "llama",
    "pixtral": "llama",
    "qwen2_vl": "qwen2",
    "qwen3_vl": "qwen3",
    "qwen3_vl_moe": "qwen3_moe",
    "qwen3_5_moe": "qwen3_5",
    "prism_hadamard_qwen35": "qwen3_5",
}
TEXT_ARGS_NAMES = ("TextArgs", "TextConfig", "TextModelArgs")

# Model types for which no tiny random checkpoint builds or runs in mlx-lm itself, with why.
ALWAYS_UNBUILDABLE: dict[str, str] = {
    "olmo": "mlx_lm.models.olmo exits on import unless ai2-olmo (hf_olmo, with torch) is installed",
    "prism_hadamard_qwen35": "a pre-packed 2-bit Hadamard checkpoint: its args need a manifest of packed uint32 "
    "modules, which random float weights cannot give",
}
# Model types that run only on an Apple GPU (Metal kernels), or that mlx-lm's forward breaks on MLX's CPU backend.
CPU_UNBUILDABLE: dict[str, str] = {
    "bitnet": "its BitLinear layers are a Metal kernel: no CPU path",
    "muse_spark": "its attention and MoE use Metal kernels (mlx_lm.kernels): no CPU path",
    "phi3small": "its decode steps corrupt the heap on MLX's CPU backend (malloc aborts, tokens vary run to run)",
}
UNBUILDABLE: dict[str, str] = {**ALWAYS_UNBUILDABLE, **({} if mx.metal.is_available() else CPU_UNBUILDABLE)}


def _defines_model(path: Path) -> bool:
    """Whether a model module's top level defines or imports both `Model` and `ModelArgs`."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.ImportFrom):
            names.update(alias.asname or alias.name for alias in node.names)
    return {"Model", "ModelArgs"} <= names


# Every module of mlx_lm.models with a `Model` and a `ModelArgs` (read, not imported: olmo's exits on import).
# `tiny_config` also takes the names MODEL_REMAPPING maps onto these, which are not listed.
MODEL_TYPES: tuple[str, ...] = tuple(
    sorted(
        info.name
        for info in pkgutil.iter_modules(mlx_lm.models.__path__)
        if _defines_model(Path(mlx_lm.models.__path__[0]) / f"{info.name}.py")
    )
)


def _module(model_type: str) -> types.ModuleType | None:
    """mlx-lm's module for `model_type`, or None where importing it fails (or exits)."""
    try:
        return importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(model_type, model_type)}")
    except (ImportError, SystemExit):
        return None


def _by_type(annotation: Any) -> Any:
    """A value for a required field that `TINY_BASE` does not name, from its type alone."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        return None if type(None) in args else _by_type(args[0])
    annotation = origin or annotation
    if annotation is bool:
        return False
    if annotation is int:
        return 1
    if annotation is float:
        return 1.0
    if annotation in (list, tuple):
        return []
    if annotation is dict:
        return {}
    return None


def _fill(args_class: type | None) -> dict[str, Any]:
    """`args_class`'s fields named in `TINY_BASE`, and its other required fields filled by type."""
    if args_class is None:
        return {}
    try:
        hints = typing.get_type_hints(args_class)
    except Exception:  # annotations that do not resolve (a bare `2`, a missing name)
        hints = {}
    config: dict[str, Any] = {}
    for field in dataclasses.fields(args_class):
        if field.name in TINY_BASE:
            config[field.name] = TINY_BASE[field.name]
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            config[field.name] = _by_type(hints.get(field.name, field.type))
    config.pop("model_type", None)
    return config


def _text_config(family: str, module: types.ModuleType, overrides: dict[str, Any]) -> dict[str, Any]:
    """A wrapper family's tiny `text_config`: filled from its text args class, then the text family's overrides
    (where it has a module of its own) and the wrapper's."""
    text_family = TEXT_MODULES.get(family)
    if text_family is not None:
        module = _module(text_family) or module
    args_class = next(getattr(module, name) for name in (*TEXT_ARGS_NAMES, "ModelArgs") if hasattr(module, name))
    return {
        "model_type": text_family or f"{family}_text",
        **_fill(args_class),
        **copy.deepcopy(OVERRIDES.get(text_family or "", {})),
        **overrides.pop("text_config", {}),
    }


def tiny_config(model_type: str) -> dict[str, Any]:
    """The tiny config.json of `model_type` (a module name of mlx_lm.models, or a name MODEL_REMAPPING maps)."""
    family = MODEL_REMAPPING.get(model_type, model_type)
    module = _module(family)
    args_class = getattr(module, "ModelArgs", None)
    overrides = copy.deepcopy(OVERRIDES.get(family, {}))
    config: dict[str, Any] = {"model_type": model_type, **_fill(args_class)}
    if module is not None and any(field.name == "text_config" for field in dataclasses.fields(module.ModelArgs)):
        config["text_config"] = _text_config(family, module, overrides)
    config.update(overrides)
    config.setdefault("vocab_size", TINY_BASE["vocab_size"])  # the tokenizer's size
    return config
