"""Per-op type inference, op pattern kinds, and attribute normalization.

`infer(g, node)` returns the output TensorTypes of one node from its input types (and the
values of constant inputs), and the node's canonical parameters. It never trusts shapes
declared in the model. Where an op's parameters can be spelled several ways (auto_pad,
attributes moved to inputs, old Softmax semantics), the parameters hold one canonical form,
so lowering and folding read one spelling only. Nothing is written into the node.
"""
from __future__ import annotations

import math

import numpy as np

from .attrs import attr_or_input, check_attrs, const_input, normalize_axis
from .graph import Graph, Node, ShapeError, TensorType, UnsupportedError

# Op pattern kinds, ordered as in TVM: a lower kind is easier to fuse.
ELEMWISE, BROADCAST, INJECTIVE, REDUCTION, OUT_EWISE_FUSABLE, OPAQUE = 0, 1, 2, 3, 4, 8

UNARY = {"Relu", "LeakyRelu", "Clip", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh", "Erf", "Gelu", "Exp",
         "Log", "Sqrt", "Reciprocal", "Neg", "Abs", "Not", "Identity", "Cast"}
BINARY = {"Add", "Sub", "Mul", "Div", "Pow", "Mod", "Equal", "Less", "Greater"}
VARIADIC = {"Max", "Min"}
COMPARE = {"Equal", "Less", "Greater"}
RESHAPES = {"Reshape", "Flatten", "Squeeze", "Unsqueeze"}  # views: no data moves

OP_KIND = {
    **{op: ELEMWISE for op in UNARY},
    **{op: BROADCAST for op in BINARY | VARIADIC | {"Where", "BatchNormalization"}},
    **{op: INJECTIVE for op in RESHAPES | {"Transpose", "Concat", "Split", "Slice", "Expand", "Gather",
                                           "Pad", "Resize"}},
    **{op: REDUCTION for op in {"ReduceMean", "ReduceSum", "ReduceMax", "GlobalAveragePool",
                                "GlobalMaxPool", "Softmax", "LayerNormalization", "MaxPool", "AveragePool"}},
    **{op: OUT_EWISE_FUSABLE for op in {"Conv", "ConvTranspose", "Gemm", "MatMul"}},
    # Evaluated at compile time only: their outputs are always constants.
    **{op: OPAQUE for op in {"Shape", "Constant", "Range", "ConstantOfShape"}},
}
SUPPORTED_OPS = sorted(OP_KIND)


def broadcast(shapes, node: Node) -> tuple[int, ...]:
    try:
        return tuple(int(d) for d in np.broadcast_shapes(*shapes))
    except ValueError:
        raise ShapeError(f"{node.describe()}: input shapes {' and '.join(map(str, shapes))} do not broadcast")


def _t(g: Graph, name: str) -> TensorType:
    return g.types[name]


def infer(g: Graph, node: Node) -> tuple[list[TensorType], dict]:
    """(output types, canonical parameters) of one node."""
    fn = _INFER.get(node.op)
    if fn is None:
        raise UnsupportedError(f"{node.describe()}: op {node.op} is not supported")
    params: dict = {}
    out = fn(g, node, params)
    return (out if isinstance(out, list) else [out]), params


# ---- elementwise -------------------------------------------------------------------------

def _unary(g, node, p):
    x = _t(g, node.inputs[0])
    if node.op == "Cast":
        from .onnx_dtypes import onnx_to_dtype
        return TensorType(x.shape, onnx_to_dtype(node.attrs["to"], node))
    if node.op == "Gelu":
        check_attrs(node, {"approximate": ("none", "tanh")})
    if node.op == "Clip":
        for index, key, default in ((1, "min", -math.inf), (2, "max", math.inf)):
            name = node.inputs[index] if index < len(node.inputs) else ""
            if name and name not in g.constants:
                p[key] = None  # a run-time bound: read from the input
            else:
                value = const_input(g, node, index, key)
                p[key] = float(value.reshape(-1)[0]) if value is not None else float(
                    node.attrs.get(key, default))
    if node.op == "Not":
        return TensorType(x.shape, "bool")
    return x


def _binary(g, node, p):
    a, b = _t(g, node.inputs[0]), _t(g, node.inputs[1])
    shape = broadcast([a.shape, b.shape], node)
    if node.op in COMPARE:
        return TensorType(shape, "bool")
    if node.op == "Mod" and a.dtype == "float32" and not node.attrs.get("fmod", 0):
        raise UnsupportedError(f"{node.describe()}: Mod on floats needs fmod=1 (ONNX rule)")
    if node.op == "Pow":
        return TensorType(shape, a.dtype)
    if a.dtype != b.dtype:
        raise ShapeError(f"{node.describe()}: input dtypes {a.dtype} and {b.dtype} differ")
    return TensorType(shape, a.dtype)


