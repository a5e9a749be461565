"""Random checkpoints in the mlx-lm / Hugging Face directory format, for tests and benchmarks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

# The tokenizers' training text: changing it changes every test checkpoint's tokens.
TEXT = (
    "The quick brown fox jumps over the lazy dog. Paged attention keeps keys and values in pages; "
    "a block table maps each sequence to its pages. "
) * 20


# A ChatML template that shows the model its tools and writes calls as JSON between <tool_call>
# markers, the format mlx-lm's json_tools parser reads (Qwen 2.5's and Hermes' convention).
TOOLS_CHAT_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}Functions you may call, one JSON signature a line:
{% for tool in tools %}{{ tool.function | tojson }}
{% endfor %}Call one as <tool_call>
{"name": <name>, "arguments": <arguments>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages if message.role != 'system' %}
{%- if message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}
{%- for tool_call in message.tool_calls or [] %}
{%- set tool_call = tool_call.function %}<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


# OpenAI's harmony format as gpt-oss's template writes it: the reasoning of replies passed back
# (`thinking`) only after the last user message, earlier replies as their final channel alone.
# Unlike gpt-oss's, this one opens the reply's analysis channel itself, as a random model never
# would; like gpt-oss, it always thinks.
HARMONY_CHAT_TEMPLATE = (
    "{%- set last = namespace(user=-1) -%}"
    "{%- for m in messages %}{% if m.role == 'user' %}{% set last.user = loop.index0 %}{% endif %}{% endfor -%}"
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort or 'medium' }}<|end|>"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- if m.thinking and loop.index0 > last.user -%}"
    "<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>"
    "{%- endif -%}"
    "<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{%- else -%}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}<|start|>assistant<|channel|>analysis<|message|>{% endif -%}"
)
# A harmony tokenizer's added tokens: its reply ends (`<|return|>`, `<|call|>`), `<|constrain|>`,
# and the role and channel names, one token each as in gpt-oss's vocabulary.
HARMONY_MARKERS = ("<|return|>", "<|call|>", "<|constrain|>", "assistant", "analysis", "final")


# Tokens real tokenizers add beside their learned vocabulary: special ones that text never spells
# (turn, image and channel markers), and Qwen's markers for tool calls and thinking, which are
# added but not special: each is one token, which the model writes as a whole and never byte by byte.
SPECIAL_TOKENS = (
    "<eos>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|image_pad|>",
    "<|vision_end|>",
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|end|>",
)
MARKERS = ("<tool_call>", "</tool_call>", "<think>", "</think>")


def write_tokenizer(
    path: Path,
    vocab_size: int,
    chat_template: str | None = None,
    markers: tuple[str, ...] = MARKERS,
    config: dict[str, Any] | None = None,
    special_tokens: tuple[str, ...] = SPECIAL_TOKENS,
    around: tuple[str, str] | None = None,
) -> None:
    """A byte-level BPE tokenizer of at most `vocab_size` tokens (EOS `<eos>`): `special_tokens`
    (ids 0, 1, …), the learned ones, then `markers` as added tokens that are not special;
    `chat_template` and `config` (more tokenizer_config.json fields, such as `tool_parser_type`) if given;
    `around`: two of the special tokens it puts around every text (BERT's `[CLS]` and `[SEP]`)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(markers),
        special_tokens=list(special_tokens),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([TEXT], trainer)
    tokenizer.add_tokens([AddedToken(marker, special=False, normalized=False) for marker in markers])
    if around is not None:
        first, last = around
        ids = [(token, special_tokens.index(token)) for token in around]
        tokenizer.post_processor = processors.TemplateProcessing(single=f"{first} $A {last}", special_tokens=ids)
    tokenizer.save(str(path / "tokenizer.json"))
    settings: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>", "bos_token": None}
    if chat_template is not None:
        settings["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps({**settings, **(config or {})}))


TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=320,
)
LLAMA_100M = dict(
    hidden_size=768,
    num_hidden_layers=12,
    intermediate_size=2048,
    num_attention_heads=12,
    num_key_value_heads=4,
    vocab_size=32000,
)


def make_checkpoint(
    path: Path,
    model_type: str = "llama",
    dtype: str = "float32",
    bits: int | None = None,
    seed: int = 0,
    max_position_embeddings: int = 512,
    tied: bool = False,
    shape: dict[str, Any] | None = None,
    chat_template: str | None = None,
    markers: tuple[str, ...] = MARKERS,
    tokenizer_config: dict[str, Any] | None = None,
) -> Path:
    """Write a random `model_type` model (default: `TINY`, GQA 4:2) with peaky logits to `path`,
    its tokenizer with `chat_template`, `markers` and `tokenizer_config` (see `write_tokenizer`)."""
    config: dict[str, Any] = dict(
        model_type=model_type,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tied,
        torch_dtype=dtype,
    )
    config.update(shape or TINY)
    if model_type == "qwen3":
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    weights = {}
    for name, value in cast("list[tuple[str, mx.array]]", tree_flatten(model.parameters())):
        scale = 6.0 if "lm_head" in name else 1.0
        if name.endswith(("bias",)) or "norm" in name:
            value = value + 0.1 * mx.random.normal(value.shape)
        weights[name] = (value * scale).astype(getattr(mx, dtype))
    model.update(tree_unflatten(list(weights.items())))
    if bits is not None:
        model, config = quantize_model(model, config, group_size=32, bits=bits)
    path.mkdir(parents=True, exist_ok=True)
    save_model(path, model)
    save_config(config, path / "config.json")
    write_tokenizer(path, min(config["vocab_size"], 1000), chat_template, markers, tokenizer_config)
    return path


def write_pooling(path: Path, flag: str = "pooling_mode_lasttoken", normalize: bool = True) -> Path:
    """Give the checkpoint at `path` sentence-transformers' files for a Pooling module that pools by
    `flag` (one of `pooling.MODES`' keys), L2-normalised if `normalize`: what embedding checkpoints carry."""
    config = json.loads((path / "config.json").read_text())
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules, indent=2))
    (path / "1_Pooling").mkdir(exist_ok=True)
    pooling = {"word_embedding_dimension": config["hidden_size"], flag: True}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))
    return path


