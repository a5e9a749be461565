"""Loading mlx-lm checkpoints (local directories or Hugging Face repos), with clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.nn as nn
from huggingface_hub import snapshot_download
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS
from mlx_lm.utils import load as mlx_lm_load

from ..errors import ModelLoadError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
DEMO_MODEL = Path(__file__).parents[1] / "demo_model"


def resolve_model_path(path_or_repo: str | Path) -> Path:
    """A local checkpoint directory for `path_or_repo`; a repo id is fetched as mlx-lm fetches it."""
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


def check_config(path: Path) -> dict:
    """The checkpoint's config.json, if its architecture is one mlxkv runs."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{str(path)!r} has no config.json; expected an mlx-lm checkpoint directory")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{str(config_file)!r} is not valid JSON: {exc}") from None
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"unsupported model_type {model_type!r} in {str(config_file)!r}; "
            f"mlxkv supports {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return config


def load(path_or_repo: str | Path | None = None) -> tuple[nn.Module, TokenizerWrapper]:
    """Load a model and its tokenizer as mlx-lm does (quantized checkpoints included).

    `None` loads the small demo model shipped inside the package.
    """
    path = resolve_model_path(DEMO_MODEL if path_or_repo is None else path_or_repo)
    check_config(path)
    try:
        return mlx_lm_load(str(path))
    except Exception as exc:
        raise ModelLoadError(f"could not load the checkpoint in {str(path)!r}: {exc}") from None
