"""How every API refuses a request: `ServingError`, which each API renders in its own error shape."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class ServingError(Exception):
    """A request refused or failed, as every API reports it: an HTTP status, a message, the field
    at fault, a code, and its kind (`invalid_request_error`, `authentication_error`,
    `not_found_error`, `server_error`, `overloaded_error`); each API renders it in its own shape."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.kind, self.headers = status, param, code, kind, headers


@contextmanager
def refused_as(param: str | None = None, names: dict[str, str] | None = None) -> Iterator[None]:
    """A ValueError raised within, as a 400 naming `param`; without one, the setting its message
    starts with (a setting's check names it first), as this API calls it (`names`)."""
    try:
        yield
    except ValueError as exc:
        field = str(exc).split()[0]
        raise ServingError(400, str(exc), param or (names or {}).get(field, field)) from None


class UnsupportedContent(ValueError):
    """A content block of a kind (`kind`: image, audio, file, document) the model cannot read, sent
    as `block` (the API's name for it): each API refuses it naming both, and the model."""

    def __init__(self, kind: str, block: str) -> None:
        super().__init__(f"{kind} content ({block}) is not supported by this model")
        self.kind, self.block = kind, block


class UnreadableImage(ValueError):
    """An image in a request that cannot be read: not an image, too big, or a URL that could not be fetched."""