def _variadic(g, node, p):
    types = [_t(g, i) for i in node.inputs]
    return TensorType(broadcast([t.shape for t in types], node), types[0].dtype)


def _where(g, node, p):
    c, a, b = (_t(g, i) for i in node.inputs)
    return TensorType(broadcast([c.shape, a.shape, b.shape], node), a.dtype)


def _batchnorm(g, node, p):
    if node.attrs.get("training_mode", 0):
        raise UnsupportedError(f"{node.describe()}: training_mode=1 is not supported (inference only)")
    return _t(g, node.inputs[0])


# ---- injective ---------------------------------------------------------------------------

def _reshape(g, node, p):
    x = _t(g, node.inputs[0])
    target = [int(v) for v in const_input(g, node, 1, "shape", required=True).reshape(-1)]
    allowzero = node.attrs.get("allowzero", 0)
    out = [x.shape[i] if d == 0 and not allowzero else d for i, d in enumerate(target)]
    if out.count(-1) > 1:
        raise ShapeError(f"{node.describe()}: more than one -1 in shape {target}")
    if -1 in out:
        known = int(np.prod([d for d in out if d != -1]))
        if known == 0 or x.size % known:
            raise ShapeError(f"{node.describe()}: cannot reshape {x} to {target}")
        out[out.index(-1)] = x.size // known
    if int(np.prod(out)) != x.size:
        raise ShapeError(f"{node.describe()}: cannot reshape {x} to {target}")
    return TensorType(tuple(out), x.dtype)


def _flatten(g, node, p):
    x = _t(g, node.inputs[0])
    axis = node.attrs.get("axis", 1)
    axis = axis + len(x.shape) if axis < 0 else axis
    return TensorType((int(np.prod(x.shape[:axis])), int(np.prod(x.shape[axis:]))), x.dtype)


def _squeeze(g, node, p):
    x = _t(g, node.inputs[0])
    axes = attr_or_input(g, node, "axes", 1)
    rank = len(x.shape)
    if axes is None:
        axes = [i for i, d in enumerate(x.shape) if d == 1]
    axes = {normalize_axis(a, rank, node) for a in axes}
    for a in axes:
        if x.shape[a] != 1:
            raise ShapeError(f"{node.describe()}: cannot squeeze axis {a} of size {x.shape[a]}")
    return TensorType(tuple(d for i, d in enumerate(x.shape) if i not in axes), x.dtype)


def _unsqueeze(g, node, p):
    x = _t(g, node.inputs[0])
    axes = attr_or_input(g, node, "axes", 1)
    rank = len(x.shape) + len(axes)
    axes = sorted(normalize_axis(a, rank, node) for a in axes)
    out = list(x.shape)
    for a in axes:
        out.insert(a, 1)
    return TensorType(tuple(out), x.dtype)


def _transpose(g, node, p):
    x = _t(g, node.inputs[0])
    perm = node.attrs.get("perm", list(range(len(x.shape)))[::-1])
    p["perm"] = list(perm)
    return TensorType(tuple(x.shape[p] for p in perm), x.dtype)


def _concat(g, node, p):
    types = [_t(g, i) for i in node.inputs if i]
    rank = len(types[0].shape)
    axis = normalize_axis(node.attrs["axis"], rank, node)
    p["axis"] = axis
    for t in types:
        if len(t.shape) != rank or any(t.shape[i] != types[0].shape[i] for i in range(rank) if i != axis):
            raise ShapeError(f"{node.describe()}: inputs {', '.join(map(str, types))} do not concatenate on axis {axis}")
    out = list(types[0].shape)
    out[axis] = sum(t.shape[axis] for t in types)
    return TensorType(tuple(out), types[0].dtype)


