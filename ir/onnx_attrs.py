"""ONNX node attributes as Kiln keeps them, for the frontend and for function bodies."""
from __future__ import annotations

import numpy as np

from .graph import Node, UnsupportedError, as_kiln_array


def attr_value(attr):
    """A NodeProto attribute as Kiln keeps it: numpy arrays, str, int, float and lists."""
    from onnx import helper, numpy_helper

    if attr.type == attr.TENSOR:
        return as_kiln_array(numpy_helper.to_array(attr.t))
    if attr.type in (attr.GRAPH, attr.GRAPHS):  # (the frontend reads a GRAPH itself: ir.graph.Subgraph)
        raise UnsupportedError(f"attribute {attr.name} holds a list of subgraphs, which Kiln does not support")
    value = helper.get_attribute_value(attr)
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, list) and value and isinstance(value[0], bytes):
        return [v.decode() for v in value]
    return value


def constant_value(node: Node) -> np.ndarray:
    a = node.attrs
    if "value" in a:
        return a["value"]
    for key, dtype in (("value_float", np.float32), ("value_floats", np.float32),
                       ("value_int", np.int64), ("value_ints", np.int64)):
        if key in a:
            return np.array(a[key], dtype=dtype)
    raise UnsupportedError(f"{node.describe()}: Constant without a value/value_float(s)/value_int(s) attribute")
