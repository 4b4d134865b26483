"""A Gather of one element, at a constant index, of a tensor of sizes computed at run time.

A Range over run-time sizes (`arange(seq)`) is a tensor the module computes, not a symbolic
value: its elements are data. A model that takes one of them back as a size (Funnel's
relative positions: the first and last of `arange(seq)`, and of its pooled `[1:-1:2]`,
start and end the next Range) left Kiln a Range whose limits it could not bound. Yet each
element is a known expression of the sizes: element i of Range(start, limit, delta) is
start + i * delta, counted from its length where i is negative; a Slice, a Concat or a Cast
on the way moves it without changing it. Such a Gather becomes that element as a symbolic
value (then a Cast to the Gather's type), so that what is computed from it stays a size.
"""
from __future__ import annotations

import numpy as np

from ..dtypes import DTYPES
from ..graph import Node
from ..symbolic import Dim, at_most, dim_from_json, greatest, least
from .compile_time import RANGE, symbolic_value_node
from .elementwise import CAST
from .shape import CONCAT, SLICE

FLOAT32_WHOLE = 1 << 24  # (whole numbers up to this are exact in float32: a Cast keeps them)


def gathered_size(g, node) -> list | None:
    """The nodes type inference puts in a Gather's place where it takes such an element (see
    the module's docstring); None for any other Gather."""
    from .value_ranges import producers_of
    if len(node.inputs) < 2 or node.inputs[1] not in g.constants or node.attrs.get("axis", 0) not in (0, -1):
        return None
    index = np.asarray(g.constants[node.inputs[1]])
    data = node.inputs[0]
    if index.size != 1 or data in g.constants or data in g.symbolic_values or len(g.types[data].shape) != 1:
        return None
    value = _element(g, producers_of(g), data, int(index.reshape(-1)[0]), set())
    if value is None:
        return None
    element = f"{node.outputs[0]}/size"
    nodes = [symbolic_value_node(element, np.array([value], dtype=object).reshape(index.shape), "int64")]
    dtype = g.types[data].dtype
    if dtype != "int64":
        nodes.append(Node(CAST, [element], list(node.outputs), {"to": DTYPES[dtype].onnx}, f"{node.name}/cast"))
    else:
        nodes[0].outputs = list(node.outputs)
    return nodes


def _element(g, producers: dict, name: str, i, seen: set):
    """Element i (an int or Dim; a negative int counts from the end) of 1-D tensor `name` as
    an int or Dim, where every op from a Range over run-time sizes to it moves whole
    numbers; else None."""
    if name in seen:
        return None
    seen.add(name)
    length = g.types[name].shape[0]
    if not isinstance(i, Dim) and i < 0:
        i = length + i
    if not (at_most(0, i) and at_most(i + 1, length)):
        return None  # (an index past the end at some size: the Gather's own error)
    if name in g.constants:
        if isinstance(i, Dim):
            return None
        v = np.asarray(g.constants[name]).reshape(-1)[int(i)]
        return int(v) if float(v).is_integer() else None
    node = producers.get(name)
    if node is None:
        return None
    if node.op == RANGE and g.params.get(node.key, {}).get("at_run_time"):
        p = g.params[node.key]
        return dim_from_json(p["start"], g.symbols) + i * p["delta"]
    if node.op == CAST:
        v = _element(g, producers, node.inputs[0], i, seen)
        whole = v is not None and max(abs(least(v)), abs(greatest(v))) < FLOAT32_WHOLE
        return v if whole and g.types[node.outputs[0]].dtype in ("int64", "int32", "float32", "float64") else None
    if node.op == SLICE:
        p = g.params.get(node.key, {})
        begin, step = p.get("begin", [None])[0], p.get("step", [None])[0]
        return None if begin is None or step is None else _element(g, producers, node.inputs[0], begin + i * step, seen)
    if node.op == CONCAT and node.attrs.get("axis", 0) in (0, -1):
        for part in node.inputs:  # (the part holding element i at every size, if one does)
            size = g.types[part].shape[0]
            if at_most(i + 1, size):
                return _element(g, producers, part, i, seen)
            if not at_most(size, i):
                return None
            i = i - size
    return None
