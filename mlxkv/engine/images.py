"""Images in prompts: where each sits in a request's tokens, and what a step splices in for them.

A prompt with images is text with one marker per image (the marker the model's chat template
writes, `Vision.image_token`) and the images in order. Each marker becomes the image's span of
placeholder tokens as the processor expands it; the digest of each image marks its first
placeholder, so that its pages and every page after them are keyed by the image as well as the
tokens (see `cache.prefix_cache`). A step whose rows reach placeholders gets their feature rows
(`StepMedia`), and for an M-RoPE family every token's three positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..cache.prefix_cache import Marks
from ..errors import counted
from ..models.vision import ProcessedImage, Vision
from .recent_outputs import RecentOutputs
from .request import Request


@dataclass(frozen=True, eq=False)
class PromptImage:
    """An image of a prompt: its span of tokens starts at `start`."""

    start: int
    image: ProcessedImage

    @property
    def placeholders(self) -> np.ndarray:
        """The prompt positions that take its feature rows."""
        return self.start + self.image.placeholders


@dataclass(frozen=True, eq=False)
class PromptImages:
    """A prompt's images, and for an M-RoPE family its tokens' positions (`[3, prompt tokens]`)
    and the shift of the positions of the tokens after the prompt. `blocks`: for a family that
    attends both ways within an image (Gemma 4), each run of placeholders as `(first, end)`
    positions, which a step's chunk holds whole (see `KVBatch.with_blocks`)."""

    images: tuple[PromptImage, ...]
    positions: np.ndarray | None = None
    shift: int = 0
    blocks: tuple[tuple[int, int], ...] = ()

    @property
    def marks(self) -> Marks:
        """Each image's digest at its first placeholder."""
        return tuple((int(i.placeholders[0]), i.image.digest) for i in self.images)


@dataclass(frozen=True)
class ImagePrompt:
    """A prompt with images: `text` with one image marker (`LLM.image_marker`, the one the model's
    chat template writes) where each image goes, and the `images` in order (PIL images, file paths
    or the bytes of image files)."""

    text: str
    images: Sequence[Any]


class PlacedPrompt(list[int]):
    """An `ImagePrompt` encoded: its token ids (the list itself, so that it goes wherever a prompt's
    ids go), each marker expanded into its image's span, and its `images` placed in them."""

    def __init__(self, ids: list[int], images: PromptImages) -> None:
        super().__init__(ids)
        self.images = images


def open_image(source: Any) -> Any:
    """`source` as an RGB PIL image: a PIL image, a file path, or the bytes of an image file;
    ValueError naming what it is otherwise."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(source, Image.Image):
        return source.convert("RGB")
    try:
        if isinstance(source, (bytes, bytearray)):
            return Image.open(BytesIO(source)).convert("RGB")
        if isinstance(source, (str, Path)):
            with Image.open(Path(source).expanduser()) as image:
                return image.convert("RGB")
    except FileNotFoundError:
        raise ValueError(f"image file {str(source)!r} does not exist") from None
    except (UnidentifiedImageError, OSError) as exc:
        raise ValueError(f"could not read an image: {exc}") from None
    raise TypeError(f"an image must be a PIL image, a file path or image bytes, got {type(source).__name__}")


def place_images(
    tokenizer: TokenizerWrapper,
    vision: Vision,
    prompt: ImagePrompt,
    recent: RecentOutputs | None = None,
    salt: str | None = None,
    templated: bool = False,
) -> PlacedPrompt:
    """`prompt`'s token ids (its text's as `encode_text` makes them) with each image marker expanded
    into its image's span; ValueError unless there is one marker per image, or an image is unreadable."""
    from .inputs import encode_text

    text, images = prompt.text, list(prompt.images)
    if not isinstance(text, str):
        raise TypeError(f"an ImagePrompt's text must be a string, got {type(text).__name__}")
    pieces = text.split(vision.image_token)
    if len(pieces) - 1 != len(images):
        raise ValueError(
            f"the prompt has {counted(len(pieces) - 1, 'image marker')} ({vision.image_token!r}) for "
            f"{counted(len(images), 'image')}; expected one marker per image"
        )
    ids = encode_text(tokenizer, pieces[0], recent, salt, templated)
    placed = []
    for piece, image in zip(pieces[1:], images):
        processed = vision.process(open_image(image))
        placed.append(PromptImage(len(ids), processed))
        ids += processed.ids
        if piece:
            ids += encode_text(tokenizer, piece, recent, salt, templated=True)  # it continues the text: no BOS
    rope = vision.positions(np.asarray(ids, np.int64), [p.image for p in placed])
    positions, shift = rope if rope is not None else (None, 0)
    blocks = tuple(run for p in placed for run in _runs(p.placeholders)) if vision.both_ways else ()
    return PlacedPrompt(ids, PromptImages(tuple(placed), positions, shift, blocks))


