"""Length-prefixed frames over pipes: a JSON header and an opaque blob.

Everything that crosses the process boundary is plain data: kernel bytes one way,
object bytes the other, metadata as JSON. Nothing is pickled.
"""
from __future__ import annotations

import json
import os
import struct

_HEAD = struct.Struct("<II")


def encode(header: dict, blob: bytes = b"") -> bytes:
    meta = json.dumps(header, separators=(",", ":")).encode()
    return _HEAD.pack(len(meta), len(blob)) + meta + blob


def decode(frame: bytes) -> tuple[dict, bytes]:
    """Decode one complete frame; raises ValueError if it is short or malformed."""
    if len(frame) < _HEAD.size:
        raise ValueError("short frame")
    n_meta, n_blob = _HEAD.unpack_from(frame)
    if len(frame) != _HEAD.size + n_meta + n_blob:
        raise ValueError(f"frame of {len(frame)} bytes, header says {_HEAD.size + n_meta + n_blob}")
    header = json.loads(frame[_HEAD.size:_HEAD.size + n_meta])
    return header, frame[_HEAD.size + n_meta:]


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, n - got)
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_frame(fd: int) -> tuple[dict, bytes] | None:
    """Blocking read of one frame from a file descriptor; None at end of stream."""
    head = _read_exact(fd, _HEAD.size)
    if head is None:
        return None
    n_meta, n_blob = _HEAD.unpack(head)
    rest = _read_exact(fd, n_meta + n_blob)
    if rest is None:
        return None
    return decode(head + rest)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
