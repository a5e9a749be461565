"""Signatures of the thinking blocks this server writes, so that a block a client sends back can be
checked: Anthropic's clients pass a reply's `thinking` blocks back unchanged (before its
`tool_use`), and one whose text was changed on the way is refused, as Anthropic refuses it.

The key is kept in the user's cache folder, so that a conversation survives a restart of the server.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
import secrets
from pathlib import Path

logger = logging.getLogger(__name__)

KEY_FILE = Path.home() / ".cache" / "mlxkv" / "thinking-key"  # beside the kernel simulator's builds


class ThinkingSignatures:
    """HMAC-SHA256 signatures of thinking text under the secret key kept at `path` (made, readable
    by its owner only, the first time one is needed; for this run only where the folder cannot be
    written, which is logged)."""

    def __init__(self, path: Path = KEY_FILE) -> None:
        self.path = path
        self._key: bytes | None = None

    def sign(self, thinking: str) -> str:
        digest = hmac.new(self.key, thinking.encode("utf-8", "surrogatepass"), hashlib.sha256).digest()
        return base64.b64encode(digest).decode("ascii")

    def check(self, thinking: str, signature: str) -> bool:
        return hmac.compare_digest(self.sign(thinking), signature)

    @property
    def key(self) -> bytes:
        if self._key is None:
            self._key = self._kept()
        return self._key

    def _kept(self) -> bytes:
        try:
            return self.path.read_bytes()
        except FileNotFoundError:
            pass
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            key = secrets.token_bytes(32)
            with os.fdopen(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as file:
                file.write(key)
            return key
        except FileExistsError:  # another server made it meanwhile
            return self.path.read_bytes()
        except OSError as exc:
            logger.warning("thinking blocks are signed for this run only (%s)", exc)
            return secrets.token_bytes(32)
