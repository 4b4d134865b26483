"""Elementwise and broadcast ops: unary math, activations, arithmetic, comparisons,
Where, Cast, BatchNormalization (when it is not folded into a convolution).

Each lowers to a reader: an expression per output element built from its inputs'
readers, so a chain of them inlines into one loop nest.
"""
from __future__ import annotations

import math

import numpy as np

from ..attrs import check_attrs, const_input
from ..graph import ShapeError, TensorType, UnsupportedError
from ..loop import Cast, Const, add, call, cmp, fbin, select, sub
from ..lower.builder import COMPUTE_DT
from ..lower.elementwise import and_, bcast_reader, clamp, f32
from ..onnx_dtypes import onnx_to_dtype
from .broadcast import broadcast
from .registry import BROADCAST, ELEMWISE, OpDef, register


def _same(g, node, p):
    return g.types[node.inputs[0]]


def _unary(name, expr, fold=None, infer=_same):
    """An op of one input: `expr(x, attrs, is_float, b, node)` is its element; `fold(x, attrs)`
    its numpy evaluation."""
    def reader(b, node):
        x = bcast_reader(b, node.inputs[0], b.shape(node.outputs[0]))
        is_f, a = b.type(node.inputs[0]).dtype == "float32", b.attrs(node)
        return {node.outputs[0]: lambda idx: expr(x(idx), a, is_f, b, node)}
    evaluate = (lambda a, v, g, node: [fold(v[0], a)]) if fold else None
    return OpDef(name, ELEMWISE, infer, evaluate, reader)


def _sigmoid(x):
    return fbin("div", f32(1), fbin("add", f32(1), call("exp", call("neg", x))))


def _gelu_infer(g, node, p):
    check_attrs(node, {"approximate": ("none", "tanh")})
    return g.types[node.inputs[0]]


def _gelu(x, a, is_f, b, node):
    if a.get("approximate", "none") == "tanh":
        k = math.sqrt(2 / math.pi)
        return fbin("mul", fbin("mul", f32(0.5), x), fbin("add", f32(1), call("tanh", fbin(
            "mul", f32(k), fbin("add", x, fbin("mul", f32(0.044715), fbin("mul", x, fbin("mul", x, x))))))))
    return fbin("mul", fbin("mul", f32(0.5), x), fbin("add", f32(1), call("erf", fbin("mul", x, f32(1 / math.sqrt(2))))))


def _clip_infer(g, node, p):
    for index, key, default in ((1, "min", -math.inf), (2, "max", math.inf)):
        name = node.inputs[index] if index < len(node.inputs) else ""
        if name and name not in g.constants:
            p[key] = None  # a run-time bound: read from the input
        else:
            value = const_input(g, node, index, key)
            p[key] = float(value.reshape(-1)[0]) if value is not None else float(node.attrs.get(key, default))
    return g.types[node.inputs[0]]


def _clip(x, a, is_f, b, node):
    mk = f32 if is_f else (lambda v: Const(int(max(min(v, 2**62), -2**62))))

    def bound(value, index):
        # A run-time bound is a scalar input: its only element is at index [].
        return b.reader(node.inputs[index])([]) if value is None else mk(value)
    if a["min"] != -math.inf:
        x = fbin("max", x, bound(a["min"], 1))
    if a["max"] != math.inf:
        x = fbin("min", x, bound(a["max"], 2))
    return x


def _cast_infer(g, node, p):
    return TensorType(g.types[node.inputs[0]].shape, onnx_to_dtype(node.attrs["to"], node))


def _cast_reader(b, node):
    x = bcast_reader(b, node.inputs[0], b.shape(node.outputs[0]))
    s, d = COMPUTE_DT[b.type(node.inputs[0]).dtype], COMPUTE_DT[b.type(node.outputs[0]).dtype]
    if s == d:
        fn = lambda v: v  # noqa: E731
    elif d == "i1":
        zero = f32(0) if s == "f32" else Const(0)
        fn = lambda v: cmp("ne", v, zero)  # noqa: E731
    else:
        fn = lambda v: Cast(d, v)  # noqa: E731
    return {node.outputs[0]: lambda idx: fn(x(idx))}


