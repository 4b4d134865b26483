"""Ops evaluated at compile time only: Shape, Size, Constant, Range, ConstantOfShape. Their
outputs are always constants (a Shape needs only its input's shape); an input that is not
known at compile time is an error naming the node."""
from __future__ import annotations

import numpy as np

from ..attrs import NotConstant
from ..graph import TensorType, as_kiln_array
from ..validate import check_tensor_size
from .registry import OPAQUE, OpDef, register


def _shape(g, node, p):
    x = g.types[node.inputs[0]]
    rank = len(x.shape)
    start = node.attrs.get("start", 0)
    end = node.attrs.get("end", rank)
    return TensorType((len(range(rank)[slice(start, end)]),), "int64")


def _shape_value(a, values, g, node):
    shape = g.types[node.inputs[0]].shape
    return [np.array(shape[slice(a.get("start", 0), a.get("end", len(shape)))], dtype=np.int64)]


def _size(g, node, p):
    return TensorType((), "int64")


def _size_value(a, values, g, node):
    return [np.array(g.types[node.inputs[0]].size, dtype=np.int64)]


def _range_value(a, values, g, node):
    start, limit, delta = (v.reshape(()) for v in values)
    return [np.arange(start, limit, delta).astype(start.dtype)]


def _constant_of_shape_value(a, values, g, node):
    value = a.get("value", np.zeros(1, np.float32))
    shape = [int(d) for d in values[0].reshape(-1)]
    check_tensor_size(node.outputs[0], shape, value.dtype.itemsize)  # before np.full allocates it
    return [np.full(shape, value.reshape(-1)[0], dtype=value.dtype)]


def _from_value(evaluate):
    """The type of a compile-time-only op is the type of its value."""
    def infer(g, node, p):
        missing = [i for i in node.inputs if i and i not in g.constants]
        if missing:
            raise NotConstant(f"{node.describe()}: inputs must be known at compile time", missing)
        values = evaluate(node.attrs, [g.constants.get(i) if i else None for i in node.inputs], g, node)
        return [TensorType(tuple(v.shape), str(as_kiln_array(np.asarray(v)).dtype)) for v in values]
    return infer


def _constant_value(a, values, g, node):
    return [a["value"]]


CONSTANT = "Constant"  # the frontend turns these into graph constants directly
register(
    OpDef("Shape", OPAQUE, _shape, _shape_value, compile_time=True, shape_only=True),
    OpDef("Size", OPAQUE, _size, _size_value, compile_time=True, shape_only=True),
    OpDef(CONSTANT, OPAQUE, _from_value(_constant_value), _constant_value, compile_time=True),
    OpDef("Range", OPAQUE, _from_value(_range_value), _range_value, compile_time=True),
    OpDef("ConstantOfShape", OPAQUE, _from_value(_constant_of_shape_value), _constant_of_shape_value,
          compile_time=True),
)
