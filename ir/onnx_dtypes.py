"""ONNX element types Kiln accepts, and how it stores them."""
from __future__ import annotations

from .graph import Node, UnsupportedError

# ONNX TensorProto enum -> Kiln dtype. Integer types are widened to int64 (shapes, indices),
# double narrowed to float32: Kiln computes in float32 end to end.
_ONNX_TO_KILN = {1: "float32", 11: "float32", 6: "int64", 7: "int64", 9: "bool"}
_NAMES = {1: "FLOAT", 2: "UINT8", 3: "INT8", 5: "INT16", 6: "INT32", 7: "INT64", 9: "BOOL", 10: "FLOAT16",
          11: "DOUBLE", 16: "BFLOAT16"}


def onnx_to_dtype(elem_type: int, where: Node | str) -> str:
    if elem_type not in _ONNX_TO_KILN:
        name = _NAMES.get(elem_type, str(elem_type))
        at = where.describe() if isinstance(where, Node) else where
        raise UnsupportedError(f"{at}: element type {name} is not supported (float32, int64, bool)")
    return _ONNX_TO_KILN[elem_type]
