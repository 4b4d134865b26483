"""ONNX element types as Kiln dtypes, with errors that name where an unsupported one appears."""
from __future__ import annotations

from .dtypes import DTYPES, from_onnx, onnx_type_name
from .graph import Node, UnsupportedError


def onnx_to_dtype(elem_type: int, where: Node | str) -> str:
    d = from_onnx(elem_type)
    if d is None:
        at = where.describe() if isinstance(where, Node) else where
        raise UnsupportedError(f"{at}: element type {onnx_type_name(elem_type)} is not supported "
                               f"({', '.join(DTYPES)})")
    return d.name
