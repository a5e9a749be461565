"""Random checkpoints in the mlx-lm / Hugging Face directory format, for tests and benchmarks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# The tokenizers' training text: changing it changes every test checkpoint's tokens.
TEXT = (
    "The quick brown fox jumps over the lazy dog. Paged attention keeps keys and values in pages; "
    "a block table maps each sequence to its pages. "
) * 20


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer (EOS `<eos>`, no chat template) with at most `vocab_size` tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<eos>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([TEXT], trainer)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>", "bos_token": None})
    )


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
    shape: dict[str, int] | None = None,
) -> Path:
    """Write a random `model_type` model (default: `TINY`, GQA 4:2) with peaky logits to `path`."""
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
    write_tokenizer(path, min(config["vocab_size"], 1000))
    return path
