"""A multimodal checkpoint's vision half, through mlx-vlm: its processor, vision tower and projector.

mlxkv runs the language model as mlx-lm builds it, over its pages, as for any text model; mlx-vlm
(the `vision` extra) turns each image into the rows that replace the image's placeholder tokens in
the prompt's embeddings. mlx-vlm's model is loaded lazily with its token embeddings swapped for
the text model's, so the language weights are read once, by mlx-lm: of mlx-vlm's copy only the
vision tower and projector are ever evaluated.

An image is processed (resized, cut into patches) on the host when its request arrives, and
encoded on first use, inside the step that needs it; its features are kept by the digest of its
pixels in a cache bounded in bytes, so a conversation that sends it again does not encode it again.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import ModelLoadError
from .structure import decoder, embeddings, held_arrays

logger = logging.getLogger(__name__)

EXTRA = 'pip install "mlxkv[vision]"'
FEATURE_CACHE_BYTES = 256 << 20  # encoded images kept for conversations that send them again
_ATTRIBUTE = "mlxkv_vision"  # where `attach` keeps a text model's vision


@dataclass(frozen=True, eq=False)
class ProcessedImage:
    """One image as the processor made it: its span's token ids (the image token repeated, with
    whatever row breaks and ends the family writes around it), which of them are placeholders
    (take a feature row each), the arrays the vision tower reads, and a digest of all of them and
    of the processor's settings."""

    ids: tuple[int, ...]
    placeholders: np.ndarray
    arrays: dict[str, mx.array]
    digest: bytes


@dataclass(frozen=True, eq=False)
class ImageFeatures:
    """An encoded image: a row of the language model's input embeddings per placeholder, and
    for families that add vision features into the first decoder layers' outputs (Qwen3-VL's
    deepstack), a `[placeholders, hidden]` array per such layer."""

    rows: mx.array
    deepstack: tuple[mx.array, ...] = ()

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes + sum(a.nbytes for a in self.deepstack)


@dataclass(frozen=True)
class MRoPE:
    """Multimodal RoPE (Qwen's): each rotated dim of a head turns by one of three positions
    (time, height, width); `axis[d]` says which, for each dim of the head."""

    axis: mx.array


