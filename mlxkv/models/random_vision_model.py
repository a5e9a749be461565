"""Random multimodal checkpoints in the mlx-vlm / Hugging Face directory format, for tests and benchmarks.

Each is built by mlx-vlm's own model class from its config, as `mlx_vlm.load` builds it, and saved
under mlx-vlm's parameter names (the layout `mlx_vlm.convert` writes), which `mlx_lm.load` reads as
well. Beside the weights: a byte-level BPE tokenizer with the family's special tokens (turn and image
markers), a small chat template in the family's conventions, and the image processor's files, sized
for a tiny vision tower (8-pixel patches, images of at most about 64x64 pixels). No network, no torch.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.utils import save_model
from tokenizers import Tokenizer

from .random_model import write_tokenizer

VISION_TYPES = ("qwen3_vl", "qwen3_5", "mistral3", "gemma4")

# The text model's shape; `make_vision_checkpoint`'s `shape` overrides any of these keys.
TINY_TEXT = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
# The vision tower, the same whatever the text model's shape: 8-pixel patches, merged 2x2.
TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, head_dim=16, patch_size=8)
VOCAB_SIZE = 320


@dataclass(frozen=True)
class _Family:
    """What one model type's checkpoint holds besides its weights."""

    special_tokens: tuple[str, ...]  # ids 0, 1, … in this order
    tokenizer: dict[str, Any]  # tokenizer_config.json fields
    chat_template: str
    config: Callable[[dict[str, Any], int], dict[str, Any]]  # config.json from the text shape and vocabulary size
    processor: dict[str, dict[str, Any]]  # the image processor's files
    shape: dict[str, Any] = field(default_factory=dict)  # the family's own text shape, over TINY_TEXT


