"""Reductions and windows: ReduceSum/Mean/Max, global pools, Softmax, LayerNormalization,
MaxPool, AveragePool, LpPool. Each is an anchor: its own loop nest over the points it produces,
inner loops over what it reduces, the rest of its group as an epilogue. (LRN, a window
over channels, is read by its consumers instead.)"""
from __future__ import annotations

import numpy as np

from ..attrs import attr_or_input, normalize_axis
from ..loop import Const, add, call, cmp, const, fbin, fold_balanced, mul, select, sub
from ..dtypes import is_float
from ..graph import Node, ShapeError, TensorType, UnsupportedError
from ..symbolic import at_most, floor_div, is_symbolic, least
from ..lower.elementwise import as_index, iclamp
from ..lower.pool import lower_pool
from ..lower.reduce import (lower_hardmax, lower_layernorm, lower_lp_normalize, lower_normalize,
                            lower_reduce, lower_softmax)
from .conv_gemm import resolve_window
from .registry import INJECTIVE, REDUCTION, OpDef, one_output, register

REDUCE_SUM, REDUCE_MEAN = "ReduceSum", "ReduceMean"  # (other ops are built from them: einsum.py, elementwise.py)

GLOBAL_AVERAGE_POOL, MAX_POOL, AVERAGE_POOL = "GlobalAveragePool", "MaxPool", "AveragePool"
MAX_POOL_INDICES = "kiln.MaxPoolIndices"
REDUCE_MAX, REDUCE_MIN = "ReduceMax", "ReduceMin"
SOFTMAX, LAYER_NORMALIZATION, RMS_NORMALIZATION = "Softmax", "LayerNormalization", "RMSNormalization"


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


def _empty_identity(kind: str, dt: np.dtype):
    """What max and min of nothing are (ONNX: the identity of the reduction)."""
    if dt == np.bool_:
        return kind == "min"
    if np.issubdtype(dt, np.integer):
        info = np.iinfo(dt)
        return info.min if kind == "max" else info.max
    return -np.inf if kind == "max" else np.inf


def _reduction(name, kind, infer, fold=None):
    def evaluate(a, values, g, node):
        if not a["axes"]:
            return [values[0]]
        extra = {"initial": _empty_identity(kind, values[0].dtype)} if kind in ("max", "min") else {}
        return [fold(values[0], axis=tuple(a["axes"]), keepdims=bool(a["keepdims"]), **extra)]
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


def split_max_pool(g, node: Node) -> list[Node] | None:
    """A MaxPool asked for its Indices as the pool and a kiln.MaxPoolIndices node beside it
    (ir/ops/pool_indices.py); None where it is not asked for them."""
    if len(node.outputs) < 2 or not node.outputs[1]:
        return None
    values = node.outputs[0] or f"{node.key}/values"
    return [Node(MAX_POOL, [node.inputs[0]], [values], dict(node.attrs), node.name, node.guard),
            Node(MAX_POOL_INDICES, [node.inputs[0]], [node.outputs[1]], dict(node.attrs), f"{node.name}/indices",
                 node.guard)]


def pool_output_type(g, node, p):
    """A pool's output type (its window resolved into `p`)."""
    x = g.types[node.inputs[0]]
    spatial = x.shape[2:]
    kernel = node.attrs["kernel_shape"]
    strides, dil, pads = resolve_window(node, p, spatial, kernel)
    n, ceil_mode = len(spatial), node.attrs.get("ceil_mode", 0)
    out = []
    for i in range(n):
        span = spatial[i] + pads[i] + pads[i + n] - ((kernel[i] - 1) * dil[i] + 1)
        o = floor_div(span + (strides[i] - 1 if ceil_mode else 0), strides[i]) + 1
        # The last window must start inside the input or its left padding. Over run-time
        # sizes the bounds decide it (SqueezeNet's 3x3 stride-2 pools) or the pool is refused.
        last, limit = (o - 1) * strides[i], spatial[i] + pads[i]
        if ceil_mode and (is_symbolic(last) or is_symbolic(limit)):
            if not at_most(last, limit - 1):
                if not at_most(limit, last):
                    raise TypeError(f"whether the last window along axis {i + 2} starts at {last}, inside the input "
                                    f"and its padding ({limit}), is known only at run time")
                o -= 1
        elif ceil_mode and last >= limit:
            o -= 1
        out.append(o)
    if min(least(o) for o in out) <= 0:
        raise ShapeError(f"{node.describe()}: window {kernel} does not fit input {x}")
    return TensorType(x.shape[:2] + tuple(out), x.dtype)


def _float_reduce(g, node, p):
    t = _reduce(g, node, p)
    if not is_float(t.dtype):
        raise UnsupportedError(f"{node.describe()}: {node.op} of {t.dtype} is not supported (float types only)")
    return t


