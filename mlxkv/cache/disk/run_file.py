"""A run file: the K/V of some full pages, each filed under its page key, as one file.

Layout: the magic `MLXKVRUN`, the header's length (4 bytes, little-endian), the header (JSON),
then the payload, each array's bytes after the other's. The header names the format version, the
namespace (the model and cache the pages belong to), the pages' keys, each array's dtype and
shape (its first axis the pages), the payload's length and its CRC-32 (a checksum against damage,
several times as fast as a cryptographic hash, so it never costs more than reading the file). So a
file from another model or page size, a truncated one or one with a flipped byte is told apart
before anything of it reaches a page.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

MAGIC = b"MLXKVRUN"
VERSION = 1
SUFFIX = ".run"


class RunFileError(Exception):
    """A run file that cannot be used: the message says why, in a few words."""


@dataclass(frozen=True)
class RunHeader:
    """What a run file holds: `arrays` are `(dtype, shape)` of each stored array (an MLX dtype's
    name; the bytes are read back as such), their first axis the run's pages, in `keys`' order."""

    namespace: str
    keys: tuple[bytes, ...]
    arrays: tuple[tuple[str, tuple[int, ...]], ...]
    payload_bytes: int
    crc32: int
    offset: int  # where the payload starts in the file


def write_run(path: Path, namespace: str, keys: Sequence[bytes], arrays: Sequence[tuple[str, np.ndarray]]) -> RunHeader:
    """Write the pages `keys` (their `arrays`: `(dtype, bytes as uint8 of shape [pages, ...])`) to
    `path`, whole or not at all (through a temporary file); returns its header (the file's size is
    `offset + payload_bytes`)."""
    payload = [np.ascontiguousarray(data) for _, data in arrays]
    checksum = 0
    for data in payload:
        checksum = zlib.crc32(data.data, checksum)
    header = RunHeader(
        namespace,
        tuple(keys),
        tuple((dtype, tuple(data.shape)) for (dtype, _), data in zip(arrays, payload)),
        sum(data.nbytes for data in payload),
        checksum,
        0,
    )
    fields = json.dumps(
        dict(
            version=VERSION,
            namespace=namespace,
            keys=[key.hex() for key in header.keys],
            arrays=[[dtype, list(shape)] for dtype, shape in header.arrays],
            payload_bytes=header.payload_bytes,
            crc32=checksum,
        )
    ).encode()
    temporary = path.with_suffix(".tmp")
    with open(temporary, "wb") as file:
        file.write(MAGIC + struct.pack("<I", len(fields)) + fields)
        for data in payload:
            file.write(data.data)
    os.replace(temporary, path)
    return replace(header, offset=len(MAGIC) + 4 + len(fields))


def read_header(path: Path) -> RunHeader:
    """The header of the run file `path`, checked against its size; RunFileError if it is not one."""
    try:
        with open(path, "rb") as file:
            start = file.read(len(MAGIC) + 4)
            if len(start) < len(MAGIC) + 4 or start[: len(MAGIC)] != MAGIC:
                raise RunFileError("not a run file")
            (length,) = struct.unpack("<I", start[len(MAGIC) :])
            fields = json.loads(file.read(length))
        if fields.get("version") != VERSION:
            raise RunFileError(f"format version {fields.get('version')!r}, not {VERSION}")
        header = RunHeader(
            fields["namespace"],
            tuple(bytes.fromhex(key) for key in fields["keys"]),
            tuple((dtype, tuple(shape)) for dtype, shape in fields["arrays"]),
            int(fields["payload_bytes"]),
            int(fields["crc32"]),
            len(MAGIC) + 4 + length,
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RunFileError(f"unreadable header ({exc.__class__.__name__})") from None
    if path.stat().st_size != header.offset + header.payload_bytes:
        raise RunFileError(f"{path.stat().st_size} bytes where the header says {header.offset + header.payload_bytes}")
    return header


def read_payload(path: Path, header: RunHeader) -> list[np.ndarray]:
    """The arrays of the run file `path` (uint8, shaped as stored), once its checksum matches;
    RunFileError if it does not, or the file changed since its header was read."""
    try:
        with open(path, "rb") as file:
            file.seek(header.offset)
            payload = file.read(header.payload_bytes + 1)
    except OSError as exc:
        raise RunFileError(f"unreadable ({exc.__class__.__name__})") from None
    if len(payload) != header.payload_bytes:
        raise RunFileError(f"{len(payload)} payload bytes where the header says {header.payload_bytes}")
    if zlib.crc32(payload) != header.crc32:
        raise RunFileError("its checksum does not match")
    arrays, at = [], 0
    for _, shape in header.arrays:
        size = int(np.prod(shape))
        arrays.append(np.frombuffer(payload, np.uint8, size, at).reshape(shape))
        at += size
    return arrays
