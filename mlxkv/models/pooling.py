"""How an embedding checkpoint makes one vector of a text's last hidden states, as its own
sentence-transformers files say, never guessed: `modules.json` names a Pooling module (its folder's
`config.json` gives the mode) and, if the vectors are L2-normalised, a Normalize module.
Qwen3-Embedding pools the last token and normalises; BGE takes the first ([CLS]) token; E5 and
MiniLM take the mean."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import numpy as np

POOLING_MODULE = "sentence_transformers.models.Pooling"
NORMALIZE_MODULE = "sentence_transformers.models.Normalize"
MODES = {  # the Pooling module's flags, and the modes mlxkv computes
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_lasttoken": "last",
}
UNSUPPORTED = ("pooling_mode_weightedmean_tokens",)
EPS = 1e-12  # below this norm a vector is left as it is (all zeros), as torch's normalize does


@dataclass(frozen=True)
class Pooling:
    """A checkpoint's pooling: its `mode` (one of `MODES`' values), whether the vector is then
    L2-normalised, and its size (`dimensions`, the Pooling module's word embedding dimension).
    `sizes`: what a vector may be cut to (Matryoshka), as vLLM reads a checkpoint's `config.json`:
    its `matryoshka_dimensions`, else any size if `is_matryoshka`; none if it says neither."""

    mode: str
    normalize: bool
    dimensions: int | None = None
    sizes: tuple[int, ...] | range = ()

    def cut(self, vectors: list[list[float]], size: int) -> list[list[float]]:
        """`vectors` cut to their first `size` numbers, normalised again if the checkpoint normalises;
        ValueError naming `dimensions` for a size the checkpoint does not allow."""
        full = len(vectors[0]) if vectors else self.dimensions
        if size == full:
            return vectors
        if size not in self.sizes:
            allowed = "" if not self.sizes else f"; it may be cut to {_sizes(self.sizes)}"
            raise ValueError(f"dimensions: this model makes vectors of {full} numbers{allowed}, not {size}")
        cut = np.asarray(vectors, np.float32)[:, :size]
        if self.normalize:
            cut /= np.maximum(np.linalg.norm(cut, axis=-1, keepdims=True), EPS)
        return cast("list[list[float]]", cut.tolist())

    def __call__(self, hidden: mx.array, lengths: mx.array) -> mx.array:
        """One vector per row of `hidden` (`[rows, tokens, dim]`, each row's first `lengths[row]`
        tokens its text's, the rest padding), in float32."""
        hidden = hidden.astype(mx.float32)
        positions = mx.arange(hidden.shape[1])[None, :]
        mask = (positions < lengths[:, None]).astype(mx.float32)[..., None]
        if self.mode == "cls":
            pooled = hidden[:, 0]
        elif self.mode == "last":
            pooled = mx.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
        elif self.mode == "max":
            pooled = mx.where(mask > 0, hidden, -mx.inf).max(axis=1)
        else:
            total = (hidden * mask).sum(axis=1)
            count = lengths[:, None].astype(mx.float32)
            pooled = total / (mx.sqrt(count) if self.mode == "mean_sqrt_len" else count)
        return self.finish(pooled)

    def finish(self, pooled: mx.array) -> mx.array:
        """Pooled vectors (`[rows, dim]`) as the checkpoint hands them out: float32, L2-normalised if it says."""
        pooled = pooled.astype(mx.float32)
        return normalized(pooled) if self.normalize else pooled


def normalized(vectors: mx.array) -> mx.array:
    """Each row of `vectors` scaled to length 1 (a zero row stays zero)."""
    norms = mx.linalg.norm(vectors, axis=-1, keepdims=True)
    return vectors / mx.maximum(norms, EPS)


def pooling_of(folder: Path) -> Pooling | None:
    """The pooling the checkpoint in `folder` declares; None if it has no sentence-transformers
    Pooling module (it is no embedding checkpoint); ValueError naming the file for one that
    cannot be read, or a pooling mlxkv does not compute."""
    modules = _json(folder / "modules.json")
    if modules is None:
        return None
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ValueError(f"{str(folder / 'modules.json')!r} must hold a list of modules")
    types = [m.get("type") for m in modules]
    if POOLING_MODULE not in types:
        return None
    path = folder / str(modules[types.index(POOLING_MODULE)].get("path", "")) / "config.json"
    config = _json(path)
    if not isinstance(config, dict):
        raise ValueError(f"{str(path)!r} must hold the Pooling module's settings (a JSON object)")
    unsupported = [flag for flag in UNSUPPORTED if config.get(flag)]
    modes = [mode for flag, mode in MODES.items() if config.get(flag)]
    if unsupported or len(modes) != 1:
        chosen = ", ".join(unsupported + [flag for flag in MODES if config.get(flag)]) or "none"
        raise ValueError(f"{str(path)!r} asks for pooling {chosen}; mlxkv computes exactly one of {', '.join(MODES)}")
    size = config.get("word_embedding_dimension")
    size = size if isinstance(size, int) else None
    return Pooling(modes[0], NORMALIZE_MODULE in types, size, _matryoshka(folder, size))


def _matryoshka(folder: Path, size: int | None) -> tuple[int, ...] | range:
    """The sizes the checkpoint's `config.json` lets a vector be cut to (see `Pooling.sizes`)."""
    config = _json(folder / "config.json")
    if not isinstance(config, dict):
        return ()
    listed = config.get("matryoshka_dimensions")
    if isinstance(listed, list) and all(isinstance(n, int) and n > 0 for n in listed):
        return tuple(listed)
    return range(1, size + 1) if config.get("is_matryoshka") is True and size is not None else ()


def _sizes(sizes: tuple[int, ...] | range) -> str:
    return f"1 to {sizes.stop - 1}" if isinstance(sizes, range) else ", ".join(map(str, sizes))


def _json(path: Path) -> Any:
    """`path` read as JSON; None if there is no such file; ValueError naming it if it is not JSON."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{str(path)!r} cannot be read: {exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{str(path)!r} is not valid JSON: {exc}") from None