def _logsumexp(x, axis, keepdims):
    top = np.max(x, axis=axis, keepdims=True, initial=-np.inf)
    top = np.where(np.isfinite(top), top, 0)
    out = np.log(np.sum(np.exp(x - top), axis=axis, keepdims=True)) + top
    return out if keepdims else np.squeeze(out, axis=axis)


register(
    _reduction(REDUCE_SUM, "sum", _reduce, np.sum), _reduction(REDUCE_MEAN, "mean", _reduce, np.mean),
    _reduction(REDUCE_MAX, "max", _reduce, np.max), _reduction(REDUCE_MIN, "min", _reduce, np.min),
    _reduction("ReduceProd", "prod", _reduce, np.prod),
    _reduction("ReduceL1", "l1", _reduce, lambda x, **k: np.sum(np.abs(x), **k)),
    _reduction("ReduceL2", "l2", _float_reduce, lambda x, **k: np.sqrt(np.sum(x * x, **k))),
    _reduction("ReduceSumSquare", "sumsquare", _reduce, lambda x, **k: np.sum(x * x, **k)),
    _reduction("ReduceLogSum", "logsum", _float_reduce, lambda x, **k: np.log(np.sum(x, **k))),
    _reduction("ReduceLogSumExp", "logsumexp", _float_reduce, _logsumexp),
    _reduction(GLOBAL_AVERAGE_POOL, "mean", _global_pool), _reduction("GlobalMaxPool", "max", _global_pool),
    OpDef(SOFTMAX, REDUCTION, _softmax, anchor=lambda b, node, store, out: lower_softmax(b, node, store, out)),
    OpDef(LAYER_NORMALIZATION, REDUCTION, _layernorm,
          anchor=lambda b, node, store, out: lower_layernorm(b, node, store)),
    OpDef(MAX_POOL, REDUCTION, pool_output_type, anchor=lambda b, node, store, out: lower_pool(b, node, store, True),
          expand=split_max_pool),
    OpDef(AVERAGE_POOL, REDUCTION, pool_output_type,
          anchor=lambda b, node, store, out: lower_pool(b, node, store, False)),
    OpDef("LpPool", REDUCTION, pool_output_type,
          anchor=lambda b, node, store, out: lower_pool(b, node, store, False, lp=int(node.attrs.get("p", 2)))),
)


# ---- LogSoftmax, Hardmax, normalizations ------------------------------------------------------

def _trailing_axes(g, node, p):
    """Normalize over [axis, rank): LayerNormalization's and RMSNormalization's rows."""
    x = g.types[node.inputs[0]]
    rank = len(x.shape)
    p["axes"] = list(range(normalize_axis(node.attrs.get("axis", -1), rank, node), rank))
    return x


def _one_axis(g, node, p):
    x = g.types[node.inputs[0]]
    p["axes"] = [normalize_axis(node.attrs.get("axis", -1), len(x.shape), node)]
    if node.attrs.get("p", 2) not in (1, 2):
        raise UnsupportedError(f"{node.describe()}: p={node.attrs['p']} (1 or 2)")
    return x


def _channels_first(g, node, p):
    x = g.types[node.inputs[0]]
    if len(x.shape) < 3:
        raise ShapeError(f"{node.describe()}: {node.op} needs an input of rank 3 or more, got {x}")
    if node.op == "GroupNormalization":
        groups, c = node.attrs["num_groups"], x.shape[1]
        per = g.types[node.inputs[1]].shape[0]
        if c % groups or per not in (c, groups):
            raise ShapeError(f"{node.describe()}: {c} channels, {groups} groups and scale of {per} do not fit")
    return x


def _instance_norm(b, node, store):
    x, xs = b.reader(node.inputs[0]), b.shape(node.inputs[0])
    scale, bias = b.reader(node.inputs[1]), b.reader(node.inputs[2])
    affine = lambda f, y: fbin("add", fbin("mul", y, scale([f[1]])), bias([f[1]]))  # noqa: E731
    return lower_normalize(b, node, store, xs, list(range(2, len(xs))), x, lambda f: f,
                           node.attrs.get("epsilon", 1e-5), affine=affine)


