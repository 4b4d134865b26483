"""Readers of elementwise, broadcast and injective ops: pure index and value maps.

`compute(b, node)` returns the reader of each output of `node`, built from the readers of
its inputs, so a chain of such ops inlines into one expression per output element.
"""
from __future__ import annotations

import math

import numpy as np

from ..graph import Node, UnsupportedError
from ..loop import Cast, Const, Load, add, call, cmp, const, fbin, mul, select, sub
from .builder import COMPUTE_DT, KernelBuilder, broadcast_index


def _bcast(b: KernelBuilder, name: str, out_shape):
    r, shape = b.reader(name), b.shape(name)
    return lambda idx: r(broadcast_index(idx, out_shape, shape))


def _f(v) -> Const:
    return Const(float(v), "f32")


def _and(a, c):
    return fbin("and", a, c)


def _clamp(x, lo, hi):
    return fbin("min", fbin("max", x, lo), hi)


def _iclamp(e, lo: int, hi: int):
    return fbin("min", fbin("max", e, Const(lo)), Const(hi))


# ---- unary -------------------------------------------------------------------------------

def _sigmoid(x):
    return fbin("div", _f(1), fbin("add", _f(1), call("exp", call("neg", x))))


def _unary_fn(node: Node, dtype: str, b: KernelBuilder | None = None):
    a = node.attrs
    is_f = dtype == "float32"
    table = {
        "Relu": lambda x: fbin("max", x, _f(0) if is_f else Const(0)),
        "LeakyRelu": lambda x: select(cmp("lt", x, _f(0)), fbin("mul", x, _f(a.get("alpha", 0.01))), x),
        "Sigmoid": _sigmoid,
        "HardSigmoid": lambda x: _clamp(fbin("add", fbin("mul", x, _f(a.get("alpha", 0.2))), _f(a.get("beta", 0.5))),
                                        _f(0), _f(1)),
        "HardSwish": lambda x: fbin("mul", x, _clamp(fbin("add", fbin("mul", x, _f(1 / 6)), _f(0.5)), _f(0), _f(1))),
        "Tanh": lambda x: call("tanh", x),
        "Erf": lambda x: call("erf", x),
        "Exp": lambda x: call("exp", x),
        "Log": lambda x: call("log", x),
        "Sqrt": lambda x: call("sqrt", x),
        "Reciprocal": lambda x: fbin("div", _f(1), x),
        "Neg": lambda x: call("neg", x) if is_f else sub(Const(0), x),
        "Abs": lambda x: call("abs", x) if is_f else select(cmp("lt", x, Const(0)), sub(Const(0), x), x),
        "Not": lambda x: call("not", x),
        "Identity": lambda x: x,
    }
    if node.op == "Clip":
        lo, hi = b.attrs(node)["min"], b.attrs(node)["max"]
        mk = _f if is_f else (lambda v: Const(int(max(min(v, 2**62), -2**62))))

        def bound(value, index):
            # A run-time bound is a scalar input: its only element is at index [].
            return b.reader(node.inputs[index])([]) if value is None else mk(value)

        def clip(x):
            if lo != -math.inf:
                x = fbin("max", x, bound(lo, 1))
            if hi != math.inf:
                x = fbin("min", x, bound(hi, 2))
            return x
        return clip
    if node.op == "Gelu":
        if a.get("approximate", "none") == "tanh":
            k = math.sqrt(2 / math.pi)
            return lambda x: fbin("mul", fbin("mul", _f(0.5), x), fbin("add", _f(1), call("tanh", fbin(
                "mul", _f(k), fbin("add", x, fbin("mul", _f(0.044715), fbin("mul", x, fbin("mul", x, x))))))))
        return lambda x: fbin("mul", fbin("mul", _f(0.5), x),
                              fbin("add", _f(1), call("erf", fbin("mul", x, _f(1 / math.sqrt(2))))))
    return table[node.op]