def _not_infer(g, node, p):
    return TensorType(g.types[node.inputs[0]].shape, "bool")


def _erf_fold(x, a):
    return np.vectorize(math.erf, otypes=[np.float32])(x) if x.size else x


register(
    _unary("Relu", lambda x, a, is_f, b, n: fbin("max", x, f32(0) if is_f else Const(0)), lambda x, a: np.maximum(x, 0)),
    _unary("LeakyRelu", lambda x, a, is_f, b, n: select(cmp("lt", x, f32(0)), fbin("mul", x, f32(a.get("alpha", 0.01))), x),
           lambda x, a: np.where(x < 0, x * a.get("alpha", 0.01), x)),
    _unary("Sigmoid", lambda x, a, is_f, b, n: _sigmoid(x), lambda x, a: 1 / (1 + np.exp(-x))),
    _unary("HardSigmoid", lambda x, a, is_f, b, n: clamp(fbin("add", fbin("mul", x, f32(a.get("alpha", 0.2))),
                                                                f32(a.get("beta", 0.5))), f32(0), f32(1)),
           lambda x, a: np.clip(x * a.get("alpha", 0.2) + a.get("beta", 0.5), 0, 1)),
    _unary("HardSwish", lambda x, a, is_f, b, n: fbin("mul", x, clamp(fbin("add", fbin("mul", x, f32(1 / 6)), f32(0.5)),
                                                                      f32(0), f32(1))),
           lambda x, a: x * np.clip(x / 6 + 0.5, 0, 1)),
    _unary("Tanh", lambda x, a, is_f, b, n: call("tanh", x), lambda x, a: np.tanh(x)),
    _unary("Erf", lambda x, a, is_f, b, n: call("erf", x), _erf_fold),
    _unary("Gelu", _gelu, infer=_gelu_infer),
    _unary("Exp", lambda x, a, is_f, b, n: call("exp", x), lambda x, a: np.exp(x)),
    _unary("Log", lambda x, a, is_f, b, n: call("log", x), lambda x, a: np.log(x)),
    _unary("Sqrt", lambda x, a, is_f, b, n: call("sqrt", x), lambda x, a: np.sqrt(x)),
    _unary("Reciprocal", lambda x, a, is_f, b, n: fbin("div", f32(1), x), lambda x, a: 1 / x),
    _unary("Neg", lambda x, a, is_f, b, n: call("neg", x) if is_f else sub(Const(0), x), lambda x, a: -x),
    _unary("Abs", lambda x, a, is_f, b, n: call("abs", x) if is_f else select(cmp("lt", x, Const(0)), sub(Const(0), x), x),
           lambda x, a: np.abs(x)),
    _unary("Not", lambda x, a, is_f, b, n: call("not", x), lambda x, a: np.logical_not(x), infer=_not_infer),
    _unary("Clip", _clip, lambda x, a: np.clip(x, a["min"], a["max"]), infer=_clip_infer),
    OpDef("Cast", ELEMWISE, _cast_infer, lambda a, v, g, node: [v[0].astype(g.types[node.outputs[0]].dtype)],
          _cast_reader),
)


# ---- binary ------------------------------------------------------------------------------

# Names other modules match on (simplify_inference folds BatchNorm, or rewrites it as Mul, Add).
ADD, MUL, WHERE, BATCH_NORMALIZATION = "Add", "Mul", "Where", "BatchNormalization"

def _binary_infer(g, node, p):
    a, b = g.types[node.inputs[0]], g.types[node.inputs[1]]
    shape = broadcast([a.shape, b.shape], node)
    if a.dtype != b.dtype:
        raise ShapeError(f"{node.describe()}: input dtypes {a.dtype} and {b.dtype} differ")
    return TensorType(shape, a.dtype)