def _runs(positions: np.ndarray) -> list[tuple[int, int]]:
    """The runs of consecutive `positions` (ascending), as `(first, end)`."""
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    return [(int(run[0]), int(run[-1]) + 1) for run in np.split(positions, breaks)]


@dataclass(frozen=True, eq=False)
class StepMedia:
    """What a step's images put into its forward pass: the packed tokens at `rows` take the
    `features` rows instead of their embeddings (and the `deepstack` rows added to the first
    layers' outputs); `positions` (`[3, tokens]`) are every token's M-RoPE positions, or None;
    `blocks` (`[tokens, 2]`) the block each token sees whole (`KVBatch.with_blocks`), or None."""

    rows: mx.array
    features: mx.array
    deepstack: tuple[mx.array, ...]
    positions: np.ndarray | None
    blocks: np.ndarray | None = None


def step_media(
    vision: Vision | None,
    requests: Sequence[Request],
    counts: Sequence[int],
    positions: np.ndarray,
    reserve: int | None = None,
) -> StepMedia | None:
    """The images of a step of `counts[i]` tokens of `requests[i]` at KV `positions` (encoded
    here, lazily, together as far as the step `reserve` allows, where not cached); None when no
    row has any."""
    if vision is None or not any(r.images is not None for r in requests):
        return None
    rope = np.broadcast_to(positions, (3, positions.size)).copy() if vision.mrope is not None else None
    blocks = np.zeros((positions.size, 2), np.int32) if vision.both_ways else None
    reached: list[tuple[np.ndarray, np.ndarray, PromptImage]] = []  # step rows, which placeholders, image
    offset = 0
    for request, count in zip(requests, counts):
        start, stop = request.num_computed, request.num_computed + count
        if request.images is not None:
            for placed in request.images.images:
                inside = (placed.placeholders >= start) & (placed.placeholders < stop)
                if inside.any():
                    reached.append((offset + placed.placeholders[inside] - start, np.flatnonzero(inside), placed))
            if blocks is not None:
                _fill_blocks(blocks[offset : offset + count], request.images.blocks, start, stop)
            if rope is not None and request.images.positions is not None:
                rope[:, offset : offset + count] = _positions(request.images, start, stop)
        offset += count
    if not reached and rope is None:
        return None
    encoded = vision.features([placed.image for _, _, placed in reached], reserve)
    taken = [mx.array(which.astype(np.int32)) for _, which, _ in reached]
    deep = [[level[t] for level in e.deepstack] for e, t in zip(encoded, taken)]
    return StepMedia(
        mx.array(np.concatenate([rows for rows, _, _ in reached]).astype(np.int32))
        if reached
        else mx.zeros((0,), mx.int32),
        mx.concatenate([e.rows[t] for e, t in zip(encoded, taken)]) if reached else mx.zeros((0,)),
        tuple(mx.concatenate(list(level)) for level in zip(*deep)) if deep and deep[0] else (),
        rope,
        blocks if blocks is not None and blocks.any() else None,
    )


def _fill_blocks(rows: np.ndarray, blocks: tuple[tuple[int, int], ...], start: int, stop: int) -> None:
    """Write into `rows` (a row's tokens `start` to `stop`) the block each of them is in."""
    for first, end in blocks:
        lo, hi = max(first, start), min(end, stop)
        if lo < hi:
            rows[lo - start : hi - start] = first, end


def _positions(images: PromptImages, start: int, stop: int) -> np.ndarray:
    """M-RoPE positions (`[3, stop - start]`) of a request's tokens `start` to `stop`: the prompt's
    as its images place them, the later ones at their index plus the prompt's shift."""
    assert images.positions is not None
    prompt = images.positions.shape[1]
    inside = images.positions[:, start : min(stop, prompt)]
    after = np.arange(max(start, prompt), stop, dtype=np.int32) + images.shift
    return np.concatenate([inside, np.broadcast_to(after, (3, after.size))], axis=1)
