"""Length-prefixed frames over pipes: a JSON header and an opaque blob.

Everything that crosses the process boundary is plain data: kernel bytes one way,
object bytes the other, metadata as JSON. Nothing is pickled.

Both ends of a long-lived pipe pair (driver <-> zygote) read and write without blocking
(`FrameReader`, `OutBuffer`): if either side blocked writing a large frame while the other
blocked writing its own, both pipes would fill and neither would ever read again.
"""
from __future__ import annotations

import json
import os
import struct

_HEAD = struct.Struct("<II")
LOG_LIMIT = 1 << 16  # bytes of what a job printed (LLVM's remarks among them) kept for its log


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


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class FrameReader:
    """Frames from a byte stream that arrives in arbitrary pieces."""

    def __init__(self):
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[dict, bytes]]:
        """Add bytes; return every frame now complete, in order."""
        self._buf += data
        frames = []
        while len(self._buf) >= _HEAD.size:
            n_meta, n_blob = _HEAD.unpack_from(self._buf)
            end = _HEAD.size + n_meta + n_blob
            if len(self._buf) < end:
                break
            frames.append(decode(bytes(self._buf[:end])))
            del self._buf[:end]
        return frames


class OutBuffer:
    """Bytes waiting for a non-blocking file descriptor to accept them."""

    def __init__(self, fd: int):
        self.fd = fd
        os.set_blocking(fd, False)
        self._chunks: list[memoryview] = []

    def __bool__(self) -> bool:
        return bool(self._chunks)

    def push(self, data: bytes) -> None:
        self._chunks.append(memoryview(data))

    def flush(self) -> None:
        """Write as much as the pipe takes now. Raises OSError (EPIPE) if the reader is gone."""
        while self._chunks:
            try:
                n = os.write(self.fd, self._chunks[0])
            except BlockingIOError:
                return
            rest = self._chunks[0][n:]
            if rest:
                self._chunks[0] = rest
            else:
                self._chunks.pop(0)