def _cast_fn(src: str, dst: str):
    s, d = COMPUTE_DT[src], COMPUTE_DT[dst]
    if s == d:
        return lambda x: x
    if d == "i1":
        zero = _f(0) if s == "f32" else Const(0)
        return lambda x: cmp("ne", x, zero)
    if s == "f32" and d == "i64":
        return lambda x: Cast("i64", x)
    return lambda x: Cast(d, x)


# ---- binary ------------------------------------------------------------------------------

def _pow(b: KernelBuilder, node: Node, x, y):
    exponent = b.g.constants.get(node.inputs[1])
    if exponent is not None and exponent.size == 1:
        e = float(exponent.reshape(-1)[0])
        if e == 1:
            return x
        if e == 2:
            return fbin("mul", x, x)
        if e == 3:
            return fbin("mul", x, fbin("mul", x, x))
        if e == 0.5:
            return call("sqrt", x)
    if b.type(node.inputs[1]).dtype != "float32":
        y = Cast("f32", y)
    if b.type(node.inputs[0]).dtype != "float32":
        # Integer powers through float32: exact while results stay below 2**24.
        return Cast("i64", call("round", fbin("pow", Cast("f32", x), y)))
    return fbin("pow", x, y)


def _mod(node: Node, dtype: str, x, y):
    if dtype == "float32":
        return call("fmod", x, y)
    r = fbin("rem", x, y)
    if node.attrs.get("fmod", 0):
        return r
    # Python-style modulo: the result takes the divisor's sign.
    fix = _and(cmp("ne", r, Const(0)), cmp("ne", cmp("lt", r, Const(0)), cmp("lt", y, Const(0))))
    return select(fix, add(r, y), r)


_BIN = {"Add": "add", "Sub": "sub", "Mul": "mul", "Div": "div", "Max": "max", "Min": "min"}
_CMP = {"Equal": "eq", "Less": "lt", "Greater": "gt"}


def compute(b: KernelBuilder, node: Node) -> dict:
    """Readers for the outputs of an elementwise/broadcast/injective node."""
    out = node.outputs[0]
    oshape = b.shape(out)
    op = node.op
    if op in ("Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze"):
        return {out: _view(b, node.inputs[0], oshape)}
    if op == "Cast":
        x, fn = _bcast(b, node.inputs[0], oshape), _cast_fn(b.type(node.inputs[0]).dtype, b.type(out).dtype)
        return {out: lambda idx: fn(x(idx))}
    if op in ("Relu", "LeakyRelu", "Clip", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh", "Erf", "Gelu", "Exp",
              "Log", "Sqrt", "Reciprocal", "Neg", "Abs", "Not"):
        x, fn = _bcast(b, node.inputs[0], oshape), _unary_fn(node, b.type(node.inputs[0]).dtype, b)
        return {out: lambda idx: fn(x(idx))}
    if op in _BIN or op in _CMP or op in ("Pow", "Mod"):
        readers = [_bcast(b, i, oshape) for i in node.inputs]
        dtype = b.type(node.inputs[0]).dtype
        if op in _CMP:
            return {out: lambda idx: cmp(_CMP[op], readers[0](idx), readers[1](idx))}
        if op == "Pow":
            return {out: lambda idx: _pow(b, node, readers[0](idx), readers[1](idx))}
        if op == "Mod":
            return {out: lambda idx: _mod(node, dtype, readers[0](idx), readers[1](idx))}

        def fold(idx):
            value = readers[0](idx)
            for r in readers[1:]:
                value = fbin(_BIN[op], value, r(idx))
            return value
        return {out: fold}
    if op == "Where":
        c, x, y = (_bcast(b, i, oshape) for i in node.inputs)
        return {out: lambda idx: select(c(idx), x(idx), y(idx))}
    if op == "BatchNormalization":
        return {out: _batchnorm(b, node, oshape)}
    if op == "Transpose":
        x, perm = b.reader(node.inputs[0]), b.attrs(node)["perm"]

        def transpose(idx):
            src = [None] * len(perm)
            for i, p in enumerate(perm):
                src[p] = idx[i]
            return x(src)
        return {out: transpose}
    if op == "Expand":
        return {out: _bcast(b, node.inputs[0], oshape)}
    if op == "Slice":
        x, begin, step = b.reader(node.inputs[0]), b.attrs(node)["begin"], b.attrs(node)["step"]
        return {out: lambda idx: x([add(bg, mul(st, i)) for i, bg, st in zip(idx, begin, step)])}
    if op == "Concat":
        return {out: _concat(b, node)}
    if op == "Split":
        return _split(b, node)
    if op == "Gather":
        return {out: _gather(b, node)}
    if op == "Pad":
        return {out: _pad(b, node)}
    if op == "Resize":
        return {out: _resize(b, node)}
    raise UnsupportedError(f"{node.describe()}: no elementwise lowering for {op}")