def _compare_infer(g, node, p):
    a, b = g.types[node.inputs[0]], g.types[node.inputs[1]]
    return TensorType(broadcast([a.shape, b.shape], node), "bool")


def _readers(b, node):
    oshape = b.shape(node.outputs[0])
    return [bcast_reader(b, i, oshape) for i in node.inputs]


def _arith(name, op, fold, infer=None):
    """Add, Sub, ...; Max and Min take any number of inputs (infer=_variadic_infer), folded
    left to right."""
    def reader(b, node):
        rs = _readers(b, node)

        def value(idx):
            v = rs[0](idx)
            for r in rs[1:]:
                v = fbin(op, v, r(idx))
            return v
        return {node.outputs[0]: value}

    def evaluate(a, values, g, node):
        out = values[0]
        for v in values[1:]:
            out = fold(out, v, a)
        return [out]
    return OpDef(name, BROADCAST, infer or _binary_infer, evaluate, reader)


def _variadic_infer(g, node, p):
    types = [g.types[i] for i in node.inputs]
    return TensorType(broadcast([t.shape for t in types], node), types[0].dtype)


def _compare(name, op, fold):
    def reader(b, node):
        rs = _readers(b, node)
        return {node.outputs[0]: lambda idx: cmp(op, rs[0](idx), rs[1](idx))}
    return OpDef(name, BROADCAST, _compare_infer, lambda a, v, g, node: [fold(v[0], v[1])], reader)


def _div_fold(x, y, a):
    if np.issubdtype(x.dtype, np.integer):
        return np.trunc(x / y).astype(x.dtype)  # ONNX integer Div truncates toward zero
    return x / y


def _pow_infer(g, node, p):
    a, b = g.types[node.inputs[0]], g.types[node.inputs[1]]
    return TensorType(broadcast([a.shape, b.shape], node), a.dtype)


def _pow_reader(b, node):
    rs = _readers(b, node)
    exponent = b.g.constants.get(node.inputs[1])
    e = float(exponent.reshape(-1)[0]) if exponent is not None and exponent.size == 1 else None
    x_float, y_float = b.type(node.inputs[0]).dtype == "float32", b.type(node.inputs[1]).dtype == "float32"

    def value(idx):
        x, y = rs[0](idx), rs[1](idx)
        if e == 1:
            return x
        if e == 2:
            return fbin("mul", x, x)
        if e == 3:
            return fbin("mul", x, fbin("mul", x, x))
        if e == 0.5:
            return call("sqrt", x)
        if not y_float:
            y = Cast("f32", y)
        if not x_float:
            # Integer powers through float32: exact while results stay below 2**24.
            return Cast("i64", call("round", fbin("pow", Cast("f32", x), y)))
        return fbin("pow", x, y)
    return {node.outputs[0]: value}


def _mod_infer(g, node, p):
    t = _binary_infer(g, node, p)
    if t.dtype == "float32" and not node.attrs.get("fmod", 0):
        raise UnsupportedError(f"{node.describe()}: Mod on floats needs fmod=1 (ONNX rule)")
    return t


def _mod_reader(b, node):
    rs = _readers(b, node)
    is_float, fmod = b.type(node.inputs[0]).dtype == "float32", node.attrs.get("fmod", 0)

    def value(idx):
        x, y = rs[0](idx), rs[1](idx)
        if is_float:
            return call("fmod", x, y)
        r = fbin("rem", x, y)
        if fmod:
            return r
        # Python-style modulo: the result takes the divisor's sign.
        fix = and_(cmp("ne", r, Const(0)), cmp("ne", cmp("lt", r, Const(0)), cmp("lt", y, Const(0))))
        return select(fix, add(r, y), r)
    return {node.outputs[0]: value}


