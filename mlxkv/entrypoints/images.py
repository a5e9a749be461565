"""Images as the APIs send them: base64 data, data URLs, or http(s) URLs fetched within limits.

Every API's protocol turns its image content (OpenAI's `image_url` parts, the Responses API's
`input_image`, Anthropic's `image` blocks, Ollama's `images`) into an `ImageRef` among a message's
content parts (`template_content`), as chat templates read images: `{"type": "image"}`. The serving
core gathers them in order (`image_refs`) and reads their bytes on a worker thread (`read`).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

MAX_IMAGE_BYTES = 20 * 2**20  # one image's file, as sent or fetched
FETCH_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ImageRef:
    """An image a request names: its file's bytes, or an http(s) URL to fetch them from; `block`:
    what the API calls such content (`image_url`, `image`, `images`), for errors."""

    block: str
    data: bytes | None = None
    url: str | None = None

    def read(self, fetch_urls: bool) -> bytes:
        """The image file's bytes, fetched if need be (at most `MAX_IMAGE_BYTES`, within
        `FETCH_TIMEOUT_S`); ValueError naming the block if it cannot be had."""
        if self.data is not None:
            return self.data
        assert self.url is not None
        if not fetch_urls:
            raise ValueError(f"{self.block}: this server fetches no image URLs; send the image as base64 data")
        try:
            with httpx.stream("GET", self.url, timeout=FETCH_TIMEOUT_S, follow_redirects=True) as response:
                response.raise_for_status()
                body = bytearray()
                for chunk in response.iter_bytes():
                    body += chunk
                    _check_size(len(body), self.block, f"the image at {self.url}")
                return bytes(body)
        except httpx.HTTPError as exc:
            raise ValueError(f"{self.block}: could not fetch {self.url}: {exc}") from None


def from_base64(data: str, block: str) -> ImageRef:
    """An image sent as base64 text; ValueError naming `block` if it is not base64 or too big."""
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{block}: the image data is not base64") from None
    _check_size(len(raw), block, "the image")
    return ImageRef(block, data=raw)


def from_file(path: str, block: str) -> ImageRef:
    """An image file on this machine; ValueError naming `block` if it cannot be read."""
    try:
        data = Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise ValueError(f"{block}: cannot read {path!r} ({exc.strerror or exc})") from None
    _check_size(len(data), block, repr(path))
    return ImageRef(block, data=data)


def _check_size(size: int, block: str, what: str) -> None:
    """ValueError naming `block` and `what` for an image file over `MAX_IMAGE_BYTES`."""
    if size > MAX_IMAGE_BYTES:
        raise ValueError(f"{block}: {what} is over {MAX_IMAGE_BYTES >> 20} MB")


def from_url(url: str, block: str) -> ImageRef:
    """An image named by a URL: a base64 data URL, or http(s) to fetch; ValueError otherwise."""
    if url.startswith("data:"):
        header, _, data = url.partition(",")
        if not header.endswith(";base64"):
            raise ValueError(f"{block}: a data URL must hold base64 data (data:image/png;base64,...)")
        return from_base64(data, block)
    if url.startswith(("http://", "https://")):
        return ImageRef(block, url=url)
    raise ValueError(f"{block}: an image URL must be a data: URL or http(s), got {url[:40]!r}")


def template_content(pieces: Sequence[str | ImageRef]) -> str | list[dict[str, Any]]:
    """A message's content as chat templates read it: its text, or with images, its text and
    image parts in order (`{"type": "image"}`, the `ImageRef` under `image`)."""
    if not any(isinstance(p, ImageRef) for p in pieces):
        return "".join(p for p in pieces if isinstance(p, str))
    return [{"type": "image", "image": p} if isinstance(p, ImageRef) else {"type": "text", "text": p} for p in pieces]


def image_refs(messages: Sequence[dict[str, Any]]) -> list[ImageRef]:
    """The images of a conversation, in the order a chat template renders them."""
    return [
        part["image"]
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, dict) and isinstance(part.get("image"), ImageRef)
    ]
