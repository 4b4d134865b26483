"""Elementwise and broadcast ops: unary math, activations, arithmetic, comparisons,
Where, Cast, BatchNormalization (when it is not folded into a convolution).

Each lowers to a reader: an expression per output element built from its inputs'
readers, so a chain of them inlines into one loop nest.
"""
from __future__ import annotations

import math

import numpy as np

from ..attrs import check_attrs, const_input
from ..casts import float_to_integer
from ..dtypes import DTYPES, is_int, numpy_dtype
from ..graph import Node, ShapeError, TensorType, UnsupportedError
from ..loop import (SMALL_FLOAT_TYPES, Bin, Call, Cast, Const, Load, Select, Var, call, calls_math, cmp, fbin,
                    fold_balanced, select, stored_value, sub)
from ..minifloats import E8M0, E8M0_ROUNDINGS, MINIFLOATS, e8m0_rounding
from ..lower.elementwise import and_, bcast_reader, clamp, f32
from ..onnx_dtypes import onnx_to_dtype
from ..symbolic import Dim, floor_div
from .broadcast import broadcast
from .reduce import REDUCE_MEAN
from .shape import RESHAPE
from .registry import BROADCAST, ELEMWISE, OpDef, register

# Ops other ops are built from (QLinear ops, recurrent nets, control flow).
CAST, DIV, SIGMOID, TANH, LEAKY_RELU, AND = "Cast", "Div", "Sigmoid", "Tanh", "LeakyRelu", "And"
SUB, MIN, MAX, CLIP, ROUND, EQUAL, LESS = "Sub", "Min", "Max", "Clip", "Round", "Equal", "Less"
SQRT, RECIPROCAL, MOD, BIT_SHIFT, BITWISE_AND = "Sqrt", "Reciprocal", "Mod", "BitShift", "BitwiseAnd"
FLOOR, CEIL, NEG = "Floor", "Ceil", "Neg"
RELU, EXP, LOG, ABS, SUM = "Relu", "Exp", "Log", "Abs", "Sum"
GREATER, GREATER_OR_EQUAL, LESS_OR_EQUAL, GELU = "Greater", "GreaterOrEqual", "LessOrEqual", "Gelu"


def _same(g, node, p):
    return g.types[node.inputs[0]]


# Unary float ops by name: (element expression, the attributes it takes). Recurrent nets name
# their gates' activations by these op names (ir/ops/recurrent.py).
UNARY: dict = {}


def unary_expression(name: str, x, **attrs):
    """The element of unary op `name` on a float32 x, with these attributes (defaults as the op's)."""
    return UNARY[name][0](x, attrs, True, None, None)


def _costly(expr) -> bool:
    try:  # the element of an op that reads only its input and attributes (not the builder)
        return calls_math(expr(Var("x", "f32"), {}, True, None, None))
    except (AttributeError, TypeError, KeyError):
        return False


def _unary(name, expr, fold=None, infer=_same, params=()):
    """An op of one input: `expr(x, attrs, is_float, b, node)` is its element; `fold(x, attrs)`
    its numpy evaluation; `params` the float attributes it takes (alpha, beta)."""
    UNARY[name] = (expr, params)

    def reader(b, node):
        x = bcast_reader(b, node.inputs[0], b.shape(node.outputs[0]))
        is_f, a = b.is_float(node.inputs[0]), b.attrs(node)
        return {node.outputs[0]: lambda idx: expr(x(idx), a, is_f, b, node)}
    evaluate = (lambda a, v, g, node: [fold(v[0], a)]) if fold else None
    return OpDef(name, ELEMWISE, infer, evaluate, reader, costly=_costly(expr))


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


_CAST_ATTRS = {"saturate": (0, 1), "round_mode": E8M0_ROUNDINGS}


def _cast_infer(g, node, p):
    check_attrs(node, _CAST_ATTRS)
    return TensorType(g.types[node.inputs[0]].shape, onnx_to_dtype(node.attrs["to"], node))


