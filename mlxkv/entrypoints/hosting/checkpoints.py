"""What a listed model's files say before it is loaded: its family, context, the bytes of its
weights and whether it reads images, for the listings (`/api/tags`), the request body limit and
the room a load needs. Read from the checkpoint folder (or the Hugging Face cache) only: nothing
is downloaded and nothing loaded."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...models.loading import DEMO_MODEL
from .catalogue import ListedModel


@dataclass(frozen=True)
class CheckpointFacts:
    """A checkpoint's facts; None (and 0 bytes) where its files are not on this machine yet."""

    model_type: str | None = None
    context: int | None = None
    weight_bytes: int = 0
    images: bool = False
    modified: float | None = None


def facts_of(listed: ListedModel) -> CheckpointFacts:
    folder = local_folder(listed)
    if folder is None:
        return CheckpointFacts()
    config = _config(folder)
    text = config.get("text_config")
    text = text if isinstance(text, dict) else {}
    context = config.get("max_position_embeddings") or text.get("max_position_embeddings")
    weights = sorted(folder.glob("*.safetensors"))
    return CheckpointFacts(
        config.get("model_type"),
        context if isinstance(context, int) else None,
        sum(path.stat().st_size for path in weights),
        "vision_config" in config,
        max((path.stat().st_mtime for path in weights), default=None),
    )


def local_folder(listed: ListedModel) -> Path | None:
    """The model's checkpoint folder on this machine: its path, the demo model, or a repo id's
    snapshot in the Hugging Face cache; None if it is not here yet."""
    if listed.path is None:
        return DEMO_MODEL
    path = Path(listed.path).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(listed.path, local_files_only=True))
    except Exception:  # not a repo id, or not downloaded: known once it is loaded
        return None


def _config(folder: Path) -> dict[str, Any]:
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}