register(
    _arith(ADD, "add", lambda x, y, a: np.add(x, y)), _arith("Sub", "sub", lambda x, y, a: np.subtract(x, y)),
    _arith(MUL, "mul", lambda x, y, a: np.multiply(x, y)), _arith("Div", "div", _div_fold),
    _arith("Max", "max", lambda x, y, a: np.maximum(x, y), _variadic_infer),
    _arith("Min", "min", lambda x, y, a: np.minimum(x, y), _variadic_infer),
    _compare("Equal", "eq", np.equal), _compare("Less", "lt", np.less), _compare("Greater", "gt", np.greater),
    OpDef("Pow", BROADCAST, _pow_infer, lambda a, v, g, node: [np.power(v[0], v[1])], _pow_reader),
    OpDef("Mod", BROADCAST, _mod_infer,
          lambda a, v, g, node: [np.fmod(v[0], v[1]) if a.get("fmod", 0) else np.mod(v[0], v[1])], _mod_reader),
)


# ---- Where, BatchNormalization -------------------------------------------------------------

def _where_infer(g, node, p):
    c, a, b = (g.types[i] for i in node.inputs)
    return TensorType(broadcast([c.shape, a.shape, b.shape], node), a.dtype)


def _where_reader(b, node):
    c, x, y = _readers(b, node)
    return {node.outputs[0]: lambda idx: select(c(idx), x(idx), y(idx))}


def _batchnorm_infer(g, node, p):
    if node.attrs.get("training_mode", 0):
        raise UnsupportedError(f"{node.describe()}: training_mode=1 is not supported (inference only)")
    return g.types[node.inputs[0]]


def _batchnorm_reader(b, node):
    x = b.reader(node.inputs[0])
    scale, bias, mean, var = (b.reader(i) for i in node.inputs[1:5])
    eps = f32(node.attrs.get("epsilon", 1e-5))

    def bn(idx):
        c = [idx[1]]
        inv = fbin("div", scale(c), call("sqrt", fbin("add", var(c), eps)))
        return fbin("add", fbin("mul", fbin("sub", x(idx), mean(c)), inv), bias(c))
    return {node.outputs[0]: bn}


register(OpDef(WHERE, BROADCAST, _where_infer, lambda a, v, g, node: [np.where(*v)], _where_reader),
         OpDef(BATCH_NORMALIZATION, BROADCAST, _batchnorm_infer, None, _batchnorm_reader))


# ---- more comparisons, logic and activations ------------------------------------------------

def _softplus(x):
    # max(x, 0) + log(1 + exp(-|x|)): exp never overflows, large x gives x.
    return fbin("add", fbin("max", x, f32(0)), call("log", fbin("add", f32(1), call("exp", call("neg", call("abs", x))))))


def _exp_minus_one(x):
    return fbin("sub", call("exp", x), f32(1))


def _is_inf(x, a, is_f, b, node):
    tests = [cmp("eq", x, f32(inf)) for inf, wanted in ((math.inf, a.get("detect_positive", 1)),
                                                         (-math.inf, a.get("detect_negative", 1))) if wanted]
    if not tests:
        return cmp("ne", f32(0), f32(0))  # detects nothing: always false
    return tests[0] if len(tests) == 1 else fbin("or", *tests)


def _sign(x, a, is_f, b, node):
    one, zero = (f32(1), f32(0)) if is_f else (Const(1), Const(0))
    minus = f32(-1) if is_f else Const(-1)
    return select(cmp("gt", x, zero), one, select(cmp("lt", x, zero), minus, x))


def _selu(x, a, is_f, b, node):
    alpha, gamma = a.get("alpha", 1.67326319217681884765625), a.get("gamma", 1.05070102710723876953125)
    return fbin("mul", f32(gamma), select(cmp("gt", x, f32(0)), x, fbin("mul", f32(alpha), _exp_minus_one(x))))


def _shrink(x, a, is_f, b, node):
    lambd, bias = a.get("lambd", 0.5), a.get("bias", 0.0)
    return select(cmp("lt", x, f32(-lambd)), fbin("add", x, f32(bias)),
                  select(cmp("gt", x, f32(lambd)), fbin("sub", x, f32(bias)), f32(0)))