def _castlike_infer(g, node, p):
    check_attrs(node, _CAST_ATTRS)
    return TensorType(g.types[node.inputs[0]].shape, g.types[node.inputs[1]].dtype)


def to_small_float(value, dtype_name: str, saturate: bool, round_mode: str = "up"):
    """An f32 value rounded to an 8- or 4-bit float (ir/minifloats.py), as its Store keeps
    it: past the greatest finite value, that value where `saturate` (NaN stays NaN), else
    the format's Inf or NaN. E8M0 rounds its exponent as `round_mode` says."""
    storage = DTYPES[dtype_name].storage
    if storage == E8M0:
        return call(e8m0_rounding(round_mode, saturate), value)
    if saturate:  # (compares, not `clamp`: a NaN must stay NaN, not become a bound)
        top = MINIFLOATS[storage].greatest
        value = select(cmp("gt", value, f32(top)), f32(top), select(cmp("lt", value, f32(-top)), f32(-top), value))
    return call(f"round_{storage}", value)


def _e8m0_codes(x: np.ndarray, saturate: bool, round_mode: str) -> np.ndarray:
    """float32 -> E8M0 codes as onnx's reference converts (ir/minifloats.py)."""
    bits = x.view(np.uint32)
    exponent = ((bits >> 23) & 0xFF).astype(np.int32)
    if round_mode == "up":
        up = (bits & 0x7FFFFF) != 0
    elif round_mode == "nearest":
        up = ((bits & 0x400000) != 0) & (((bits & 0x3FFFFF) != 0) | (exponent > 0))
    else:
        up = np.zeros(bits.shape, bool)
    if saturate:
        up &= exponent != 0xFE
    return np.where(exponent == 0xFF, 0xFF, exponent + up).astype(np.uint8)


def small_float_array(x: np.ndarray, dtype_name: str, saturate: bool, round_mode: str = "up") -> np.ndarray:
    """numpy's to_small_float: ml_dtypes' conversion, after a clip where `saturate`."""
    x = np.asarray(x, np.float32)
    if DTYPES[dtype_name].storage == E8M0:
        return _e8m0_codes(x, saturate, round_mode).view(numpy_dtype(dtype_name))
    if saturate:
        top = MINIFLOATS[DTYPES[dtype_name].storage].greatest
        x = np.clip(x, -top, top)  # (NaN stays NaN)
    with np.errstate(all="ignore"):
        return x.astype(numpy_dtype(dtype_name))


_HALF_ROUNDING = {"float16": "round_f16", "bfloat16": "round_bf16"}


def _rounded(v, rounding: str) -> bool:
    """Whether a 16-bit float's value is certainly as stored: loaded, just rounded, or chosen
    among such values (a Clip or ReLU after a float16 conv's rounding)."""
    if isinstance(v, Load) or isinstance(v, Call) and v.fn == rounding:
        return True
    if isinstance(v, Const):  # (a bfloat16 is an f32 whose low 16 bits are clear)
        wide = np.array(v.value, np.float32)
        return bool(wide.astype(np.float16) == wide) if rounding == "round_f16" else not wide.view(np.uint32) & 0xFFFF
    if isinstance(v, Bin) and v.op in ("max", "min") or isinstance(v, Select):
        return _rounded(v.a, rounding) and _rounded(v.b, rounding)
    return False


