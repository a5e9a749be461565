"""The namespace of a disk tier: a digest of everything a page's K/V depend on besides its key."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from ..storage import KVStorage, dtype_name
from .run_file import VERSION


@dataclass(frozen=True)
class DiskSpec:
    """Where the disk tier keeps pages (`folder`), at most `max_bytes` of them, and for which model:
    `model` is a digest of its weights (`models.identity.weights_digest`)."""

    folder: Path
    max_bytes: int
    model: str


def namespace(model: str, storage: KVStorage, windows: dict[int, KVStorage] | None = None) -> str:
    """The model's digest, the pages' dtype, size, quantization and each layer's K/V shape (of the
    full-attention pages and each window group's), and the file format's version, as one hex
    digest: pages of another namespace are never read."""
    fields = dict(version=VERSION, model=model, **_format(storage))
    if windows:
        fields["windows"] = {str(window): _format(pages) for window, pages in sorted(windows.items())}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def _format(storage: KVStorage) -> dict[str, object]:
    """What a page's bytes mean: dtype, size, quantization, each layer's K/V shape."""
    return dict(
        dtype=dtype_name(storage.dtype),
        page_size=storage.page_size,
        bits=storage.bits,
        group_size=storage.group_size if storage.bits else None,
        kv_heads=list(storage.kv_heads),
        head_dims=list(storage.head_dims),
        keys_only=sorted(storage.keys_only),
    )