QWEN3_VL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
QWEN3_VL_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' or item['type'] == 'image_url' or 'image' in item -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif item['type'] == 'video' or 'video' in item -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif item['type'] == 'text' -%}{{- item['text'] -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def _mrope_section(rotated: int) -> list[int]:
    """How the `rotated` dims of a head split their frequencies among time, height and width (as
    Qwen's [24, 20, 20] of 128, interleaved)."""
    half = rotated // 2
    return [half - 2 * (half * 5 // 16), half * 5 // 16, half * 5 // 16]


def _qwen_config(model_type: str, text: dict[str, Any], vocab_size: int, deepstack: list[int]) -> dict[str, Any]:
    """What Qwen3-VL's and Qwen3.5's configs share: the image and turn token ids, and a vision tower
    (learned position grid, 2x2 merge) whose `deepstack` blocks also feed the text model's first layers."""
    ids = {token: i for i, token in enumerate(QWEN3_VL_TOKENS)}
    return dict(
        model_type=model_type,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=False,
        vocab_size=vocab_size,
        vision_config=dict(
            model_type=model_type,
            depth=2,
            hidden_size=TINY_VISION["hidden_size"],
            intermediate_size=TINY_VISION["intermediate_size"],
            num_heads=TINY_VISION["num_attention_heads"],
            out_hidden_size=text["hidden_size"],
            patch_size=TINY_VISION["patch_size"],
            spatial_merge_size=2,
            temporal_patch_size=2,
            in_channels=3,
            hidden_act="gelu_pytorch_tanh",
            num_position_embeddings=64,  # a learned 8x8 grid
            deepstack_visual_indexes=deepstack,
        ),
    )


def _qwen3_vl_config(text: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """Qwen3-VL: interleaved multimodal RoPE over whole heads, a vision tower whose first block also
    feeds the text model's first layer (deepstack)."""
    config = _qwen_config("qwen3_vl", text, vocab_size, deepstack=[0])
    return dict(
        config,
        architectures=["Qwen3VLForConditionalGeneration"],
        text_config=dict(
            text,
            model_type="qwen3_vl_text",
            hidden_act="silu",
            rms_norm_eps=1e-6,
            vocab_size=vocab_size,
            max_position_embeddings=4096,
            rope_theta=5000000.0,
            rope_scaling=dict(
                rope_type="default", mrope_interleaved=True, mrope_section=_mrope_section(text["head_dim"])
            ),
            attention_bias=False,
            tie_word_embeddings=False,
            eos_token_id=config["eos_token_id"],
        ),
    )


QWEN3_5_ROTARY = 0.25  # Qwen3.5 rotates a quarter of each head's dims


def _qwen3_5_config(text: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """Qwen3.5: Gated DeltaNet layers with a gated full-attention layer every second (the released
    models: every fourth), interleaved multimodal RoPE over the first quarter of each head; the
    Qwen3-VL vision tower without deepstack."""
    config = _qwen_config("qwen3_5", text, vocab_size, deepstack=[])
    interval = 2
    return dict(
        config,
        architectures=["Qwen3_5ForConditionalGeneration"],
        text_config=dict(
            text,
            model_type="qwen3_5_text",
            hidden_act="silu",
            rms_norm_eps=1e-6,
            vocab_size=vocab_size,
            max_position_embeddings=4096,
            full_attention_interval=interval,
            layer_types=[
                "full_attention" if (i + 1) % interval == 0 else "linear_attention"
                for i in range(text["num_hidden_layers"])
            ],
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            attn_output_gate=True,
            rope_parameters=dict(
                rope_type="default",
                rope_theta=10000000.0,
                partial_rotary_factor=QWEN3_5_ROTARY,
                mrope_interleaved=True,
                mrope_section=_mrope_section(int(text["head_dim"] * QWEN3_5_ROTARY)),
            ),
            attention_bias=False,
            tie_word_embeddings=False,
            eos_token_id=config["eos_token_id"],
        ),
    )


QWEN_PROCESSOR = {
    # An image's area is brought within [min_pixels, max_pixels], its sides to multiples of 16.
    "preprocessor_config.json": dict(
        image_processor_type="Qwen2VLImageProcessorFast",
        processor_class="Qwen3VLProcessor",
        patch_size=8,
        temporal_patch_size=2,
        merge_size=2,
        size=dict(shortest_edge=16 * 16, longest_edge=64 * 64),
        min_pixels=16 * 16,
        max_pixels=64 * 64,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        do_convert_rgb=True,
    ),
    "video_preprocessor_config.json": dict(
        video_processor_type="Qwen3VLVideoProcessor",
        processor_class="Qwen3VLProcessor",
        patch_size=8,
        temporal_patch_size=2,
        merge_size=2,
        size=dict(shortest_edge=16 * 16, longest_edge=64 * 64 * 8),
        fps=2,
        min_frames=2,
        max_frames=8,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    ),
}

QWEN3_VL = _Family(
    special_tokens=QWEN3_VL_TOKENS,
    tokenizer=dict(
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=dict(
            image_token="<|image_pad|>",
            video_token="<|video_pad|>",
            vision_start_token="<|vision_start|>",
            vision_end_token="<|vision_end|>",
        ),
    ),
    chat_template=QWEN3_VL_TEMPLATE,
    config=_qwen3_vl_config,
    processor=QWEN_PROCESSOR,
)

# Qwen3-VL's tokens, template and processor. Both layer kinds twice; heads of 32 dims, a quarter of
# them rotated: 4 frequencies, 2 turning at the time position and 1 each at height and width.
QWEN3_5 = replace(QWEN3_VL, config=_qwen3_5_config, shape=dict(num_hidden_layers=4, head_dim=32))


MISTRAL3_TOKENS = (
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[TOOL_CALLS]",
    "[IMG]",
    "<pad>",
    "[IMG_BREAK]",
    "[IMG_END]",
    "[PREFIX]",
    "[MIDDLE]",
    "[SUFFIX]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
)
MISTRAL3_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{{- '[SYSTEM_PROMPT]' + message['content'] + '[/SYSTEM_PROMPT]' -}}"
    "{%- elif message['role'] == 'user' -%}{{- '[INST]' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' or item['type'] == 'image_url' -%}{{- '[IMG]' -}}"
    "{%- elif item['type'] == 'text' -%}{{- item['text'] -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '[/INST]' -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for item in message['content'] -%}{{- item['text'] -}}{%- endfor -%}{%- endif -%}"
    "{{- eos_token -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


def _mistral3_config(text: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """Mistral 3: a Mistral text model and a Pixtral vision tower (2D RoPE over the patches)."""
    ids = {token: i for i, token in enumerate(MISTRAL3_TOKENS)}
    return dict(
        model_type="mistral3",
        architectures=["Mistral3ForConditionalGeneration"],
        image_token_index=ids["[IMG]"],
        multimodal_projector_bias=False,
        projector_hidden_act="gelu",
        spatial_merge_size=2,
        vision_feature_layer=-1,
        vocab_size=vocab_size,
        bos_token_id=ids["<s>"],
        eos_token_id=ids["</s>"],
        pad_token_id=ids["<pad>"],
        text_config=dict(
            text,
            model_type="mistral",
            hidden_act="silu",
            rms_norm_eps=1e-5,
            rope_theta=1000000000.0,
            max_position_embeddings=4096,
            sliding_window=None,
            vocab_size=vocab_size,
            tie_word_embeddings=False,
        ),
        vision_config=dict(
            TINY_VISION,
            model_type="pixtral",
            num_hidden_layers=2,
            hidden_act="silu",
            image_size=64,
            num_channels=3,
            rope_theta=10000.0,
        ),
    )


MISTRAL3 = _Family(
    special_tokens=MISTRAL3_TOKENS,
    tokenizer=dict(bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"),
    chat_template=MISTRAL3_TEMPLATE,
    config=_mistral3_config,
    processor={
        "preprocessor_config.json": dict(
            image_processor_type="PixtralImageProcessorFast",
            processor_class="PixtralProcessor",
            do_convert_rgb=True,
            do_normalize=True,
            do_rescale=True,
            do_resize=True,
            image_mean=[0.48145466, 0.4578275, 0.40821073],
            image_std=[0.26862954, 0.26130258, 0.27577711],
            patch_size=dict(height=8, width=8),
            resample=3,
            rescale_factor=1 / 255,
            size=dict(longest_edge=64),
        ),
        "processor_config.json": dict(
            processor_class="PixtralProcessor",
            image_token="[IMG]",
            image_break_token="[IMG_BREAK]",
            image_end_token="[IMG_END]",
            patch_size=8,
            spatial_merge_size=2,
        ),
    },
)


GEMMA4_TOKENS = (
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<|turn>",
    "<turn|>",
    "<|image>",
    "<image|>",
    "<|image|>",
    "<|audio>",
    "<audio|>",
    "<|audio|>",
    "<|video|>",
)
GEMMA4_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{- '<|turn>' + role + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] | trim -}}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{- '<|image|>' -}}"
    "{%- elif item['type'] == 'audio' -%}{{- '<|audio|>' -}}"
    "{%- elif item['type'] == 'video' -%}{{- '<|video|>' -}}"
    "{%- elif item['type'] == 'text' -%}{{- item['text'] | trim -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<turn|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|turn>model\\n' -}}{%- endif -%}"
)


def _gemma4_config(text: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """Gemma 4 without audio: tied embeddings, per-layer inputs, sliding-window layers with a global
    one every sixth and last, soft-capped logits; a vision tower that pools 2x2 patches."""
    ids = {token: i for i, token in enumerate(GEMMA4_TOKENS)}
    layers = text["num_hidden_layers"]
    return dict(
        model_type="gemma4",
        architectures=["Gemma4ForConditionalGeneration"],
        vocab_size=vocab_size,  # mlx-lm copies it into the text config
        image_token_id=ids["<|image|>"],
        boi_token_id=ids["<|image>"],
        eoi_token_id=ids["<image|>"],
        audio_token_id=ids["<|audio|>"],
        boa_token_id=ids["<|audio>"],
        eoa_token_id=ids["<audio|>"],
        video_token_id=ids["<|video|>"],
        pad_token_id=ids["<pad>"],
        bos_token_id=ids["<bos>"],
        eos_token_id=[ids["<eos>"], ids["<turn|>"]],
        hidden_size=text["hidden_size"],
        vision_soft_tokens_per_image=16,
        tie_word_embeddings=True,
        audio_config=None,  # null, not {}: an empty one would build an audio tower
        text_config=dict(
            text,
            model_type="gemma4_text",
            num_global_key_value_heads=None,
            global_head_dim=2 * text["head_dim"],
            hidden_activation="gelu_pytorch_tanh",
            rms_norm_eps=1e-6,
            vocab_size=vocab_size,
            vocab_size_per_layer_input=vocab_size,
            hidden_size_per_layer_input=8,
            num_kv_shared_layers=0,
            sliding_window=128,
            use_bidirectional_attention="vision",  # as the released checkpoints: both ways within an image
            layer_types=[
                "full_attention" if i % 6 == 5 or i == layers - 1 else "sliding_attention" for i in range(layers)
            ],
            rope_parameters=dict(
                full_attention=dict(partial_rotary_factor=0.25, rope_theta=1000000.0, rope_type="proportional"),
                sliding_attention=dict(rope_theta=10000.0, rope_type="default"),
            ),
            final_logit_softcapping=30.0,
            attention_k_eq_v=False,
            use_double_wide_mlp=True,
            enable_moe_block=False,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
            pad_token_id=ids["<pad>"],
            bos_token_id=ids["<bos>"],
            eos_token_id=[ids["<eos>"], ids["<turn|>"]],
        ),
        vision_config=dict(
            TINY_VISION,
            model_type="gemma4_vision",
            num_hidden_layers=2,
            num_key_value_heads=TINY_VISION["num_attention_heads"],
            global_head_dim=TINY_VISION["head_dim"],
            hidden_activation="gelu_pytorch_tanh",
            rms_norm_eps=1e-6,
            pooling_kernel_size=2,
            position_embedding_size=64,
            default_output_length=16,
            rope_parameters=dict(rope_theta=100.0, rope_type="default"),
            use_clipped_linears=False,
            standardize=False,
        ),
    )


GEMMA4 = _Family(
    special_tokens=GEMMA4_TOKENS,
    tokenizer=dict(
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_special_tokens=dict(
            image_token="<|image|>",
            boi_token="<|image>",
            eoi_token="<image|>",
            audio_token="<|audio|>",
            boa_token="<|audio>",
            eoa_token="<audio|>",
            video_token="<|video|>",
        ),
    ),
    chat_template=GEMMA4_TEMPLATE,
    config=_gemma4_config,
    processor={
        # Gemma4Processor reads its image processor from here, nested, before preprocessor_config.json.
        "processor_config.json": dict(
            processor_class="Gemma4Processor",
            image_processor=dict(
                image_processor_type="Gemma4ImageProcessor",
                do_resize=True,
                do_rescale=True,
                rescale_factor=1 / 255,
                do_normalize=False,
                image_mean=[0.0, 0.0, 0.0],
                image_std=[1.0, 1.0, 1.0],
                do_convert_rgb=True,
                patch_size=8,
                pooling_kernel_size=2,
                max_soft_tokens=16,  # at most 16 * 2 * 2 patches: about 64x64 pixels
            ),
            image_seq_length=16,
            audio_seq_length=750,
            audio_ms_per_token=40,
        ),
    },
)

FAMILIES = {"qwen3_vl": QWEN3_VL, "qwen3_5": QWEN3_5, "mistral3": MISTRAL3, "gemma4": GEMMA4}


# How the initial weights are reshaped: the output head scaled up (as `random_model` does) for peaky
# logits; each attention's queries and keys scaled up, its scores by the square, so that each step reads
# a few positions of its own: attending evenly, every step reads the same mean of the prompt and the
# model writes one token over and over. A tied head (Gemma) scores the current token's own embedding,
# in the residual stream, above the rest: the embeddings are scaled down there, the final norm up.
HEAD_SCALE = 6.0
QUERY_KEY_SCALE = 3.0
TIED_EMBEDDING_SCALE = 0.2
SPECIAL_ROW_SCALE = 0.1  # the special tokens' rows of the head: the model writes text, never EOS


def _random_weights(model: nn.Module, vocab_size: int, specials: int, dtype: mx.Dtype) -> dict[str, mx.array]:
    """`model`'s parameters in `dtype`, reshaped as the scales above say, with norms and biases given
    some noise (as `random_model`'s are); the special tokens have ids below `specials`."""
    parameters = dict(cast("list[tuple[str, mx.array]]", tree_flatten(model.parameters())))
    text = "language_model."
    head = text + "lm_head.weight"
    tied = head not in parameters
    if tied:
        head = text + "model.embed_tokens.weight"
    special = mx.arange(vocab_size)[:, None] < specials
    weights = {}
    for name, value in parameters.items():
        if mx.issubdtype(value.dtype, mx.floating):
            if name.endswith("bias") or "norm" in name:
                value = value + 0.1 * mx.random.normal(value.shape)
            if name.startswith(text) and name.endswith(
                ("q_proj.weight", "k_proj.weight", "q_norm.weight", "k_norm.weight")
            ):
                value = value * QUERY_KEY_SCALE  # a q/k norm undoes its projection's scale, but applies its own
            if name == head:
                value = mx.where(special, SPECIAL_ROW_SCALE * value, value) * (
                    TIED_EMBEDDING_SCALE if tied else HEAD_SCALE
                )
            if tied and name == text + "model.norm.weight":
                value = value * HEAD_SCALE / TIED_EMBEDDING_SCALE
            value = value.astype(dtype)
        weights[name] = value
    return weights


def make_vision_checkpoint(
    path: Path,
    model_type: str = "qwen3_vl",
    dtype: str = "float32",
    seed: int = 0,
    shape: dict[str, Any] | None = None,
) -> Path:
    """Write a random `model_type` multimodal model (one of `VISION_TYPES`) with peaky logits to
    `path`: its text model `TINY_TEXT` with the family's own keys and then `shape`'s overriding
    (`head_dim` defaults to hidden_size // num_attention_heads when `shape` changes the width), a
    tiny vision tower either way.

    Its weights are mlx's initial ones, reshaped by `_random_weights` so that greedy decoding writes
    varied text without near-ties and does not stop before its `max_tokens`."""
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not one of {', '.join(VISION_TYPES)}")
    unknown = set(shape or {}) - set(TINY_TEXT)
    if unknown:
        raise ValueError(f"shape keys {sorted(unknown)} are not among {sorted(TINY_TEXT)}")
    family = FAMILIES[model_type]
    text: dict[str, Any] = {**TINY_TEXT, **family.shape, **(shape or {})}
    if shape and {"hidden_size", "num_attention_heads"} & set(shape) and "head_dim" not in shape:
        text["head_dim"] = text["hidden_size"] // text["num_attention_heads"]

    from mlx_vlm.utils import get_model_and_args, load_config, update_module_configs

    path.mkdir(parents=True, exist_ok=True)
    tokenizer_config = {**family.tokenizer, "model_max_length": 4096}
    write_tokenizer(path, VOCAB_SIZE, family.chat_template, (), tokenizer_config, family.special_tokens)
    (path / "chat_template.jinja").write_text(family.chat_template)  # where transformers 5 saves it, for the processor
    vocab_size = Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size()
    config = family.config(text, vocab_size) | {"torch_dtype": dtype}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    for name, content in family.processor.items():
        (path / name).write_text(json.dumps(content, indent=2))

    # The model as mlx_vlm.utils.load_model builds it from the config it reads back.
    config = load_config(path)
    arch, _ = get_model_and_args(config)
    model_config = arch.ModelConfig.from_dict(config)
    modules = ["text", "vision", "projector", "audio"]
    model_config = update_module_configs(model_config, arch, config, modules)  # type: ignore[no-untyped-call]
    mx.random.seed(seed)
    model = arch.Model(model_config)

    weights = _random_weights(model, vocab_size, len(family.special_tokens), getattr(mx, dtype))
    model.update(tree_unflatten(list(weights.items())))
    save_model(path, model)
    return path
