"""Reductions and windows: ReduceSum/Mean/Max, global pools, Softmax, LayerNormalization,
MaxPool, AveragePool. Each is an anchor: its own loop nest over the points it produces,
inner loops over what it reduces, the rest of its group as an epilogue."""
from __future__ import annotations

import numpy as np

from ..attrs import attr_or_input, normalize_axis
from ..graph import ShapeError, TensorType, UnsupportedError
from ..lower.reduce import lower_layernorm, lower_pool, lower_reduce, lower_softmax
from .conv_gemm import resolve_window
from .registry import REDUCTION, OpDef, register


def _reduce(g, node, p):
    x = g.types[node.inputs[0]]
    rank = len(x.shape)
    axes = attr_or_input(g, node, "axes", 1)
    if not axes:
        axes = [] if node.attrs.get("noop_with_empty_axes", 0) else list(range(rank))
    axes = sorted({normalize_axis(a, rank, node) for a in axes})
    keep = node.attrs.get("keepdims", 1)
    p["axes"], p["keepdims"] = axes, keep
    shape = tuple(1 if i in axes else d for i, d in enumerate(x.shape)) if keep else \
        tuple(d for i, d in enumerate(x.shape) if i not in axes)
    return TensorType(shape, x.dtype)


def _global_pool(g, node, p):
    x = g.types[node.inputs[0]]
    p["axes"], p["keepdims"] = list(range(2, len(x.shape))), 1
    return TensorType(x.shape[:2] + (1,) * (len(x.shape) - 2), x.dtype)


def _reduction(name, kind, infer, fold=None):
    def evaluate(a, values, g, node):
        if not a["axes"]:
            return [values[0]]
        return [fold(values[0], axis=tuple(a["axes"]), keepdims=bool(a["keepdims"]))]
    return OpDef(name, REDUCTION, infer, evaluate if fold else None,
                 anchor=lambda b, node, store, out: lower_reduce(b, node, store, kind))


def _softmax(g, node, p):
    x = g.types[node.inputs[0]]
    rank = len(x.shape)
    if g.opset < 13:  # old semantics: coerce to 2-D at axis, normalize over everything after it
        axis = normalize_axis(node.attrs.get("axis", 1), rank, node)
        p["axes"] = list(range(axis, rank))
    else:
        p["axes"] = [normalize_axis(node.attrs.get("axis", -1), rank, node)]
    return x


def _layernorm(g, node, p):
    x = g.types[node.inputs[0]]
    rank = len(x.shape)
    axis = normalize_axis(node.attrs.get("axis", -1), rank, node)
    p["axes"] = list(range(axis, rank))
    stats = TensorType(x.shape[:axis] + (1,) * (rank - axis), "float32")  # Mean, InvStdDev
    return [x] + [stats] * (len(node.outputs) - 1)


def _pool(g, node, p):
    x = g.types[node.inputs[0]]
    spatial = x.shape[2:]
    kernel = node.attrs["kernel_shape"]
    if len(node.outputs) > 1 and any(node.outputs[1:]):
        raise UnsupportedError(f"{node.describe()}: the Indices output of MaxPool is not supported")
    strides, dil, pads = resolve_window(node, p, spatial, kernel)
    n, ceil_mode = len(spatial), node.attrs.get("ceil_mode", 0)
    out = []
    for i in range(n):
        span = spatial[i] + pads[i] + pads[i + n] - ((kernel[i] - 1) * dil[i] + 1)
        o = (-(-span // strides[i]) if ceil_mode else span // strides[i]) + 1
        if ceil_mode and (o - 1) * strides[i] >= spatial[i] + pads[i]:
            o -= 1  # the last window must start inside the input or its left padding
        out.append(o)
    if min(out) <= 0:
        raise ShapeError(f"{node.describe()}: window {kernel} does not fit input {x}")
    return TensorType(x.shape[:2] + tuple(out), x.dtype)


register(
    _reduction("ReduceSum", "sum", _reduce, np.sum), _reduction("ReduceMean", "mean", _reduce, np.mean),
    _reduction("ReduceMax", "max", _reduce, np.max),
    _reduction("GlobalAveragePool", "mean", _global_pool), _reduction("GlobalMaxPool", "max", _global_pool),
    OpDef("Softmax", REDUCTION, _softmax, anchor=lambda b, node, store, out: lower_softmax(b, node, store, out)),
    OpDef("LayerNormalization", REDUCTION, _layernorm,
          anchor=lambda b, node, store, out: lower_layernorm(b, node, store)),
    OpDef("MaxPool", REDUCTION, _pool, anchor=lambda b, node, store, out: lower_pool(b, node, store, True)),
    OpDef("AveragePool", REDUCTION, _pool, anchor=lambda b, node, store, out: lower_pool(b, node, store, False)),
)
