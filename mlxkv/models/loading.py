"""Loading mlx-lm checkpoints (local directories or Hugging Face repos), with clear errors."""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
from huggingface_hub import snapshot_download
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS, MODEL_REMAPPING
from mlx_lm.utils import load as mlx_lm_load

from ..errors import ModelLoadError
from .adapters import FAMILIES, adapter_for
from .pooling import pooling_of
from .sharding import shard
from .structure import (
    attention_module,
    decoder_layers,
    layer_roles,
    model_args,
    state_shapes,
    text_model,
)
from .vision import attach, load_vision

SUPPORTED_MODEL_TYPES = FAMILIES  # with adapters of their own; the others run when `check_runs` passes
# Families mlx-lm runs and mlxkv does not yet, by the layers that stop them.
NOT_YET = {
    "falcon_h1": "layers that run a Mamba mixer and attention side by side, on one cache of both",
    "plamo3": "sliding-window layers whose window mlx-lm makes a token wider in prefill (its mask) than in decode "
    "(its cache)",
    "afm7": "KV-reuse layers (its last layers attend the keys and values the decoder reads back from another's cache)",
    "iquestloopcoder": "a loop that runs every layer twice, the second pass attending the first pass's keys and values",
}
CONTEXTS = ("max_position_embeddings", "n_positions")
DEMO_MODEL = Path(__file__).parents[1] / "demo_model"


@functools.cache
def resolve_model_path(path_or_repo: str | Path) -> Path:
    """A local checkpoint directory for `path_or_repo`; a repo id is fetched as mlx-lm fetches it
    (once a process: the next call finds it at once)."""
    if not isinstance(path_or_repo, (str, Path)):
        raise ModelLoadError(
            f"model must be a checkpoint directory or a Hugging Face repo id, got {type(path_or_repo).__name__}"
        )
    path = Path(path_or_repo).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelLoadError(f"model path {str(path)!r} is a file; expected a checkpoint directory")
        return path
    text = str(path_or_repo)
    if text.startswith((".", "/", "~")) or text.count("/") != 1:
        raise ModelLoadError(f"model path {text!r} does not exist (and is not a Hugging Face repo id)")
    try:
        return Path(snapshot_download(text, allow_patterns=DEFAULT_ALLOW_PATTERNS))
    except Exception as exc:
        raise ModelLoadError(f"could not get {text!r} from the Hugging Face hub: {exc}") from None


