"""Reading an ONNX model without holding its weights twice.

protobuf's Python messages copy a tensor's raw_data on every access, so decoding a model
whole keeps its weights in the message and again in the arrays made from it (a 425 MB
GPT-2 peaked at 1.6 GB). Here the main graph's initializers are read from the file straight
into buffers of their own, one per tensor, and protobuf decodes only what remains: nodes,
names, shapes and small tensors. External data of those initializers is read the same way.

The wire format is walked with the file, never loaded whole: a field is a varint tag (number
<< 3 | wire type) followed by a varint, 8 or 4 bytes, or (wire type 2) a varint length and
that many bytes.
"""
from __future__ import annotations

import os

import numpy as np

from . import external_data
from .errors import KilnError

_MODEL_GRAPH, _GRAPH_INITIALIZER = 7, 5
_TENSOR_NAME, _TENSOR_RAW_DATA = 8, 9
# A payload this large gets its own buffer; smaller ones stay in the message (cheap to copy).
OWN_BUFFER_BYTES = 1 << 12


class _Reader:
    """A file read field by field, counting its position (tell() would be a syscall each)."""

    def __init__(self, f, size: int, where: str):
        self.f, self.size, self.where, self.pos = f, size, where, 0

    def corrupt(self, why: str) -> KilnError:
        return KilnError(f"{self.where} is not a valid ONNX model (truncated or corrupt?): {why} at byte {self.pos}")

    def read(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise self.corrupt(f"{n} bytes expected, {len(data)} left")
        self.pos += n
        return data

    def read_buffer(self, n: int) -> np.ndarray:
        buf = np.empty(n, np.uint8)
        got = self.f.readinto(memoryview(buf))
        if got != n:
            raise self.corrupt(f"a payload of {n} bytes, {got or 0} left")
        self.pos += n
        return buf

    def varint(self) -> tuple[int, bytes]:
        raw, value, shift = bytearray(), 0, 0
        while True:
            b = self.f.read(1)
            if not b:
                raise self.corrupt("the file ends inside a varint")
            self.pos += 1
            raw += b
            value |= (b[0] & 0x7F) << shift
            if not b[0] & 0x80:
                return value, bytes(raw)
            shift += 7
            if shift > 63:
                raise self.corrupt("a varint longer than 10 bytes")

    def field(self) -> tuple[int, int, bytes, int]:
        """(number, wire type, the bytes before its body, the body's length). A varint's
        value counts as part of the head."""
        tag, head = self.varint()
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            return number, wire, head + self.varint()[1], 0
        if wire == 1:
            return number, wire, head, 8
        if wire == 5:
            return number, wire, head, 4
        if wire == 2:
            n, raw = self.varint()
            if self.pos + n > self.size:
                raise self.corrupt(f"a field of {n} bytes where {self.size - self.pos} are left")
            return number, wire, head + raw, n
        raise self.corrupt(f"wire type {wire}")

    def fields(self, length: int):
        """The fields of a message `length` bytes long, from here."""
        end = self.pos + length
        while self.pos < end:
            yield self.field()
        if self.pos != end:
            raise self.corrupt("a field runs past the end of its message")


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _message_field(number: int, body: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(body)) + body


def _tensor(r: _Reader, length: int, payloads: dict) -> bytes:
    """A TensorProto without its raw_data when that is large (it goes to payloads)."""
    out, name, payload = bytearray(), "", None
    for number, wire, head, n in r.fields(length):
        if number == _TENSOR_RAW_DATA and wire == 2 and n >= OWN_BUFFER_BYTES:
            payload = r.read_buffer(n)
            continue
        body = r.read(n)
        if number == _TENSOR_NAME and wire == 2:
            name = body.decode("utf-8", "replace")
        out += head + body
    if payload is not None:
        if name in payloads:
            raise KilnError(f"{r.where}: initializer '{name}' is defined twice")
        payloads[name] = payload
    return bytes(out)


def _graph(r: _Reader, length: int, payloads: dict) -> bytes:
    out = bytearray()
    for number, wire, head, n in r.fields(length):
        if number == _GRAPH_INITIALIZER and wire == 2:
            out += _message_field(number, _tensor(r, n, payloads))
        else:
            out += head + r.read(n)
    return bytes(out)


def split_weights(f, size: int, where: str) -> tuple[bytes, dict]:
    """(the model's `size` bytes, read from the file object f, without the main graph's large
    initializer payloads; {initializer name: its raw bytes as a uint8 array})."""
    r = _Reader(f, size, where)
    out, payloads = bytearray(), {}
    for number, wire, head, n in r.fields(size):
        if number == _MODEL_GRAPH and wire == 2:
            out += _message_field(number, _graph(r, n, payloads))
        else:
            out += head + r.read(n)
    return bytes(out), payloads


def read_external(tensor, model_dir: str, where: str) -> np.ndarray:
    """One tensor's external bytes (its location, offset and length) as a uint8 array."""
    entries = {e.key: e.value for e in tensor.external_data}
    location = entries.get("location", "")
    path = external_data.resolve(model_dir, tensor.name, location)
    try:
        offset = int(entries.get("offset", 0))
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            length = int(entries["length"]) if "length" in entries else size - offset
            if offset < 0 or length < 0 or offset + length > size:
                raise ValueError(f"bytes {offset}..{offset + length} lie outside the file's {size}")
            f.seek(offset)
            buf = np.empty(length, np.uint8)
            if f.readinto(memoryview(buf)) != length:
                raise ValueError("the file ended early")
    except (OSError, ValueError) as e:
        raise KilnError(f"{where}: cannot read tensor '{tensor.name}' from external file '{location}': {e}") from None
    return buf