def _bool_infer(g, node, p):
    return TensorType(g.types[node.inputs[0]].shape, "bool")


def _logic(name, expr, fold):
    def reader(b, node):
        rs = _readers(b, node)
        return {node.outputs[0]: lambda idx: expr(rs[0](idx), rs[1](idx))}
    return OpDef(name, BROADCAST, _compare_infer, lambda a, v, g, node: [fold(v[0], v[1])], reader)


def _prelu_infer(g, node, p):
    x, slope = g.types[node.inputs[0]], g.types[node.inputs[1]]
    if broadcast([x.shape, slope.shape], node) != x.shape:
        raise ShapeError(f"{node.describe()}: slope {slope} does not broadcast to the input {x}")
    return x


def _prelu_reader(b, node):
    x, slope = _readers(b, node)
    return {node.outputs[0]: lambda idx: select(cmp("lt", x(idx), f32(0)), fbin("mul", slope(idx), x(idx)), x(idx))}


def _np_softplus(x):
    return np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x)))


register(
    _compare("GreaterOrEqual", "ge", np.greater_equal), _compare("LessOrEqual", "le", np.less_equal),
    _logic("And", lambda p, q: fbin("and", p, q), np.logical_and),
    _logic("Or", lambda p, q: fbin("or", p, q), np.logical_or),
    _logic("Xor", lambda p, q: cmp("ne", p, q), np.logical_xor),
    _unary("IsNaN", lambda x, a, is_f, b, n: cmp("ne", x, x), lambda x, a: np.isnan(x), infer=_bool_infer),
    _unary("IsInf", _is_inf, lambda x, a: (np.isposinf(x) & bool(a.get("detect_positive", 1))) |
           (np.isneginf(x) & bool(a.get("detect_negative", 1))), infer=_bool_infer),
    _unary("Floor", lambda x, a, is_f, b, n: call("floor", x), lambda x, a: np.floor(x)),
    _unary("Ceil", lambda x, a, is_f, b, n: call("ceil", x), lambda x, a: np.ceil(x)),
    _unary("Round", lambda x, a, is_f, b, n: call("round", x), lambda x, a: np.round(x)),
    _unary("Sign", _sign, lambda x, a: np.sign(x)),
    _unary("Softplus", lambda x, a, is_f, b, n: _softplus(x), lambda x, a: _np_softplus(x)),
    _unary("Softsign", lambda x, a, is_f, b, n: fbin("div", x, fbin("add", f32(1), call("abs", x))),
           lambda x, a: x / (1 + np.abs(x))),
    _unary("Elu", lambda x, a, is_f, b, n: select(cmp("lt", x, f32(0)), fbin("mul", f32(a.get("alpha", 1.0)),
                                                                            _exp_minus_one(x)), x),
           lambda x, a: np.where(x < 0, a.get("alpha", 1.0) * np.expm1(x), x)),
    _unary("Selu", _selu, None),
    _unary("Celu", lambda x, a, is_f, b, n: fbin("add", fbin("max", x, f32(0)), fbin("min", f32(0), fbin(
        "mul", f32(a.get("alpha", 1.0)), _exp_minus_one(fbin("div", x, f32(a.get("alpha", 1.0))))))), None),
    _unary("ThresholdedRelu", lambda x, a, is_f, b, n: select(cmp("gt", x, f32(a.get("alpha", 1.0))), x, f32(0)),
           lambda x, a: np.where(x > a.get("alpha", 1.0), x, 0).astype(x.dtype)),
    _unary("Shrink", _shrink, None),
    _unary("Mish", lambda x, a, is_f, b, n: fbin("mul", x, call("tanh", _softplus(x))),
           lambda x, a: x * np.tanh(_np_softplus(x))),
    OpDef("PRelu", BROADCAST, _prelu_infer, lambda a, v, g, node: [np.where(v[0] < 0, v[0] * v[1], v[0])],
          _prelu_reader),
)