def check_config(path: Path) -> dict[str, Any]:
    """The checkpoint's config.json, if mlxkv runs its architecture as mlx-lm does."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{str(path)!r} has no config.json; expected an mlx-lm checkpoint directory")
    try:
        config = json.loads(config_file.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ModelLoadError(f"{str(config_file)!r} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{str(config_file)!r} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{str(config_file)!r} must hold a JSON object, got a {type(config).__name__}")
    model_type = config.get("model_type")
    if model_type in NOT_YET:
        raise ModelLoadError(
            f"unsupported model_type {model_type!r} in {str(config_file)!r}: it uses {NOT_YET[model_type]}, "
            "not supported yet"
        )
    if not isinstance(model_type, str):
        raise ModelLoadError(f"{str(config_file)!r} has no model_type string; expected an mlx-lm checkpoint's config")
    if not _in_mlx_lm(model_type):
        raise ModelLoadError(
            f"unsupported model_type {model_type!r} in {str(config_file)!r}: mlx-lm {mlx_lm.__version__} has no "
            "such model family (docs/families.md lists those mlxkv runs)"
        )
    return config


def _in_mlx_lm(model_type: str) -> bool:
    """Whether the installed mlx-lm has a model file for `model_type` (found without importing it)."""
    family = MODEL_REMAPPING.get(model_type, model_type)
    if re.fullmatch(r"[\w-]+", family) is None:
        return False
    return importlib.util.find_spec(f"mlx_lm.models.{family}") is not None


def check_runs(model: nn.Module, model_type: str) -> None:
    """Refuse a loaded model whose layers mlxkv cannot run over its pages, naming what stops it."""
    text = text_model(model)
    try:
        layers, roles = decoder_layers(text), layer_roles(text)
        for index in roles.attention:
            adapter_for(text, index, attention_module(layers[index]))
        state_shapes(text, roles)
    except ModelLoadError as exc:
        raise ModelLoadError(f"unsupported model_type {model_type!r}: {exc}") from None
    except StopIteration:
        raise ModelLoadError(
            f"unsupported model_type {model_type!r}: its model, decoder or layers are not named as mlxkv looks "
            "for them (see models/structure.py)"
        ) from None
    except (AttributeError, TypeError) as exc:
        raise ModelLoadError(
            f"unsupported model_type {model_type!r}: its layers are not laid out as mlxkv reads them ({exc})"
        ) from None


def rope_overrides(config: dict[str, Any]) -> dict[str, Any]:
    """`rope_theta` and `rope_scaling` lifted out of `rope_parameters` (where transformers 5 writes
    them) for the model code that reads only the old fields."""
    rope = config.get("rope_parameters")
    if not isinstance(rope, dict):
        return {}
    lifted = {}
    if "rope_theta" not in config and "rope_theta" in rope:
        lifted["rope_theta"] = rope["rope_theta"]
    if config.get("rope_scaling") is None and rope.get("rope_type", "default") != "default":
        lifted["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return lifted


def head_overrides(path: Path, config: dict[str, Any]) -> dict[str, Any]:
    """An embedding checkpoint whose weights hold no `lm_head` (Qwen3-Embedding's 4B and 8B) loads
    with tied embeddings: its head is never used. Weights named without the decoder's `model.`
    prefix (transformers' base model, as the original repos have them) are refused, naming a fix."""
    if pooling_of(path) is None:
        return {}
    names = weight_names(path)
    if names and not any(name.startswith("model.") for name in names):
        raise ModelLoadError(
            f"the weights in {str(path)!r} are named as transformers' base model (no 'model.' prefix); "
            "convert the checkpoint first (python -m mlx_embeddings.convert, or an mlx-community conversion)"
        )
    return {} if "lm_head.weight" in names or config.get("tie_word_embeddings") else {"tie_word_embeddings": True}


def weight_names(path: Path) -> set[str]:
    """The names of the tensors in a checkpoint's safetensors files, read from their headers."""
    names: set[str] = set()
    for file in path.glob("model*.safetensors"):
        with file.open("rb") as stream:
            size = int.from_bytes(stream.read(8), "little")
            names.update(name for name in json.loads(stream.read(size)) if name != "__metadata__")
    return names


def load(
    path_or_repo: str | Path | None = None, group: mx.distributed.Group | None = None
) -> tuple[nn.Module, TokenizerWrapper]:
    """Load a model and its tokenizer as mlx-lm does (quantized checkpoints included).

    `None` loads the small demo model shipped inside the package. With a `group` of more than one
    process, each keeps only its share of the weights (see `sharding`): they are read lazily, split,
    and only then evaluated.
    """
    path = resolve_model_path(DEMO_MODEL if path_or_repo is None else path_or_repo)
    config = check_config(path)
    sharded = group is not None and group.size() > 1
    overrides = rope_overrides(config) | head_overrides(path, config)
    try:
        model, tokenizer = mlx_lm_load(str(path), model_config=overrides, lazy=sharded)[:2]
    except Exception as exc:
        raise ModelLoadError(f"could not load the checkpoint in {str(path)!r}: {exc}") from None
    text = text_model(model)
    if not hasattr(text, "make_cache") and hasattr(model, "make_cache"):  # Llama 4's wrapper makes them
        text.make_cache = model.make_cache  # each layer's cache type says how it attends (its window, chunk)
    check_runs(model, config["model_type"])
    attach(model, load_vision(path, config, text))
    if sharded:
        assert group is not None
        shard(model, config["model_type"], group)
        mx.eval(model.parameters())
    return model, tokenizer


def model_context(model: nn.Module) -> int | None:
    """The most tokens a loaded model says a sequence may hold (`max_position_embeddings`), if its
    mlx-lm arguments say (some families' do not)."""
    args = model_args(model)  # GPT-2's is n_positions: the size of its position embedding table
    return next((int(getattr(args, name)) for name in CONTEXTS if getattr(args, name, None)), None)