def _split(g, node, p):
    x = _t(g, node.inputs[0])
    axis = normalize_axis(node.attrs.get("axis", 0), len(x.shape), node)
    sizes = attr_or_input(g, node, "split", 1)
    n = len(node.outputs)
    if sizes is None:
        n = node.attrs.get("num_outputs", n)
        chunk = -(-x.shape[axis] // n)
        sizes = [min(chunk, x.shape[axis] - i * chunk) for i in range(n)]
    if sum(sizes) != x.shape[axis] or len(sizes) != len(node.outputs):
        raise ShapeError(f"{node.describe()}: split sizes {sizes} do not fit axis {axis} of {x}")
    p["axis"], p["sizes"] = axis, [int(s) for s in sizes]
    outs = []
    for s in sizes:
        shape = list(x.shape)
        shape[axis] = int(s)
        outs.append(TensorType(tuple(shape), x.dtype))
    return outs


def _slice(g, node, p):
    x = _t(g, node.inputs[0])
    rank = len(x.shape)
    starts = attr_or_input(g, node, "starts", 1)
    ends = attr_or_input(g, node, "ends", 2)
    axes = attr_or_input(g, node, "axes", 3, list(range(len(starts))))
    steps = attr_or_input(g, node, "steps", 4, [1] * len(starts))
    begin, step, shape = [0] * rank, [1] * rank, list(x.shape)
    for s, e, a, st in zip(starts, ends, axes, steps):
        a = normalize_axis(a, rank, node)
        if st == 0:
            raise ShapeError(f"{node.describe()}: step 0 on axis {a}")
        r = range(x.shape[a])[slice(int(s), int(e), int(st))]
        begin[a], step[a], shape[a] = r.start, r.step, len(r)
    p["begin"], p["step"] = begin, step
    return TensorType(tuple(shape), x.dtype)


def _expand(g, node, p):
    x = _t(g, node.inputs[0])
    shape = [int(v) for v in const_input(g, node, 1, "shape", required=True).reshape(-1)]
    return TensorType(broadcast([x.shape, tuple(shape)], node), x.dtype)


def _gather(g, node, p):
    x, idx = _t(g, node.inputs[0]), _t(g, node.inputs[1])
    axis = normalize_axis(node.attrs.get("axis", 0), len(x.shape), node)
    p["axis"] = axis
    return TensorType(x.shape[:axis] + idx.shape + x.shape[axis + 1:], x.dtype)


def _pad(g, node, p):
    x = _t(g, node.inputs[0])
    rank = len(x.shape)
    check_attrs(node, {"mode": ("constant", "reflect", "edge")})
    pads = attr_or_input(g, node, "pads", 1)
    axes = attr_or_input(g, node, "axes", 3, list(range(rank)))
    axes = [normalize_axis(a, rank, node) for a in axes]
    full = [0] * (2 * rank)
    for i, a in enumerate(axes):
        full[a], full[a + rank] = int(pads[i]), int(pads[i + len(axes)])
    value = const_input(g, node, 2, "constant_value")
    p["pads"], p["mode"] = full, node.attrs.get("mode", "constant")
    p["value"] = float(value.reshape(-1)[0]) if value is not None and value.size else float(node.attrs.get("value", 0.0))
    shape = tuple(x.shape[i] + full[i] + full[i + rank] for i in range(rank))
    if min(shape) < 0:
        raise ShapeError(f"{node.describe()}: pads {full} make a negative dimension of {x}")
    return TensorType(shape, x.dtype)


def _resize(g, node, p):
    x = _t(g, node.inputs[0])
    rank = len(x.shape)
    check_attrs(node, {
        "mode": ("nearest", "linear"),
        "coordinate_transformation_mode": ("half_pixel", "asymmetric", "align_corners", "pytorch_half_pixel",
                                           "tf_half_pixel_for_nearest"),
        "nearest_mode": ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil"),
        "antialias": (0,),
        "keep_aspect_ratio_policy": ("stretch",),
    })
    axes = [normalize_axis(a, rank, node) for a in node.attrs.get("axes", range(rank))]
    scales = const_input(g, node, 2, "scales")
    sizes = const_input(g, node, 3, "sizes")
    out_scale = [1.0] * rank
    shape = list(x.shape)
    if sizes is not None and sizes.size:
        for a, s in zip(axes, sizes.reshape(-1)):
            shape[a] = int(s)
            out_scale[a] = int(s) / x.shape[a]
    elif scales is not None and scales.size:
        for a, s in zip(axes, scales.reshape(-1)):
            shape[a] = int(math.floor(x.shape[a] * float(s)))
            out_scale[a] = float(s)
    else:
        raise UnsupportedError(f"{node.describe()}: Resize needs constant scales or sizes")
    p["scales"] = out_scale
    return TensorType(tuple(shape), x.dtype)


# ---- reductions and windows --------------------------------------------------------------

def _reduce(g, node, p):
    x = _t(g, node.inputs[0])
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
    x = _t(g, node.inputs[0])
    p["axes"], p["keepdims"] = list(range(2, len(x.shape))), 1
    return TensorType(x.shape[:2] + (1,) * (len(x.shape) - 2), x.dtype)


def _softmax(g, node, p):
    x = _t(g, node.inputs[0])
    rank = len(x.shape)
    if g.opset < 13:  # old semantics: coerce to 2-D at axis, normalize over everything after it
        axis = normalize_axis(node.attrs.get("axis", 1), rank, node)
        p["axes"] = list(range(axis, rank))
    else:
        p["axes"] = [normalize_axis(node.attrs.get("axis", -1), rank, node)]
    return x


def _layernorm(g, node, p):
    x = _t(g, node.inputs[0])
    rank = len(x.shape)
    axis = normalize_axis(node.attrs.get("axis", -1), rank, node)
    p["axes"] = list(range(axis, rank))
    stats = TensorType(x.shape[:axis] + (1,) * (rank - axis), "float32")  # Mean, InvStdDev
    return [x] + [stats] * (len(node.outputs) - 1)


def _window(node, p, spatial, kernel, is_transpose=False, out_padding=None, auto=None):
    """Resolve auto_pad/pads/strides/dilations into explicit lists in the parameters."""
    n = len(spatial)
    strides = list(node.attrs.get("strides", [1] * n))
    dil = list(node.attrs.get("dilations", [1] * n))
    pads = list(p.get("pads", node.attrs.get("pads", [0] * (2 * n))))
    auto = auto or node.attrs.get("auto_pad", "NOTSET")
    if isinstance(auto, bytes):
        auto = auto.decode()
    check_attrs(node, {"auto_pad": ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID",
                                    b"NOTSET", b"SAME_UPPER", b"SAME_LOWER", b"VALID")})
    if auto == "VALID":
        pads = [0] * (2 * n)
    elif auto in ("SAME_UPPER", "SAME_LOWER"):
        for i in range(n):
            ext = (kernel[i] - 1) * dil[i] + 1
            if is_transpose:
                out = spatial[i] * strides[i]
                total = max(strides[i] * (spatial[i] - 1) + out_padding[i] + ext - out, 0)
            else:
                out = -(-spatial[i] // strides[i])
                total = max((out - 1) * strides[i] + ext - spatial[i], 0)
            small, big = total // 2, total - total // 2
            pads[i], pads[i + n] = (small, big) if auto == "SAME_UPPER" else (big, small)
    p.update(strides=strides, dilations=dil, pads=pads, kernel_shape=list(kernel))
    return strides, dil, pads


def _pool(g, node, p):
    x = _t(g, node.inputs[0])
    spatial = x.shape[2:]
    kernel = node.attrs["kernel_shape"]
    if len(node.outputs) > 1 and any(node.outputs[1:]):
        raise UnsupportedError(f"{node.describe()}: the Indices output of MaxPool is not supported")
    strides, dil, pads = _window(node, p, spatial, kernel)
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


def _conv(g, node, p):
    x, w = _t(g, node.inputs[0]), _t(g, node.inputs[1])
    spatial = x.shape[2:]
    kernel = node.attrs.get("kernel_shape", list(w.shape[2:]))
    group = node.attrs.get("group", 1)
    if len(x.shape) != len(w.shape) or x.shape[1] != w.shape[1] * group:
        raise ShapeError(f"{node.describe()}: input {x} does not match weight {w} with group={group}")
    strides, dil, pads = _window(node, p, spatial, kernel)
    n = len(spatial)
    out = [(spatial[i] + pads[i] + pads[i + n] - ((kernel[i] - 1) * dil[i] + 1)) // strides[i] + 1 for i in range(n)]
    if min(out) <= 0:
        raise ShapeError(f"{node.describe()}: kernel {kernel} does not fit input {x}")
    return TensorType((x.shape[0], w.shape[0]) + tuple(out), x.dtype)


def _conv_transpose(g, node, p):
    x, w = _t(g, node.inputs[0]), _t(g, node.inputs[1])
    spatial = x.shape[2:]
    n = len(spatial)
    group = node.attrs.get("group", 1)
    kernel = node.attrs.get("kernel_shape", list(w.shape[2:]))
    out_pad = list(node.attrs.get("output_padding", [0] * n))
    if x.shape[1] != w.shape[0]:
        raise ShapeError(f"{node.describe()}: input {x} does not match weight {w}")
    if "output_shape" in node.attrs:
        target = list(node.attrs["output_shape"])[-n:]
        strides = list(node.attrs.get("strides", [1] * n))
        dil = list(node.attrs.get("dilations", [1] * n))
        pads = [0] * (2 * n)
        for i in range(n):
            total = strides[i] * (spatial[i] - 1) + out_pad[i] + (kernel[i] - 1) * dil[i] + 1 - target[i]
            auto = node.attrs.get("auto_pad", "NOTSET")
            if auto == "SAME_UPPER":
                pads[i], pads[i + n] = total // 2, total - total // 2
            else:
                pads[i], pads[i + n] = total - total // 2, total // 2
        p["pads"] = pads
    explicit = "NOTSET" if "output_shape" in node.attrs else None  # pads just came from output_shape
    strides, dil, pads = _window(node, p, spatial, kernel, is_transpose=True, out_padding=out_pad, auto=explicit)
    p["output_padding"] = out_pad
    out = [strides[i] * (spatial[i] - 1) + out_pad[i] + (kernel[i] - 1) * dil[i] + 1 - pads[i] - pads[i + n]
           for i in range(n)]
    return TensorType((x.shape[0], w.shape[1] * group) + tuple(out), x.dtype)


def _matmul(g, node, p):
    a, b = _t(g, node.inputs[0]), _t(g, node.inputs[1])
    sa, sb = list(a.shape), list(b.shape)
    if not sa or not sb:
        raise ShapeError(f"{node.describe()}: MatMul of a scalar")
    va, vb = len(sa) == 1, len(sb) == 1
    sa = [1] + sa if va else sa
    sb = sb + [1] if vb else sb
    if sa[-1] != sb[-2]:
        raise ShapeError(f"{node.describe()}: inner dimensions of {a} and {b} differ")
    batch = broadcast([tuple(sa[:-2]), tuple(sb[:-2])], node)
    out = list(batch) + ([] if va else [sa[-2]]) + ([] if vb else [sb[-1]])
    return TensorType(tuple(out), a.dtype)


def _gemm(g, node, p):
    a, b = _t(g, node.inputs[0]), _t(g, node.inputs[1])
    m = a.shape[1] if node.attrs.get("transA", 0) else a.shape[0]
    ka = a.shape[0] if node.attrs.get("transA", 0) else a.shape[1]
    kb, n = (b.shape[1], b.shape[0]) if node.attrs.get("transB", 0) else b.shape
    if ka != kb:
        raise ShapeError(f"{node.describe()}: inner dimensions of {a} and {b} differ")
    if len(node.inputs) > 2 and node.inputs[2]:
        broadcast([_t(g, node.inputs[2]).shape, (m, n)], node)
    return TensorType((m, n), a.dtype)


# ---- compile-time only -------------------------------------------------------------------

def _shape(g, node, p):
    x = _t(g, node.inputs[0])
    rank = len(x.shape)
    start = node.attrs.get("start", 0)
    end = node.attrs.get("end", rank)
    return TensorType((len(range(rank)[slice(start, end)]),), "int64")


def _from_folding(g, node, p):
    """Compile-time-only ops: their type is the type of their folded value."""
    if not all(i in g.constants for i in node.inputs if i):
        raise UnsupportedError(f"{node.describe()}: inputs must be known at compile time")
    from .op_reference import fold
    values = fold(g, node, [g.constants.get(i) if i else None for i in node.inputs])
    return [TensorType(tuple(v.shape), str(v.dtype)) for v in values]


_INFER = {
    **{op: _unary for op in UNARY}, **{op: _binary for op in BINARY}, **{op: _variadic for op in VARIADIC},
    "Where": _where, "BatchNormalization": _batchnorm,
    "Reshape": _reshape, "Flatten": _flatten, "Squeeze": _squeeze, "Unsqueeze": _unsqueeze,
    "Transpose": _transpose, "Concat": _concat, "Split": _split, "Slice": _slice, "Expand": _expand,
    "Gather": _gather, "Pad": _pad, "Resize": _resize,
    "ReduceMean": _reduce, "ReduceSum": _reduce, "ReduceMax": _reduce,
    "GlobalAveragePool": _global_pool, "GlobalMaxPool": _global_pool,
    "Softmax": _softmax, "LayerNormalization": _layernorm, "MaxPool": _pool, "AveragePool": _pool,
    "Conv": _conv, "ConvTranspose": _conv_transpose, "MatMul": _matmul, "Gemm": _gemm,
    "Shape": _shape, "Constant": _from_folding, "Range": _from_folding, "ConstantOfShape": _from_folding,
}