class Vision:
    """The vision half of a multimodal checkpoint, beside the text model mlxkv runs."""

    def __init__(
        self, model: nn.Module, processor: Any, text: nn.Module, cache_bytes: int = FEATURE_CACHE_BYTES
    ) -> None:
        """`text`: the mlx-lm text model beside it. Gemma's decoder scales the embeddings it is given
        by `embed_scale`, mlx-vlm's features come unscaled: they are divided by it (`input_scale`);
        and its per-layer inputs read token id 0 at an image's rows, as mlx-vlm's (`blank_placeholders`).
        `both_ways`: the language model attends both ways within each run of an image's placeholders."""
        self.model = model
        self.processor = processor
        inner = decoder(text)
        self.input_scale = float(getattr(inner, "embed_scale", 1.0))
        self.blank_placeholders = bool(getattr(inner, "hidden_size_per_layer_input", 0))
        self.image_token: str = processor.image_token  # the marker a chat template writes per image
        config = model.config
        names = [n for n in ("image_token_index", "image_token_id") if hasattr(config, n)]
        self.image_token_id = int(getattr(config, names[0]))
        self.settings = _settings(processor)
        self.mrope = _mrope(model)
        text_config = getattr(config, "text_config", None)
        self.both_ways = getattr(text_config, "use_bidirectional_attention", None) == "vision"  # Gemma 4's
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[bytes, ImageFeatures] = OrderedDict()
        self._cached_bytes = 0

    @property
    def deepstack_layers(self) -> int:
        """How many of the first decoder layers take vision features added to their outputs (Qwen3-VL's deepstack)."""
        return len(getattr(self.model.config.vision_config, "deepstack_visual_indexes", None) or ())

    def weights(self) -> list[mx.array]:
        """The vision tower's and projector's weights (and the tables they build at load): all of
        mlx-vlm's model but its language model (whose weights are the text model's, or never read)."""
        language = getattr(self.model, "language_model", None)
        skip = {id(a) for a in held_arrays(language)} if language is not None else set()
        return [a for a in held_arrays(self.model) if id(a) not in skip]

    @property
    def weight_bytes(self) -> int:
        return sum(a.nbytes for a in self.weights())

    def encode_bytes(self, image: ProcessedImage) -> int:
        """About the most bytes the vision tower's temporaries take to encode `image`: one layer's
        attention scores over its patches in float32 (MLX's fused attention on a Mac holds less)
        and a few copies of a layer's activations."""
        config = self.model.config.vision_config
        channels = getattr(config, "in_channels", None) or getattr(config, "num_channels", None) or 3
        per_patch = channels * config.patch_size**2 * (getattr(config, "temporal_patch_size", None) or 1)
        patches = image.arrays["pixel_values"].size // per_patch
        heads = getattr(config, "num_heads", None) or config.num_attention_heads
        return int(4 * heads * patches**2 + 4 * 16 * patches * config.hidden_size)

    def process(self, image: Any) -> ProcessedImage:
        """`image` (a PIL image) as the processor makes it for one placeholder; ValueError if it cannot."""
        try:
            out = self.processor(text=[self.image_token], images=[image], return_tensors="np")
        except Exception as exc:
            raise ValueError(f"the model's image processor could not read an image: {exc}") from None
        ids = np.asarray(out["input_ids"]).reshape(-1)
        raw = {k: np.asarray(v) for k, v in out.items() if k not in ("input_ids", "attention_mask")}
        placeholders = np.flatnonzero(ids == self.image_token_id).astype(np.int32)
        if not placeholders.size:
            raise ValueError("the model's image processor made no placeholder for an image")
        digest = hashlib.sha256(self.settings + ids.astype("<i8").tobytes())
        for name in sorted(raw):
            array = raw[name]
            digest.update(name.encode() + str(array.shape).encode() + str(array.dtype).encode() + array.tobytes())
        arrays = {name: mx.array(array) for name, array in raw.items()}
        return ProcessedImage(tuple(int(t) for t in ids), placeholders, arrays, digest.digest())

    def features(self, images: Sequence[ProcessedImage], budget: int | None = None) -> list[ImageFeatures]:
        """Each image's features: from the cache, else encoded now (lazily, within the caller's
        step), the images whose arrays differ only along their first axis together, in passes of
        the tower whose `encode_bytes` add up to at most `budget` (or one image)."""
        found: dict[bytes, ImageFeatures] = {}
        for image in images:
            if image.digest in self._cache:
                self._cache.move_to_end(image.digest)
                found[image.digest] = self._cache[image.digest]
        groups: dict[tuple[Any, ...], list[list[ProcessedImage]]] = {}
        for image in {i.digest: i for i in images if i.digest not in found}.values():
            passes = groups.setdefault(_batch_shape(image), [[]])
            if passes[-1] and budget is not None and sum(map(self.encode_bytes, passes[-1] + [image])) > budget:
                passes.append([])
            passes[-1].append(image)
        for together in (p for passes in groups.values() for p in passes):
            for image, features in zip(together, self._encode(together)):
                found[image.digest] = features
                self._keep(image.digest, features)
        return [found[image.digest] for image in images]

    def _encode(self, images: list[ProcessedImage]) -> list[ImageFeatures]:
        """`images` through the tower in one pass, as mlx-vlm encodes a prompt's images: their spans
        one after another, their arrays joined along the first axis (a token's, along the tokens)."""
        ids = mx.array(np.concatenate([np.asarray(image.ids, np.int64) for image in images]))[None]
        arrays = {
            name: mx.concatenate([i.arrays[name] for i in images], axis=1 if _per_token(images[0], name) else 0)
            for name in images[0].arrays
        }
        pixels = arrays.pop("pixel_values")
        out = self.model.get_input_embeddings(ids, pixels, mask=mx.ones(ids.shape, mx.int64), **arrays)
        deep = getattr(out, "deepstack_visual_embeds", None) or ()
        encoded, offset, taken = [], 0, 0
        for image in images:
            rows = out.inputs_embeds[0][mx.array(offset + image.placeholders)]
            count = image.placeholders.size
            levels = tuple(level[taken : taken + count] for level in deep)
            encoded.append(ImageFeatures(rows / self.input_scale if self.input_scale != 1.0 else rows, levels))
            offset, taken = offset + len(image.ids), taken + count
        return encoded

    def _keep(self, digest: bytes, features: ImageFeatures) -> None:
        """Cache `features`, dropping the least recently used beyond `cache_bytes`."""
        if features.nbytes > self.cache_bytes:
            return
        self._cache[digest] = features
        self._cached_bytes += features.nbytes
        while self._cached_bytes > self.cache_bytes:
            _, dropped = self._cache.popitem(last=False)
            self._cached_bytes -= dropped.nbytes

    def positions(self, ids: np.ndarray, images: list[ProcessedImage]) -> tuple[np.ndarray, int] | None:
        """For an M-RoPE family, each prompt token's three positions (`[3, tokens]`) and the shift
        of the positions after the prompt (generated tokens sit at their index plus it), by the
        family's own rule in mlx-vlm; None for a family that rotates by the token's index alone."""
        if self.mrope is None:
            return None
        language = self.model.language_model
        wanted = inspect.signature(language.get_rope_index).parameters
        grids = {
            name: mx.concatenate([image.arrays[name] for image in images])
            for name in wanted
            if images and name in images[0].arrays
        }
        position_ids, delta = language.get_rope_index(mx.array(ids.astype(np.int64))[None], **grids)
        return np.array(position_ids)[:, 0].astype(np.int32), int(np.array(delta).reshape(-1)[0])