def _view(b: KernelBuilder, src: str, oshape):
    """A reshape inside a group: same row-major data, so go through the flat index."""
    from ..loop import flat_index, unflatten
    x, sshape = b.reader(src), b.shape(src)
    if tuple(sshape) == tuple(oshape):
        return x
    return lambda idx: x(unflatten(flat_index(idx, oshape), sshape))


def _batchnorm(b: KernelBuilder, node: Node, oshape):
    x = b.reader(node.inputs[0])
    scale, bias, mean, var = (b.reader(i) for i in node.inputs[1:5])
    eps = _f(node.attrs.get("epsilon", 1e-5))

    def bn(idx):
        c = [idx[1]]
        inv = fbin("div", scale(c), call("sqrt", fbin("add", var(c), eps)))
        return fbin("add", fbin("mul", fbin("sub", x(idx), mean(c)), inv), bias(c))
    return bn


def _concat(b: KernelBuilder, node: Node):
    axis = b.attrs(node)["axis"]
    parts, off = [], 0
    for name in node.inputs:
        if name:
            parts.append((off, b.shape(name)[axis], b.reader(name)))
            off += b.shape(name)[axis]

    def concat(idx):
        value = None
        for start, size, r in reversed(parts):
            local = list(idx)
            # Every branch is evaluated, so keep every branch's index in bounds.
            local[axis] = _iclamp(sub(idx[axis], start), 0, size - 1)
            v = r(local)
            value = v if value is None else select(cmp("lt", idx[axis], Const(start + size)), v, value)
        return value
    return concat


def _split(b: KernelBuilder, node: Node) -> dict:
    axis, x = b.attrs(node)["axis"], b.reader(node.inputs[0])
    out, off = {}, 0
    for name, size in zip(node.outputs, b.attrs(node)["sizes"]):
        if name:
            out[name] = (lambda start: lambda idx: x([add(i, start) if a == axis else i
                                                      for a, i in enumerate(idx)]))(off)
        off += size
    return out


def _gather(b: KernelBuilder, node: Node):
    axis = b.attrs(node)["axis"]
    x, ind = b.reader(node.inputs[0]), b.reader(node.inputs[1])
    r = len(b.shape(node.inputs[1]))
    dim = b.shape(node.inputs[0])[axis]

    def gather(idx):
        i = ind(idx[axis:axis + r])
        i = select(cmp("lt", i, Const(0)), add(i, Const(dim)), i)
        return x(list(idx[:axis]) + [_iclamp(i, 0, dim - 1)] + list(idx[axis + r:]))
    return gather