def _cast_reader(b, node):
    """A conversion between compute types; a cast to float16, bfloat16 or a smaller float
    also rounds to that precision, and one to a 4- or 2-bit integer wraps at its width (the
    value may be used before it is stored)."""
    x = bcast_reader(b, node.inputs[0], b.shape(node.outputs[0]))
    src, dst = b.type(node.inputs[0]).dtype, b.type(node.outputs[0]).dtype
    s, d = b.compute(node.inputs[0]), b.compute(node.outputs[0])
    rounding = _HALF_ROUNDING.get(dst) if dst != src else None
    # A 16-bit float cast to another type is the value as stored, even where a fused producer
    # hands it over unrounded (a float16 product's operand: passes/widen_half_products.py).
    read_rounding = _HALF_ROUNDING.get(src) if dst != src else None
    small = DTYPES[dst].storage in SMALL_FLOAT_TYPES and dst != src
    saturate, round_mode = bool(node.attrs.get("saturate", 1)), node.attrs.get("round_mode", "up")

    def value(idx):
        v = x(idx)
        if read_rounding and not _rounded(v, read_rounding):
            v = call(read_rounding, v)
        v = v if s == d else Cast(d, v)
        if small:
            return to_small_float(v, dst, saturate, round_mode)
        return call(rounding, v) if rounding else stored_value(DTYPES[dst].storage, v)
    return {node.outputs[0]: value}


def _cast_fold(a, values, g, node):
    dst = g.types[node.outputs[0]].dtype
    to = numpy_dtype(dst)
    # Sizes stay sizes (symbolic values), as floats too: arange(float(w)) counts w.
    if values[0].dtype == object and (np.issubdtype(to, np.integer) or to in (np.float32, np.float64)):
        return [values[0]]
    if DTYPES[dst].storage in SMALL_FLOAT_TYPES:
        return [small_float_array(values[0], dst, bool(node.attrs.get("saturate", 1)),
                                  node.attrs.get("round_mode", "up"))]
    if DTYPES[g.types[node.inputs[0]].dtype].is_float and DTYPES[dst].is_int:
        return [float_to_integer(values[0], dst)]  # as the kernels cast, out of range too
    with np.errstate(all="ignore"):  # a float overflowing a narrower float: its Inf
        return [values[0].astype(to)]


def _not_infer(g, node, p):
    return TensorType(g.types[node.inputs[0]].shape, "bool")


def _erf_fold(x, a):
    return np.vectorize(math.erf, otypes=[x.dtype])(x) if x.size else x