def _group_norm(b, node, store):
    """Normalize the view [N, G, C/G, spatial...] over all but its first two dims."""
    xs = b.shape(node.inputs[0])
    groups = node.attrs["num_groups"]
    cg = xs[1] // groups
    view = (xs[0], groups, cg) + tuple(xs[2:])
    scale, bias = b.reader(node.inputs[1]), b.reader(node.inputs[2])
    per_channel = b.shape(node.inputs[1])[0] == xs[1]
    to_x = lambda f: [f[0], add(mul(f[1], cg), f[2])] + list(f[3:])  # noqa: E731
    x = b.reader(node.inputs[0])

    def affine(f, y):
        c = [add(mul(f[1], cg), f[2])] if per_channel else [f[1]]
        return fbin("add", fbin("mul", y, scale(c)), bias(c))
    return lower_normalize(b, node, store, view, list(range(2, len(view))), lambda f: x(to_x(f)), to_x,
                           node.attrs.get("epsilon", 1e-5), affine=affine)


def _mvn(g, node, p):
    x = g.types[node.inputs[0]]
    p["axes"] = sorted(normalize_axis(a, len(x.shape), node) for a in node.attrs.get("axes", [0, 2, 3]))
    return x


def _lrn(g, node, p):
    x = g.types[node.inputs[0]]
    if len(x.shape) < 3 or not is_float(x.dtype):
        raise UnsupportedError(f"{node.describe()}: LRN of {x} (floats of [N, C, D1, ...])")
    if node.attrs.get("size", 0) < 1:
        raise ShapeError(f"{node.describe()}: size={node.attrs.get('size')} (a window of at least one channel)")
    return x


def _lrn_terms(a) -> tuple:
    """(channels below, channels above, bias, alpha / size, beta) of an LRN's window."""
    size = a["size"]
    return (size - 1) // 2, size // 2, a.get("bias", 1.0), a.get("alpha", 1e-4) / size, a.get("beta", 0.75)


def _lrn_reader(b, node):
    """x / (bias + alpha / size * the sum of squares of x over the channels c - below .. c +
    above that exist) ** beta: the window's neighbours read at clamped channels and zeroed
    outside. beta 0.75 (AlexNet's, GoogLeNet's) is two square roots, which vectorize."""
    x, channels, t = b.reader(node.inputs[0]), b.shape(node.inputs[0])[1], b.compute(node.inputs[0])
    below, above, bias, scale, beta = _lrn_terms(b.attrs(node))

    def value(idx):
        n, c, rest = idx[0], idx[1], list(idx[2:])
        squares = []
        for k in range(-below, above + 1):
            ck = add(c, Const(k))
            v = x([n, iclamp(ck, 0, sub(channels, 1)), *rest]) if k else x(idx)
            square = fbin("mul", v, v)
            if k:
                inside = cmp("lt", ck, as_index(channels)) if k > 0 else cmp("ge", ck, Const(0))
                square = select(inside, square, const(0.0, t))
            squares.append(square)
        d = fbin("add", const(bias, t), fbin("mul", const(scale, t), fold_balanced("add", squares)))
        if beta == 0.75:
            root = call("sqrt", d)
            return fbin("div", x(idx), fbin("mul", root, call("sqrt", root)))
        return fbin("div", x(idx), fbin("pow", d, const(beta, t)))
    return value


def _lrn_fold(a, values, g, node):
    x = values[0]
    below, above, bias, scale, beta = _lrn_terms(a)
    squares = np.pad(x.astype(np.float64) ** 2, [(0, 0), (below, above)] + [(0, 0)] * (x.ndim - 2))
    window = sum(squares[:, k:k + x.shape[1]] for k in range(below + above + 1))
    return [(x / (bias + scale * window) ** beta).astype(x.dtype)]


register(
    OpDef("LRN", INJECTIVE, _lrn, _lrn_fold, one_output(_lrn_reader), costly=True),
    OpDef("LogSoftmax", REDUCTION, _softmax,
          anchor=lambda b, node, store, out: lower_softmax(b, node, store, out, log=True)),
    OpDef("Hardmax", REDUCTION, _softmax, anchor=lambda b, node, store, out: lower_hardmax(b, node, store)),
    OpDef(RMS_NORMALIZATION, REDUCTION, _trailing_axes,
          anchor=lambda b, node, store, out: lower_layernorm(b, node, store, center=False)),
    OpDef("InstanceNormalization", REDUCTION, _channels_first, anchor=lambda b, node, store, out: _instance_norm(
        b, node, store)),
    OpDef("GroupNormalization", REDUCTION, _channels_first,
          anchor=lambda b, node, store, out: _group_norm(b, node, store)),
    OpDef("LpNormalization", REDUCTION, _one_axis, anchor=lambda b, node, store, out: lower_lp_normalize(
        b, node, store)),
    OpDef("MeanVarianceNormalization", REDUCTION, _mvn, anchor=lambda b, node, store, out: lower_normalize(
        b, node, store, b.shape(node.inputs[0]), b.attrs(node)["axes"], b.reader(node.inputs[0]), lambda f: f,
        1e-9, eps_after_sqrt=True)),
)