def _pad(b: KernelBuilder, node: Node):
    x, shape = b.reader(node.inputs[0]), b.shape(node.inputs[0])
    pads, rank, mode = b.attrs(node)["pads"], len(shape), b.attrs(node)["mode"]
    dtype = b.type(node.inputs[0]).dtype
    value = const(b.attrs(node)["value"], COMPUTE_DT[dtype])

    def pad(idx):
        src, inside = [], None
        for a, i in enumerate(idx):
            before, n = pads[a], shape[a]
            if not before and not pads[a + rank]:
                src.append(i)
                continue
            j = sub(i, Const(before))
            if mode == "edge":
                src.append(_iclamp(j, 0, n - 1))
            elif mode == "reflect":
                j = select(cmp("lt", j, Const(0)), sub(Const(0), j), j)
                j = select(cmp("ge", j, Const(n)), sub(Const(2 * (n - 1)), j), j)
                src.append(_iclamp(j, 0, n - 1))
            else:
                ok = _and(cmp("ge", j, Const(0)), cmp("lt", j, Const(n)))
                inside = ok if inside is None else _and(inside, ok)
                src.append(_iclamp(j, 0, n - 1))
        v = x(src)
        return v if inside is None else select(inside, v, value)
    return pad


def resize_source_coords(n_in: int, n_out: int, scale: float, ctm: str) -> np.ndarray:
    """Source coordinate of every output index along one axis, in float64 as ONNX defines it."""
    x = np.arange(n_out, dtype=np.float64)
    if ctm == "align_corners":
        return np.zeros(n_out) if n_out == 1 else x * (n_in - 1) / (n_out - 1)
    if ctm == "asymmetric":
        return x / scale
    if ctm == "tf_half_pixel_for_nearest":
        return (x + 0.5) / scale
    if ctm == "pytorch_half_pixel" and n_out == 1:
        return np.zeros(1)
    return (x + 0.5) / scale - 0.5


def _nearest(coords: np.ndarray, mode: str) -> np.ndarray:
    if mode == "floor":
        return np.floor(coords)
    if mode == "ceil":
        return np.ceil(coords)
    half = coords - np.floor(coords) == 0.5
    return np.where(half, np.floor(coords) if mode == "round_prefer_floor" else np.ceil(coords), np.round(coords))


def _resize(b: KernelBuilder, node: Node):
    """Resize through per-axis index (and weight) tables computed at compile time in float64:
    exact where ONNX's coordinates land on .5, and a gather per element at run time."""
    x, ishape = b.reader(node.inputs[0]), b.shape(node.inputs[0])
    oshape = b.shape(node.outputs[0])
    a = b.attrs(node)
    mode = a.get("mode", "nearest")
    ctm = a.get("coordinate_transformation_mode", "half_pixel")
    scales = a["scales"]
    resized = [ax for ax in range(len(ishape)) if ishape[ax] != oshape[ax] or scales[ax] != 1]
    tables = {}
    for ax in resized:
        coords = resize_source_coords(ishape[ax], oshape[ax], scales[ax], ctm)
        if mode == "nearest":
            idx = np.clip(_nearest(coords, a.get("nearest_mode", "round_prefer_floor")), 0, ishape[ax] - 1)
            tables[ax] = b.constant_param("resize_index", idx.astype(np.int64))
        else:
            lo = np.floor(coords)
            tables[ax] = (b.constant_param("resize_lo", np.clip(lo, 0, ishape[ax] - 1).astype(np.int64)),
                          b.constant_param("resize_hi", np.clip(lo + 1, 0, ishape[ax] - 1).astype(np.int64)),
                          b.constant_param("resize_w", (coords - lo).astype(np.float32)))

    if mode == "nearest":
        def near(idx):
            src = list(idx)
            for ax in resized:
                src[ax] = Load(tables[ax], idx[ax])
            return x(src)
        return near

    def linear(idx):
        corners = [(list(idx), None)]
        for ax in resized:
            lo_t, hi_t, w_t = tables[ax]
            w1 = Load(w_t, idx[ax])
            w0 = fbin("sub", _f(1), w1)
            nxt = []
            for src, w in corners:
                for pos, wt in ((Load(lo_t, idx[ax]), w0), (Load(hi_t, idx[ax]), w1)):
                    s2 = list(src)
                    s2[ax] = pos
                    nxt.append((s2, wt if w is None else fbin("mul", w, wt)))
            corners = nxt
        value = None
        for src, w in corners:
            term = fbin("mul", x(src), w)
            value = term if value is None else fbin("add", value, term)
        return value
    return linear
