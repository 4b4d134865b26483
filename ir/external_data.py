"""External data: tensors whose bytes live in files beside the .onnx file.

Every byte a model reads identifies it, so the whole-model cache key hashes these files too,
and the frontend resolves them against the model's own folder (never the current
directory), refusing locations that leave it.

`external_locations` reads the protobuf wire format directly: the cache lookup of an
unchanged model must not pay for importing onnx.
"""
from __future__ import annotations

import os

from .errors import KilnError

# Field numbers in onnx.proto3 on the paths that can reach a TensorProto.
_MODEL_GRAPH, _MODEL_FUNCTIONS = 7, 25
_GRAPH_NODE, _GRAPH_INITIALIZER, _GRAPH_SPARSE_INITIALIZER = 1, 5, 15
_FUNCTION_NODE = 7
_NODE_ATTRIBUTE = 5
_ATTR_T, _ATTR_G, _ATTR_TENSORS, _ATTR_GRAPHS, _ATTR_SPARSE, _ATTR_SPARSES = 5, 6, 10, 11, 22, 23
_SPARSE_VALUES, _SPARSE_INDICES = 1, 2
_TENSOR_NAME, _TENSOR_EXTERNAL_DATA = 8, 13
_ENTRY_KEY, _ENTRY_VALUE = 1, 2


def _varint(buf, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def _fields(buf):
    """(field number, value) of every field; length-delimited values as memoryviews."""
    pos, end = 0, len(buf)
    while pos < end:
        tag, pos = _varint(buf, pos)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = None, pos + 8
        elif wire == 2:
            n, pos = _varint(buf, pos)
            value, pos = buf[pos:pos + n], pos + n
        elif wire == 5:
            value, pos = None, pos + 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
        if pos > end:
            raise ValueError("field runs past the end of its message")
        yield number, value


def _tensor_locations(buf, out: list) -> None:
    name = ""
    for number, value in _fields(buf):
        if number == _TENSOR_NAME:
            name = bytes(value).decode("utf-8", "replace")
        elif number == _TENSOR_EXTERNAL_DATA:
            entry = dict(_fields(value))
            if bytes(entry.get(_ENTRY_KEY, b"")) == b"location":
                out.append((name, bytes(entry.get(_ENTRY_VALUE, b"")).decode("utf-8", "replace")))


def _graph_locations(buf, out: list) -> None:
    for number, value in _fields(buf):
        if number == _GRAPH_INITIALIZER:
            _tensor_locations(value, out)
        elif number == _GRAPH_SPARSE_INITIALIZER:
            _sparse_locations(value, out)
        elif number == _GRAPH_NODE:
            _node_locations(value, out)


def _sparse_locations(buf, out: list) -> None:
    for number, value in _fields(buf):
        if number in (_SPARSE_VALUES, _SPARSE_INDICES):
            _tensor_locations(value, out)


def _node_locations(buf, out: list) -> None:
    for number, value in _fields(buf):
        if number != _NODE_ATTRIBUTE:
            continue
        for anum, avalue in _fields(value):
            if anum in (_ATTR_T, _ATTR_TENSORS):
                _tensor_locations(avalue, out)
            elif anum in (_ATTR_G, _ATTR_GRAPHS):
                _graph_locations(avalue, out)
            elif anum in (_ATTR_SPARSE, _ATTR_SPARSES):
                _sparse_locations(avalue, out)


def external_locations(model_bytes) -> list[tuple[str, str]]:
    """(tensor name, location) of every tensor stored outside the model file, in file order.
    Raises ValueError if the bytes are not a well-formed protobuf message."""
    buf = memoryview(model_bytes)
    out: list = []
    for number, value in _fields(buf):
        if number == _MODEL_GRAPH:
            _graph_locations(value, out)
        elif number == _MODEL_FUNCTIONS:
            for fnum, fvalue in _fields(value):
                if fnum == _FUNCTION_NODE:
                    _node_locations(fvalue, out)
    return out


def resolve(model_dir: str, tensor: str, location: str) -> str:
    """The file holding `tensor`'s data: `location` taken relative to the model's folder.
    A location that is absolute or leaves the folder, or a file that is missing or not a
    regular file, is an error naming the tensor."""
    where = f"tensor '{tensor}' keeps its data in external file '{location}'"
    if not location or os.path.isabs(location) or os.path.normpath(location).startswith(os.pardir):
        raise KilnError(f"{where}, which is not a path inside the model's folder")
    root = os.path.realpath(model_dir)
    path = os.path.realpath(os.path.join(root, location))
    if os.path.commonpath([root, path]) != root:
        raise KilnError(f"{where}, which leads outside the model's folder '{model_dir}'")
    if not os.path.isfile(path):
        raise KilnError(f"{where}, which does not exist in the model's folder '{model_dir}'")
    return path