def make_embedder(path: Path, seed: int = 0, shape: dict[str, Any] | None = None) -> Path:
    """A random decoder embedding model at `path`, as Qwen3-Embedding is made: a Qwen3 decoder whose
    normalised last-token hidden state is the vector, which may be cut to any size (`is_matryoshka`)."""
    make_checkpoint(path, "qwen3", seed=seed, shape=shape)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"is_matryoshka": True}, indent=2))
    return write_pooling(path)


ENCODER_SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def make_encoder(
    path: Path,
    model_type: str = "bert",
    flag: str = "pooling_mode_mean_tokens",
    normalize: bool = True,
    seed: int = 0,
    shape: dict[str, Any] | None = None,
) -> Path:
    """A random encoder embedding model (`model_type` one of mlx-embeddings' BERT-style families) at
    `path`, with BERT's special tokens and sentence-transformers files pooling by `flag`; `shape`
    changes its sizes (`TINY`'s keys)."""
    from mlx_embeddings.utils import _get_classes as encoder_classes  # the embeddings extra

    config: dict[str, Any] = dict(
        model_type=model_type,
        vocab_size=320,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=514,
        type_vocab_size=1 if model_type == "xlm-roberta" else 2,
        layer_norm_eps=1e-12,
        pad_token_id=0,
    )
    config.update({key: value for key, value in (shape or {}).items() if key != "num_key_value_heads"})
    model_class, args_class, _, _ = encoder_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    path.mkdir(parents=True, exist_ok=True)
    weights = dict(cast("list[tuple[str, mx.array]]", tree_flatten(model.parameters())))
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    tokens = dict(pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    write_tokenizer(
        path,
        320,
        markers=(),
        config=tokens | {"eos_token": None},
        special_tokens=ENCODER_SPECIAL_TOKENS,
        around=("[CLS]", "[SEP]"),
    )
    return write_pooling(path, flag, normalize)