register(
    _unary(RELU, lambda x, a, is_f, b, n: fbin("max", x, f32(0) if is_f else Const(0)), lambda x, a: np.maximum(x, 0)),
    _unary(LEAKY_RELU, lambda x, a, is_f, b, n: select(cmp("lt", x, f32(0)), fbin("mul", x, f32(a.get("alpha", 0.01))), x),
           lambda x, a: np.where(x < 0, x * a.get("alpha", 0.01), x), params=("alpha",)),
    _unary(SIGMOID, lambda x, a, is_f, b, n: _sigmoid(x), lambda x, a: 1 / (1 + np.exp(-x))),
    _unary("HardSigmoid", lambda x, a, is_f, b, n: clamp(fbin("add", fbin("mul", x, f32(a.get("alpha", 0.2))),
                                                                f32(a.get("beta", 0.5))), f32(0), f32(1)),
           lambda x, a: np.clip(x * a.get("alpha", 0.2) + a.get("beta", 0.5), 0, 1), params=("alpha", "beta")),
    _unary("HardSwish", lambda x, a, is_f, b, n: fbin("mul", x, clamp(fbin("add", fbin("mul", x, f32(1 / 6)), f32(0.5)),
                                                                      f32(0), f32(1))),
           lambda x, a: x * np.clip(x / 6 + 0.5, 0, 1)),
    _unary(TANH, lambda x, a, is_f, b, n: call("tanh", x), lambda x, a: np.tanh(x)),
    _unary("Erf", lambda x, a, is_f, b, n: call("erf", x), _erf_fold),
    _unary(GELU, _gelu, infer=_gelu_infer),
    _unary(EXP, lambda x, a, is_f, b, n: call("exp", x), lambda x, a: np.exp(x)),
    _unary(LOG, lambda x, a, is_f, b, n: call("log", x), lambda x, a: np.log(x)),
    _unary(SQRT, lambda x, a, is_f, b, n: call("sqrt", x), lambda x, a: np.sqrt(x)),
    _unary(RECIPROCAL, lambda x, a, is_f, b, n: fbin("div", f32(1), x), lambda x, a: 1 / x),
    _unary(NEG, lambda x, a, is_f, b, n: call("neg", x) if is_f else sub(Const(0), x), lambda x, a: -x),
    _unary(ABS, lambda x, a, is_f, b, n: call("abs", x) if is_f else select(cmp("lt", x, Const(0)), sub(Const(0), x), x),
           lambda x, a: np.abs(x)),
    _unary("Not", lambda x, a, is_f, b, n: call("not", x), lambda x, a: np.logical_not(x), infer=_not_infer),
    _unary(CLIP, _clip, lambda x, a: np.clip(x, a["min"], a["max"]), infer=_clip_infer),
    # (round_mode, opset 24: E8M0's rounding, which no other type reads)
    OpDef(CAST, ELEMWISE, _cast_infer, _cast_fold, _cast_reader, later_attributes=frozenset({"round_mode"})),
    OpDef("CastLike", BROADCAST, _castlike_infer, _cast_fold, _cast_reader, later_attributes=frozenset({"round_mode"})),
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
    """Add, Sub, ...; Max, Min and Sum take any number of inputs (infer=_variadic_infer),
    combined as a balanced tree (two inputs: the one operation)."""
    def reader(b, node):
        rs = _readers(b, node)
        return {node.outputs[0]: lambda idx: fold_balanced(op, [r(idx) for r in rs])}

    def evaluate(a, values, g, node):
        out = values[0]
        for v in values[1:]:
            out = fold(out, v, a)
        return [out]
    return OpDef(name, BROADCAST, infer or _binary_infer, evaluate, reader)


def _variadic_infer(g, node, p):
    types = [g.types[i] for i in node.inputs]
    return TensorType(broadcast([t.shape for t in types], node), types[0].dtype)


COMPARISONS = {}  # op name -> its relation ("eq", "lt", "gt", "ge", "le"): sizes compared at build time


def _compare(name, op, fold):
    COMPARISONS[name] = op

    def reader(b, node):
        rs = _readers(b, node)
        return {node.outputs[0]: lambda idx: cmp(op, rs[0](idx), rs[1](idx))}
    return OpDef(name, BROADCAST, _compare_infer, lambda a, v, g, node: [fold(v[0], v[1])], reader)


def _div_fold(x, y, a):
    if x.dtype == object or y.dtype == object:  # sizes (symbolic values): exact division where it is one
        return np.vectorize(_exact_quotient, otypes=[object])(x, y)
    if np.issubdtype(x.dtype, np.integer):
        return np.trunc(x / y).astype(x.dtype)  # ONNX integer Div truncates toward zero
    return x / y


def _exact_quotient(x, y):
    if isinstance(x, int) and isinstance(y, int):
        return int(np.trunc(x / y))
    if isinstance(x, Dim) and isinstance(y, int) and y > 0:
        # A size divided by a positive int: ONNX truncates, which is floor for sizes, and
        # floor_div is exact or a derived symbol (raising where x may be negative: the Div
        # then runs at run time), as exporters compute a strided conv's output size.
        return floor_div(x, y)
    return x // y  # (a Dim divides exactly, or raises: the Div then runs at run time)


def _pow_infer(g, node, p):
    a, b = g.types[node.inputs[0]], g.types[node.inputs[1]]
    return TensorType(broadcast([a.shape, b.shape], node), a.dtype)


def _pow_reader(b, node):
    rs = _readers(b, node)
    exponent = b.g.constants.get(node.inputs[1])
    e = float(exponent.reshape(-1)[0]) if exponent is not None and exponent.size == 1 else None
    x_float, t = b.is_float(node.inputs[0]), b.compute(node.inputs[0])
    y_t = b.compute(node.inputs[1])

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
        if x_float:
            return fbin("pow", x, y if y_t == t else Cast(t, y))
        # Integer powers through float64: exact while results stay below 2**53.
        y = y if y_t == "f64" else Cast("f64", y)
        return Cast(t, call("round", fbin("pow", Cast("f64", x), y)))
    return {node.outputs[0]: value}


def _mod_reader(b, node):
    """fmod=1: the C remainder (the dividend's sign). fmod=0: Python's modulo, the divisor's
    sign, for integers and (since the spec defined it) floats alike."""
    rs = _readers(b, node)
    floats, fmod = b.is_float(node.inputs[0]), node.attrs.get("fmod", 0)

    def value(idx):
        x, y = rs[0](idx), rs[1](idx)
        r = call("fmod", x, y) if floats else fbin("rem", x, y)
        if fmod:
            return r
        fix = and_(cmp("ne", r, Const(0)), cmp("ne", cmp("lt", r, Const(0)), cmp("lt", y, Const(0))))
        return select(fix, fbin("add", r, y), r)
    return {node.outputs[0]: value}


register(
    _arith(ADD, "add", lambda x, y, a: np.add(x, y)), _arith(SUB, "sub", lambda x, y, a: np.subtract(x, y)),
    _arith(MUL, "mul", lambda x, y, a: np.multiply(x, y)), _arith(DIV, "div", _div_fold),
    _arith(MAX, "max", lambda x, y, a: np.maximum(x, y), _variadic_infer),
    _arith(MIN, "min", lambda x, y, a: np.minimum(x, y), _variadic_infer),
    _compare(EQUAL, "eq", np.equal), _compare(LESS, "lt", np.less), _compare(GREATER, "gt", np.greater),
    OpDef("Pow", BROADCAST, _pow_infer, lambda a, v, g, node: [np.power(v[0], v[1])], _pow_reader, costly=True),
    OpDef(MOD, BROADCAST, _binary_infer,
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
    return g.types[node.inputs[0]]


def _batchnorm_training(g, node) -> list[Node] | None:
    """training_mode=1 normalizes with the statistics of this batch (over every axis but the
    channels, variance without Bessel's correction, as onnx's reference computes it) and
    also outputs the running statistics updated with them. Exporters write it where a model
    standardizes its own weights (timm's NFNets: constants, so it all folds away). Built from
    ReduceMean and arithmetic; None in inference mode (the op as it is)."""
    if not node.attrs.get("training_mode", 0):
        return None
    x, scale, bias, mean_in, var_in = node.inputs[:5]
    rank, dt = len(g.types[x].shape), numpy_dtype(g.types[x].dtype)
    at = lambda part: f"{node.key}/{part}"  # noqa: E731  (the body's own tensors)
    const = lambda part, value: g.add_constant(at(part), np.asarray(value))  # noqa: E731
    channels, per_channel = const("channels", [1, -1] + [1] * (rank - 2)), const("flat", [-1])
    axes = [0] + list(range(2, rank))
    momentum = node.attrs.get("momentum", 0.9)
    nodes = [
        Node(REDUCE_MEAN, [x], [at("mean")], {"axes": axes, "keepdims": 1}),
        Node(SUB, [x, at("mean")], [at("centred")]),
        Node(MUL, [at("centred"), at("centred")], [at("squares")]),
        Node(REDUCE_MEAN, [at("squares")], [at("var")], {"axes": axes, "keepdims": 1}),
        Node(ADD, [at("var"), const("epsilon", dt.type(node.attrs.get("epsilon", 1e-5)))], [at("var_eps")]),
        Node("Sqrt", [at("var_eps")], [at("std")]),
        Node(RESHAPE, [scale, channels], [at("scale")]),
        Node(DIV, [at("scale"), at("std")], [at("factor")]),
        Node(MUL, [at("centred"), at("factor")], [at("scaled")]),
        Node(RESHAPE, [bias, channels], [at("bias")]),
        Node(ADD, [at("scaled"), at("bias")], [node.outputs[0]]),
    ]
    for i, (given, batch) in enumerate(((mean_in, "mean"), (var_in, "var")), start=1):
        if len(node.outputs) > i and node.outputs[i]:  # the running statistic, updated
            nodes += [Node(RESHAPE, [at(batch), per_channel], [at(f"{batch}_flat")]),
                      Node(MUL, [given, const(f"momentum_{batch}", dt.type(momentum))], [at(f"{batch}_kept")]),
                      Node(MUL, [at(f"{batch}_flat"), const(f"rest_{batch}", dt.type(1 - momentum))],
                           [at(f"{batch}_new")]),
                      Node(ADD, [at(f"{batch}_kept"), at(f"{batch}_new")], [node.outputs[i]])]
    for n in nodes:
        n.name = f"{node.name}/{n.outputs[0].rsplit('/', 1)[-1]}"
    return nodes


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
         OpDef(BATCH_NORMALIZATION, BROADCAST, _batchnorm_infer, None, _batchnorm_reader, expand=_batchnorm_training))


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
    _compare(GREATER_OR_EQUAL, "ge", np.greater_equal), _compare(LESS_OR_EQUAL, "le", np.less_equal),
    _logic(AND, lambda p, q: fbin("and", p, q), np.logical_and),
    _logic("Or", lambda p, q: fbin("or", p, q), np.logical_or),
    _logic("Xor", lambda p, q: cmp("ne", p, q), np.logical_xor),
    _unary("IsNaN", lambda x, a, is_f, b, n: cmp("ne", x, x), lambda x, a: np.isnan(x), infer=_bool_infer),
    _unary("IsInf", _is_inf, lambda x, a: (np.isposinf(x) & bool(a.get("detect_positive", 1))) |
           (np.isneginf(x) & bool(a.get("detect_negative", 1))), infer=_bool_infer),
    _unary(FLOOR, lambda x, a, is_f, b, n: call("floor", x), lambda x, a: np.floor(x)),
    _unary(CEIL, lambda x, a, is_f, b, n: call("ceil", x), lambda x, a: np.ceil(x)),
    _unary(ROUND, lambda x, a, is_f, b, n: call("round", x), lambda x, a: np.round(x)),
    _unary("Sign", _sign, lambda x, a: np.sign(x)),
    _unary("Softplus", lambda x, a, is_f, b, n: _softplus(x), lambda x, a: _np_softplus(x)),
    _unary("Softsign", lambda x, a, is_f, b, n: fbin("div", x, fbin("add", f32(1), call("abs", x))),
           lambda x, a: x / (1 + np.abs(x))),
    _unary("Elu", lambda x, a, is_f, b, n: select(cmp("lt", x, f32(0)), fbin("mul", f32(a.get("alpha", 1.0)),
                                                                            _exp_minus_one(x)), x),
           lambda x, a: np.where(x < 0, a.get("alpha", 1.0) * np.expm1(x), x), params=("alpha",)),
    _unary("Selu", _selu, None),
    _unary("Celu", lambda x, a, is_f, b, n: fbin("add", fbin("max", x, f32(0)), fbin("min", f32(0), fbin(
        "mul", f32(a.get("alpha", 1.0)), _exp_minus_one(fbin("div", x, f32(a.get("alpha", 1.0))))))), None),
    _unary("ThresholdedRelu", lambda x, a, is_f, b, n: select(cmp("gt", x, f32(a.get("alpha", 1.0))), x, f32(0)),
           lambda x, a: np.where(x > a.get("alpha", 1.0), x, 0).astype(x.dtype), params=("alpha",)),
    _unary("Shrink", _shrink, None),
    _unary("Mish", lambda x, a, is_f, b, n: fbin("mul", x, call("tanh", _softplus(x))),
           lambda x, a: x * np.tanh(_np_softplus(x))),
    OpDef("PRelu", BROADCAST, _prelu_infer, lambda a, v, g, node: [np.where(v[0] < 0, v[0] * v[1], v[0])],
          _prelu_reader),
)


# ---- trigonometry, variadic Sum/Mean, Swish, bitwise ------------------------------------------

_TRIG = {"Sin": np.sin, "Cos": np.cos, "Tan": np.tan, "Asin": np.arcsin, "Acos": np.arccos, "Atan": np.arctan,
         "Sinh": np.sinh, "Cosh": np.cosh, "Asinh": np.arcsinh, "Acosh": np.arccosh, "Atanh": np.arctanh}


def _trig(name, fold):
    fn = name.lower()
    return _unary(name, lambda x, a, is_f, b, n: call(fn, x), lambda x, a: fold(x))


def _mean_reader(b, node):
    rs, n = _readers(b, node), len(node.inputs)
    return {node.outputs[0]: lambda idx: fbin("div", fold_balanced("add", [r(idx) for r in rs]),
                                              Const(float(n), "f32"))}


def _int_infer(g, node, p):
    t = _variadic_infer(g, node, p) if len(node.inputs) > 1 else g.types[node.inputs[0]]
    if not is_int(t.dtype):
        raise UnsupportedError(f"{node.describe()}: {node.op} of {t.dtype} (integer types only)")
    return t


def _bitshift(g, node, p):
    check_attrs(node, {"direction": ("LEFT", "RIGHT")})
    return _int_infer(g, node, p)


def _bitshift_reader(b, node):
    """Shifts defined for every amount, as opset 28 says: an amount outside 0..width-1 gives
    0, or the sign fill for a right shift of a signed type (LLVM leaves those undefined,
    hence the guards)."""
    x, y = _readers(b, node)
    width = 8 * DTYPES[b.type(node.inputs[0]).dtype].itemsize
    signed = DTYPES[b.type(node.inputs[0]).dtype].is_signed

    def value(idx):
        amount = y(idx)
        fits = fbin("and", cmp("ge", amount, Const(0)), cmp("lt", amount, Const(width)))
        if node.attrs["direction"] == "LEFT" or not signed:
            op = "shl" if node.attrs["direction"] == "LEFT" else "shr"
            return select(fits, fbin(op, x(idx), amount), Const(0))
        return fbin("shr", x(idx), select(fits, amount, Const(width - 1)))
    return {node.outputs[0]: value}


def _bitshift_fold(a, values, g, node):
    x, y = values
    width = 8 * x.dtype.itemsize
    fits = (y >= 0) & (y < width)
    safe = np.where(fits, y, 0).astype(x.dtype)
    if a["direction"] == "LEFT":
        return [np.where(fits, np.left_shift(x, safe), 0).astype(x.dtype)]
    fill = np.right_shift(x, width - 1) if np.issubdtype(x.dtype, np.signedinteger) else np.zeros_like(x)
    return [np.where(fits, np.right_shift(x, safe), fill).astype(x.dtype)]


def _swish(x, a, is_f, b, node):
    alpha = a.get("alpha", 1.0)
    return fbin("mul", x, _sigmoid(x if alpha == 1.0 else fbin("mul", x, f32(alpha))))


register(
    *(_trig(name, fold) for name, fold in _TRIG.items()),
    _arith(SUM, "add", lambda x, y, a: np.add(x, y), _variadic_infer),
    OpDef("Mean", BROADCAST, _variadic_infer, lambda a, v, g, node: [sum(v[1:], v[0]) / len(v)], _mean_reader),
    _unary("Swish", _swish, lambda x, a: x / (1 + np.exp(-a.get("alpha", 1.0) * x))),
    OpDef(BIT_SHIFT, BROADCAST, _bitshift, _bitshift_fold, _bitshift_reader),
    _arith(BITWISE_AND, "and", lambda x, y, a: np.bitwise_and(x, y), _int_infer),
    _arith("BitwiseOr", "or", lambda x, y, a: np.bitwise_or(x, y), _int_infer),
    _arith("BitwiseXor", "xor", lambda x, y, a: np.bitwise_xor(x, y), _int_infer),
    _unary("BitwiseNot", lambda x, a, is_f, b, n: fbin("xor", x, Const(-1)), lambda x, a: np.invert(x),
           infer=_int_infer),
)
