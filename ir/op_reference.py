"""numpy evaluation of the ops constant folding may meet.

Used at compile time only, on constants: the Shape/Gather/Concat chains exporters write,
weight transposes, small arithmetic. Heavy ops (Conv, pooling) are not folded; a node whose
op is missing here simply stays in the graph and is compiled.
"""
from __future__ import annotations

import math

import numpy as np

from .graph import Graph, Node, as_kiln_array

_UNARY = {
    "Relu": lambda x, a: np.maximum(x, 0), "Neg": lambda x, a: -x, "Abs": lambda x, a: np.abs(x),
    "Exp": lambda x, a: np.exp(x), "Log": lambda x, a: np.log(x), "Sqrt": lambda x, a: np.sqrt(x),
    "Reciprocal": lambda x, a: 1 / x, "Tanh": lambda x, a: np.tanh(x), "Sigmoid": lambda x, a: 1 / (1 + np.exp(-x)),
    "Not": lambda x, a: np.logical_not(x), "Identity": lambda x, a: x,
    "Erf": lambda x, a: np.vectorize(math.erf, otypes=[np.float32])(x) if x.size else x,
    "LeakyRelu": lambda x, a: np.where(x < 0, x * a.get("alpha", 0.01), x),
    "Clip": lambda x, a: np.clip(x, a["min"], a["max"]),
    "HardSigmoid": lambda x, a: np.clip(x * a.get("alpha", 0.2) + a.get("beta", 0.5), 0, 1),
    "HardSwish": lambda x, a: x * np.clip(x / 6 + 0.5, 0, 1),
}
_BINARY = {
    "Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Pow": np.power,
    "Equal": np.equal, "Less": np.less, "Greater": np.greater,
}


def _div(a, b, attrs):
    if np.issubdtype(a.dtype, np.integer):
        return np.trunc(a / b).astype(a.dtype)  # ONNX integer Div truncates toward zero
    return a / b


def _mod(a, b, attrs):
    return np.fmod(a, b) if attrs.get("fmod", 0) else np.mod(a, b)


def _slice(x, begin, step, shape):
    for axis, (b, s, n) in enumerate(zip(begin, step, shape)):
        x = np.take(x, b + s * np.arange(n), axis=axis)
    return x


def evaluate(g: Graph, node: Node, values: list):
    """Outputs of `node` given its input arrays, or None if Kiln does not fold this op.
    Reads the node's attributes with inference's canonical parameters over them."""
    a, op = {**node.attrs, **g.params.get(node.key, {})}, node.op
    if op in _UNARY:
        return [_UNARY[op](values[0], a)]
    if op in _BINARY:
        return [_BINARY[op](values[0], values[1])]
    if op == "Div":
        return [_div(values[0], values[1], a)]
    if op == "Mod":
        return [_mod(values[0], values[1], a)]
    if op in ("Max", "Min"):
        fn = np.maximum if op == "Max" else np.minimum
        out = values[0]
        for v in values[1:]:
            out = fn(out, v)
        return [out]
    if op == "Where":
        return [np.where(*values)]
    if op == "Cast":
        return [values[0].astype(g.types[node.outputs[0]].dtype)]
    if op == "Shape":
        shape = g.types[node.inputs[0]].shape
        return [np.array(shape[slice(a.get("start", 0), a.get("end", len(shape)))], dtype=np.int64)]
    if op in ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Expand"):
        return [np.broadcast_to(values[0].reshape(g.types[node.inputs[0]].shape),
                                g.types[node.outputs[0]].shape) if op == "Expand"
                else values[0].reshape(g.types[node.outputs[0]].shape)]
    if op == "Transpose":
        return [np.transpose(values[0], a["perm"])]
    if op == "Concat":
        return [np.concatenate([v for v in values if v is not None], axis=a["axis"])]
    if op == "Gather":
        idx = values[1]
        dim = values[0].shape[a["axis"]]
        return [np.take(values[0], np.where(idx < 0, idx + dim, idx), axis=a["axis"])]
    if op == "Slice":
        return [_slice(values[0], a["begin"], a["step"], g.types[node.outputs[0]].shape)]
    if op == "Split":
        bounds = np.cumsum(a["sizes"])[:-1]
        return list(np.split(values[0], bounds, axis=a["axis"]))
    if op in ("ReduceSum", "ReduceMean", "ReduceMax"):
        fn = {"ReduceSum": np.sum, "ReduceMean": np.mean, "ReduceMax": np.max}[op]
        if not a["axes"]:
            return [values[0]]
        return [fn(values[0], axis=tuple(a["axes"]), keepdims=bool(a["keepdims"]))]
    if op == "Range":
        start, limit, delta = (v.reshape(()) for v in values)
        return [np.arange(start, limit, delta).astype(start.dtype)]
    if op == "ConstantOfShape":
        value = a.get("value", np.zeros(1, np.float32))
        return [np.full([int(d) for d in values[0].reshape(-1)], value.reshape(-1)[0], dtype=value.dtype)]
    if op == "Constant":
        return [a["value"]]
    return None


def fold(g: Graph, node: Node, values: list) -> list[np.ndarray] | None:
    out = evaluate(g, node, values)
    return None if out is None else [as_kiln_array(np.asarray(v)) for v in out]