def _batch_shape(image: ProcessedImage) -> tuple[Any, ...]:
    """What images must share to be encoded in one pass: each array's name, dtype and shape past the
    axis they are joined along."""
    return tuple(
        (name, array.dtype, array.shape[:1] if _per_token(image, name) else array.shape[1:])
        for name, array in sorted(image.arrays.items())
    )


def _per_token(image: ProcessedImage, name: str) -> bool:
    """Whether the processor's array `name` has a value per token of the image's span (`[1, tokens]`,
    as Gemma 4's `mm_token_type_ids`)."""
    return tuple(image.arrays[name].shape) == (1, len(image.ids))


def _settings(processor: Any) -> bytes:
    """The image processor's settings, as bytes: a digest over them tells resizings apart."""
    image_processor = getattr(processor, "image_processor", processor)
    try:
        return str(image_processor.to_json_string()).encode()
    except Exception:
        return json.dumps(getattr(image_processor, "__dict__", {}), default=str, sort_keys=True).encode()


def _mrope(model: nn.Module) -> MRoPE | None:
    """The M-RoPE layout of mlx-vlm's language model, as an axis per head dim, if it has one."""
    language = getattr(model, "language_model", None)
    if language is None or not hasattr(language, "get_rope_index"):
        return None
    rotary = next((m for _, m in language.named_modules() if hasattr(m, "position_selector")), None)
    if rotary is None or rotary.position_selector is None or rotary.style != "interleaved":
        raise ModelLoadError(
            "this model's multimodal RoPE layout is not supported yet for images (mlxkv reads Qwen's interleaved one)"
        )
    selector = np.array(rotary.position_selector)  # one axis per rotated pair (half-split: dims i and i + half)
    return MRoPE(mx.array(np.concatenate([selector, selector]).astype(np.int32)))


def load_vision(path: Path, config: dict[str, Any], text: nn.Module) -> Vision | None:
    """The vision half of the checkpoint in `path` (None for a text-only one), its token
    embeddings `text`'s; without mlx-vlm, None and a line saying how to add it."""
    if not isinstance(config.get("vision_config"), dict):
        return None
    try:
        import mlx_vlm
    except ImportError:
        logger.warning("%s is a multimodal checkpoint: it runs on text only; images need %s", path.name, EXTRA)
        return None
    try:
        model, processor = mlx_vlm.load(str(path), lazy=True)
    except Exception as exc:
        raise ModelLoadError(f"could not load the vision half of the checkpoint in {str(path)!r}: {exc}") from None
    model.language_model.model.embed_tokens = embeddings(text)  # shared: mlx-vlm's own copy is never read
    return Vision(model, processor, text)


def attach(model: nn.Module, vision: Vision | None) -> None:
    """Keep `vision` with the text model `model`, for the engine that runs it."""
    object.__setattr__(model, _ATTRIBUTE, vision)


def attached(model: nn.Module) -> Vision | None:
    """The vision `attach` kept with `model`, if any."""
    vision: Vision | None = model.__dict__.get(_ATTRIBUTE)
    return vision
