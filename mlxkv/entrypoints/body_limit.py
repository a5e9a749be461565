"""The request body limit: a body over `limit` bytes is refused with a 413, in the shape of the API it
was sent to, before any of it is parsed, so that no client makes the server hold or parse more.

A pure ASGI middleware: it reads the body (as the app would, a message at a time), then hands it to
the app whole and every later message (a disconnect) as it comes. A declared `Content-Length` over
the limit is refused before a byte is read.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import ServingError

Refuse = Callable[[str, ServingError], Response]  # (the request's path, the error): the API's error response


def too_large(limit: int) -> ServingError:
    return ServingError(
        413,
        f"the request body is larger than this server takes ({limit} bytes; see mlxkv serve --max-request-bytes)",
        code="request_too_large",
        kind="request_too_large",
    )


class BodyLimit:
    """Refuses bodies over `limit` bytes with `refuse`'s response."""

    def __init__(self, app: ASGIApp, limit: int, refuse: Refuse) -> None:
        self.app, self.limit, self.refuse = app, limit, refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            await self.refuse(scope["path"], too_large(self.limit))(scope, receive, send)
            return
        body = await self._read(receive)
        if body is None:
            await self.refuse(scope["path"], too_large(self.limit))(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read(self, receive: Receive) -> list[Message] | None:
        """The body's messages, or None once they pass the limit (or the client left: the app sees it)."""
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                return messages
            size += len(message.get("body", b""))
            if size > self.limit:
                return None
            if not message.get("more_body", False):
                return messages


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """`receive` that gives `messages` first, then what the client sends next."""
    pending = list(messages)

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed
