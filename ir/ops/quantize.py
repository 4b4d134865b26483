"""Quantized ops: QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear, MatMulInteger,
ConvInteger, QLinearMatMul, QLinearConv, and the com.microsoft QLinear* ops onnxruntime's
quantization tool writes in its QOperator format.

QuantizeLinear and DequantizeLinear are elementwise readers (a scale per tensor, per axis or
per block), so a requantize fuses into the epilogue of whatever produces its input.
MatMulInteger and ConvInteger are anchors summing 8-bit products in int32
(ir/lower/integer_gemm.py). The QLinear ops are built from those: an integer product, its
int32 bias, one float multiplier (scale_a * scale_b / scale_y) and a QuantizeLinear with
scale 1, which is the order of operations onnxruntime's own int8 kernels use.
DynamicQuantizeLinear is built from the function body onnx defines for it.
"""
from __future__ import annotations

import numpy as np

from ..attrs import check_attrs, normalize_axis
from ..dtypes import DTYPES, numpy_dtype
from ..graph import Node, ShapeError, TensorType, UnsupportedError
from ..loop import Cast, Const, call, fbin
from ..lower.elementwise import f32
from ..lower.integer_gemm import lower_conv_integer, lower_matmul_integer
from ..onnx_dtypes import onnx_to_dtype
from .conv_gemm import infer_conv, infer_matmul
from .elementwise import ADD, CAST, DIV, LEAKY_RELU, MUL, SIGMOID, WHERE, small_float_array, to_small_float
from .functions import expand_function
from .reduce import AVERAGE_POOL, GLOBAL_AVERAGE_POOL, SOFTMAX
from .shape import CONCAT
from .node_builder import NodeBuilder
from .registry import ELEMWISE, OPAQUE, OUT_EWISE_FUSABLE, OpDef, expanded_only, register

QUANTIZE_LINEAR, DEQUANTIZE_LINEAR = "QuantizeLinear", "DequantizeLinear"
MATMUL_INTEGER, CONV_INTEGER = "MatMulInteger", "ConvInteger"

# What Kiln quantizes to and from.
SMALL_FLOATS = ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float4_e2m1fn")
QUANTIZED = ("int8", "uint8", "int16", "uint16", "int4", "uint4", "int2", "uint2") + SMALL_FLOATS
DEQUANTIZED = QUANTIZED + ("int32",)  # an int32 accumulator dequantizes too
FLOATS = ("float32", "float16", "bfloat16")
BYTES = ("int8", "uint8")


def _optional(node: Node, index: int) -> str:
    return node.inputs[index] if index < len(node.inputs) and node.inputs[index] else ""


def _scale_layout(g, node, data: TensorType, scale_name: str, p: dict, what: str) -> None:
    """Check a scale (or zero point) against the data it applies to: one value (per tensor),
    a vector along `axis` (per axis), or the data's rank with `axis` cut in blocks of
    `block_size`. Records `axis` and `block` in the parameters."""
    s = g.types[scale_name].shape
    rank = len(data.shape)
    block = int(node.attrs.get("block_size", 0))
    size = int(np.prod(s, dtype=np.int64))
    per_tensor = size == 1 and not block  # (then the axis does not matter, and may not exist)
    axis = normalize_axis(int(node.attrs.get("axis", 1)), rank, node) if rank and not per_tensor else 0
    p["axis"], p["block"] = axis, block
    if block:
        want = list(data.shape)
        want[axis] = -(-data.shape[axis] // block)
        if list(s) != want:
            raise ShapeError(f"{node.describe()}: {what} has shape {list(s)}; with block_size={block} along axis "
                             f"{axis} of {data} it must be {want}")
    elif size != 1 and (len(s) != 1 or not rank or s[0] != data.shape[axis]):
        raise ShapeError(f"{node.describe()}: {what} has shape {list(s)}: it must hold one value, or one per "
                         f"element of axis {axis} of {data}")


def scale_index(idx, a: dict, scale_shape) -> list:
    """The index into a scale or zero point of the data element at `idx`."""
    if a["block"]:
        return [i // a["block"] if d == a["axis"] else i for d, i in enumerate(idx)]
    if int(np.prod(scale_shape, dtype=np.int64)) == 1:
        return [Const(0)] * len(scale_shape)
    return [idx[a["axis"]]]


def _np_scale(v: np.ndarray, a: dict, shape) -> np.ndarray:
    """A scale or zero point broadcast to the data's shape, for folding."""
    if a["block"]:
        return np.repeat(v, a["block"], axis=a["axis"])[tuple(slice(0, n) for n in shape)]
    if v.size == 1:
        return v.reshape(())
    view = [1] * len(shape)
    view[a["axis"]] = -1
    return v.reshape(view)


# ---- QuantizeLinear and DequantizeLinear -------------------------------------------------------

def _quantize_infer(g, node, p):
    check_attrs(node, {"saturate": (0, 1), "precision": (0,)})
    x, scale, zp = g.types[node.inputs[0]], node.inputs[1], _optional(node, 2)
    if x.dtype not in FLOATS + ("int32",):
        raise UnsupportedError(f"{node.describe()}: quantizing {x.dtype} is not supported ({', '.join(FLOATS)})")
    out = g.types[zp].dtype if zp else None
    if out is None:
        code = int(node.attrs.get("output_dtype", 0))
        out = onnx_to_dtype(code, node) if code else "uint8"
    if out not in QUANTIZED:
        raise UnsupportedError(f"{node.describe()}: quantizing to {out} is not supported ({', '.join(QUANTIZED)})")
    _scale_layout(g, node, x, scale, p, "y_scale")
    if zp:
        _scale_layout(g, node, x, zp, p, "y_zero_point")
    return TensorType(x.shape, out)


def quantize_expr(value, scale, zero_point, out_dtype: str, power_of_two: float | None = None, saturate=True):
    """round(value / scale) + zero_point, saturated to out_dtype's range (all in float32:
    exact for the 2- to 16-bit types, as onnxruntime computes it). A scale known to be the power of
    two `power_of_two` (1 after integer_products folded the scales into one multiplier)
    divides as a multiply by its reciprocal: exact, and a division costs a vector divide
    per 16 outputs of an int8 conv's epilogue. To a small float, value / scale + zero_point
    rounds to it (saturated only where `saturate`: the QuantizeLinear attribute)."""
    from ..dtypes import dtype as dtype_of
    if out_dtype in SMALL_FLOATS:
        q = fbin("div", value, scale)
        return to_small_float(q if zero_point is None else fbin("add", q, zero_point), out_dtype, saturate)
    t, (least, greatest) = dtype_of(out_dtype).compute, dtype_of(out_dtype).int_range
    if power_of_two is not None:
        q = call("round", fbin("mul", value, Const(1.0 / power_of_two, "f32")))
    else:
        q = call("round", fbin("div", value, scale))
    if zero_point is not None:
        q = fbin("add", q, Cast("f32", zero_point))
    return Cast(t, fbin("min", fbin("max", q, f32(least)), f32(greatest)))


def _quantize_reader(b, node):
    a = b.attrs(node)
    out = node.outputs[0]
    x, s = b.reader(node.inputs[0]), b.reader(node.inputs[1])
    zp_name = _optional(node, 2)
    zp = b.reader(zp_name) if zp_name else None
    sshape = b.shape(node.inputs[1])
    zshape = b.shape(zp_name) if zp_name else ()
    to_f32 = (lambda v: v) if b.compute(node.inputs[0]) == "f32" else (lambda v: Cast("f32", v))
    return {out: lambda idx: quantize_expr(
        to_f32(x(idx)), s(scale_index(idx, a, sshape)), zp(scale_index(idx, a, zshape)) if zp else None,
        b.type(out).dtype, _power_of_two(b.g.constants.get(node.inputs[1])), bool(node.attrs.get("saturate", 1)))}


def _power_of_two(scale) -> float | None:
    """The scale's one value if it is a constant power of two (float32), else None."""
    if scale is None or scale.size == 0:
        return None
    values = np.unique(np.asarray(scale, np.float32))
    # (normal, with a normal reciprocal: then x / s and x * (1/s) are one value, rounded once)
    if values.size != 1 or not np.finfo(np.float32).tiny <= values[0] <= 2.0 ** 126:
        return None
    mantissa, _ = np.frexp(values[0])
    return float(values[0]) if mantissa == 0.5 else None


def _quantize_fold(a, values, g, node):
    x, s = values[0].astype(np.float32), values[1].astype(np.float32)
    zp = values[2] if len(values) > 2 and values[2] is not None else None
    out = numpy_dtype(g.types[node.outputs[0]].dtype)
    if g.types[node.outputs[0]].dtype in SMALL_FLOATS:
        q = x / _np_scale(s, a, x.shape)
        if zp is not None:
            q = q + _np_scale(zp, a, x.shape).astype(np.float32)
        return [small_float_array(q, g.types[node.outputs[0]].dtype, bool(node.attrs.get("saturate", 1)))]
    q = np.round(x / _np_scale(s, a, x.shape))  # numpy rounds half to even, as ONNX does
    if zp is not None:
        q = q + _np_scale(zp, a, x.shape).astype(np.float32)
    least, greatest = DTYPES[g.types[node.outputs[0]].dtype].int_range
    return [np.clip(q, least, greatest).astype(out)]


def _dequantize_infer(g, node, p):
    x, scale, zp = g.types[node.inputs[0]], node.inputs[1], _optional(node, 2)
    if x.dtype not in DEQUANTIZED:
        raise UnsupportedError(f"{node.describe()}: dequantizing {x.dtype} is not supported "
                               f"({', '.join(DEQUANTIZED)})")
    st = g.types[scale].dtype
    if st not in FLOATS:
        raise UnsupportedError(f"{node.describe()}: x_scale of {st} is not supported ({', '.join(FLOATS)})")
    if zp and g.types[zp].dtype != x.dtype:
        raise ShapeError(f"{node.describe()}: x_zero_point is {g.types[zp].dtype}, x is {x.dtype}")
    _scale_layout(g, node, x, scale, p, "x_scale")
    if zp:
        _scale_layout(g, node, x, zp, p, "x_zero_point")
    code = int(node.attrs.get("output_dtype", 0))
    return TensorType(x.shape, onnx_to_dtype(code, node) if code else st)


def _dequantize_reader(b, node):
    a = b.attrs(node)
    x, s = b.reader(node.inputs[0]), b.reader(node.inputs[1])
    zp_name = _optional(node, 2)
    zp = b.reader(zp_name) if zp_name else None
    sshape = b.shape(node.inputs[1])
    zshape = b.shape(zp_name) if zp_name else ()

    def dequantize(idx):
        v = Cast("f32", x(idx))
        if zp is not None:
            v = fbin("sub", v, Cast("f32", zp(scale_index(idx, a, zshape))))
        return fbin("mul", v, s(scale_index(idx, a, sshape)))
    return {node.outputs[0]: dequantize}


def _dequantize_fold(a, values, g, node):
    x = values[0].astype(np.float32)
    zp = values[2] if len(values) > 2 and values[2] is not None else None
    if zp is not None:
        x = x - _np_scale(zp, a, x.shape).astype(np.float32)
    return [x * _np_scale(values[1].astype(np.float32), a, x.shape)]


register(
    OpDef(QUANTIZE_LINEAR, ELEMWISE, _quantize_infer, _quantize_fold, _quantize_reader),
    OpDef(DEQUANTIZE_LINEAR, ELEMWISE, _dequantize_infer, _dequantize_fold, _dequantize_reader),
    OpDef("DynamicQuantizeLinear", OPAQUE, expanded_only, expand=expand_function),
)


# ---- integer products -------------------------------------------------------------------------

def _zero_point_check(g, node, index: int, operand: TensorType, what: str, per: int | None) -> None:
    zp = _optional(node, index)
    if not zp:
        return
    t = g.types[zp]
    if t.dtype != operand.dtype:
        raise ShapeError(f"{node.describe()}: {what} is {t.dtype}, its operand {operand.dtype}")
    if t.size != 1 and (len(t.shape) != 1 or t.shape[0] != per):
        raise ShapeError(f"{node.describe()}: {what} has shape {list(t.shape)}: one value, or one per "
                         f"{'row' if index == 2 else 'column'} ({per})")


def _byte_operands(g, node) -> tuple[TensorType, TensorType]:
    a, w = g.types[node.inputs[0]], g.types[node.inputs[1]]
    for t in (a, w):
        if t.dtype not in BYTES:
            raise UnsupportedError(f"{node.describe()}: {node.op} of {t.dtype} is not supported (int8, uint8)")
    return a, w


def _matmul_integer_infer(g, node, p):
    a, w = _byte_operands(g, node)
    out = infer_matmul(g, node, p)
    _zero_point_check(g, node, 2, a, "a_zero_point", a.shape[-2] if len(a.shape) > 1 else 1)
    _zero_point_check(g, node, 3, w, "b_zero_point", w.shape[-1])
    return TensorType(out.shape, "int32")


def _with_zero_point(v: np.ndarray, zp, axis_shape) -> np.ndarray:
    v = v.astype(np.int32)
    if zp is None:
        return v
    return v - (zp.astype(np.int32).reshape(axis_shape) if zp.size > 1 else zp.astype(np.int32).reshape(()))


def _matmul_integer_fold(a, values, g, node):
    x, w = values[0], values[1]
    xa = _with_zero_point(x, values[2] if len(values) > 2 else None, (-1, 1))
    wa = _with_zero_point(w, values[3] if len(values) > 3 else None, (-1,))
    return [np.matmul(xa, wa).astype(np.int32)]


def _conv_integer_infer(g, node, p):
    x, w = _byte_operands(g, node)
    out = infer_conv(g, node, p, check_type=False)
    _zero_point_check(g, node, 2, x, "x_zero_point", 1)
    _zero_point_check(g, node, 3, w, "w_zero_point", w.shape[0])
    return TensorType(out.shape, "int32")


register(
    OpDef(MATMUL_INTEGER, OUT_EWISE_FUSABLE, _matmul_integer_infer, _matmul_integer_fold,
          anchor=lambda b, node, store, out: lower_matmul_integer(b, node, store)),
    OpDef(CONV_INTEGER, OUT_EWISE_FUSABLE, _conv_integer_infer,
          anchor=lambda b, node, store, out: lower_conv_integer(b, node, store)),
)


# ---- QLinear ops: built from the integer products ---------------------------------------------

def _requantize(body: NodeBuilder, acc_int32: str, multiplier: str, y_zp: str, scale_of: str) -> None:
    """y = saturate(round(float(acc) * multiplier) + y_zp): the node's output, computed in
    the float type of the scale `scale_of`."""
    float_type = body.g.types[scale_of].dtype
    f = body.add(CAST, [acc_int32], to=DTYPES[float_type].onnx)
    scaled = body.add(MUL, [f, multiplier])
    one = body.const(np.ones((), numpy_dtype(float_type)))
    body.add(QUANTIZE_LINEAR, [scaled, one, y_zp], body.node.outputs[0])


def channel_view(body: NodeBuilder, name: str, rank: int) -> str:
    """A per-output-channel vector viewed as [C, 1, ...] against an NC... tensor."""
    size = body.g.types[name].size
    return name if size == 1 else body.reshaped(name, [size] + [1] * (rank - 2))


def _expand_qlinear_matmul(g, node: Node) -> list[Node]:
    a, sa, za, w, sw, zw, sy, zy = node.inputs[:8]
    if g.types[sa].size != 1:
        raise UnsupportedError(f"{node.describe()}: a per-row a_scale is not supported (one value)")
    body = NodeBuilder(g, node)
    acc = body.add(MATMUL_INTEGER, [a, w, za, zw])
    _requantize(body, acc, body.add(DIV, [body.add(MUL, [sa, sw]), sy]), zy, sa)
    return body.nodes


def _expand_qlinear_conv(g, node: Node) -> list[Node]:
    x, sx, zx, w, sw, zw, sy, zy = node.inputs[:8]
    bias = _optional(node, 8)
    rank = len(g.types[x].shape)
    body = NodeBuilder(g, node)
    acc = body.add(CONV_INTEGER, [x, w, zx, zw], **node.attrs)
    if bias:
        acc = body.add(ADD, [acc, channel_view(body, bias, rank)])
    multiplier = body.add(DIV, [body.add(MUL, [sx, channel_view(body, sw, rank)]), sy])
    _requantize(body, acc, multiplier, zy, sx)
    return body.nodes


def _expand_qgemm(g, node: Node) -> list[Node]:
    """com.microsoft.QGemm: alpha * a_scale * b_scale * ((A - za)(B - zb) + C), C being the
    int32 bias at that scale; quantized with y_scale and y_zero_point, or float without."""
    a, sa, za, w, sw, zw = (list(node.inputs) + [""] * 9)[:6]
    c, sy, zy = (list(node.inputs) + [""] * 9)[6:9]
    if node.attrs.get("transA", 0):
        raise UnsupportedError(f"{node.describe()}: transA=1 is not supported")
    body = NodeBuilder(g, node)
    if node.attrs.get("transB", 0):
        if w not in g.constants:
            raise UnsupportedError(f"{node.describe()}: transB=1 with B computed at run time is not supported")
        w = body.const(np.ascontiguousarray(g.constants[w].T))
    acc = body.add(MATMUL_INTEGER, [a, w, za, zw])
    if c:
        acc = body.add(ADD, [acc, c])
    multiplier = body.add(MUL, [sa, sw])
    alpha = float(node.attrs.get("alpha", 1.0))
    if alpha != 1.0:
        multiplier = body.add(MUL, [multiplier, body.const(np.float32(alpha))])
    if sy:
        _requantize(body, acc, body.add(DIV, [multiplier, sy]), zy, sa)
    else:
        body.add(MUL, [body.add(CAST, [acc], to=1), multiplier], node.outputs[0])
    return body.nodes


def _expand_through_float(op: str, n_quantized: int, attrs_of=lambda node: {}):
    """A com.microsoft QLinear op as DequantizeLinear of its quantized inputs (each followed
    by its scale and zero point), the float op, and QuantizeLinear with the output's scale
    and zero point: what the op computes, by its definition."""
    def expand(g, node: Node) -> list[Node]:
        if len(node.inputs) < 3 * n_quantized + 1:
            raise ShapeError(f"{node.describe()}: {len(node.inputs)} inputs; {node.op} takes a value, scale and zero "
                             f"point per quantized input, then the output's scale (and zero point)")
        body = NodeBuilder(g, node)
        inputs = list(node.inputs) + [""] * 3  # trailing zero points may be omitted
        floats = []
        for i in range(n_quantized):
            x, s, z = inputs[3 * i:3 * i + 3]
            floats.append(body.add(DEQUANTIZE_LINEAR, [x, s, z] if z else [x, s]))
        sy, zy = inputs[3 * n_quantized:3 * n_quantized + 2]
        y = body.add(op, floats, **attrs_of(node))
        body.add(QUANTIZE_LINEAR, [y, sy, zy] if zy else [y, sy], node.outputs[0])
        return body.nodes
    return expand


def _expand_qlinear_concat(g, node: Node) -> list[Node]:
    body = NodeBuilder(g, node)
    sy, zy = node.inputs[0], node.inputs[1]
    rest = node.inputs[2:]
    floats = [body.add(DEQUANTIZE_LINEAR, rest[i:i + 3]) for i in range(0, len(rest), 3)]
    y = body.add(CONCAT, floats, axis=node.attrs["axis"])
    body.add(QUANTIZE_LINEAR, [y, sy, zy], node.outputs[0])
    return body.nodes


def _expand_qlinear_where(g, node: Node) -> list[Node]:
    """condition, then (x, scale, zero point) for each branch, then the output's scale and
    zero point."""
    if len(node.inputs) < 8:
        raise ShapeError(f"{node.describe()}: {len(node.inputs)} inputs; QLinearWhere takes the condition, a value, "
                         "scale and zero point per branch, then the output's scale and zero point")
    body = NodeBuilder(g, node)
    cond, x, sx, zx, y, sy, zy, sz = node.inputs[:8]
    zz = node.inputs[8] if len(node.inputs) > 8 else ""
    branches = [body.add(DEQUANTIZE_LINEAR, [v, s, z] if z else [v, s]) for v, s, z in ((x, sx, zx), (y, sy, zy))]
    out = body.add(WHERE, [cond, *branches])
    body.add(QUANTIZE_LINEAR, [out, sz, zz] if zz else [out, sz], node.outputs[0])
    return body.nodes


def _softmax_attrs(g, node):
    """Softmax's axis, as the opset the quantizer wrote in the node (`opset`) reads it: before
    13, everything from the axis on; from 13, that axis alone. The graph's Softmax reads it
    as the graph's opset does; where the two differ and the axis is not the last, refused."""
    rank = len(g.types[node.inputs[0]].shape)
    written = int(node.attrs.get("opset", g.opset))
    axis = normalize_axis(node.attrs.get("axis", 1 if written < 13 else -1), rank, node)
    if (written < 13) != (g.opset < 13) and axis != rank - 1:
        raise UnsupportedError(f"{node.describe()}: softmax over axis {axis} as opset {written} reads it, in a "
                               f"graph of opset {g.opset}, is not supported")
    return {"axis": axis}


def _average_pool_attrs(node):
    _pool_attrs(node)  # (refuses channels_last=1)
    return {k: v for k, v in node.attrs.items() if k != "channels_last"}


def _leaky_attrs(node):
    return {"alpha": node.attrs.get("alpha", 0.01)}


def _pool_attrs(node):
    if node.attrs.get("channels_last", 0):
        raise UnsupportedError(f"{node.describe()}: channels_last=1 is not supported")
    return {}


# onnxruntime's contrib ops, as its QOperator format writes them: (name, expansion).
CONTRIB = "com.microsoft."
register(
    OpDef("QLinearMatMul", OPAQUE, expanded_only, expand=_expand_qlinear_matmul),
    OpDef("QLinearConv", OPAQUE, expanded_only, expand=_expand_qlinear_conv),
    OpDef(CONTRIB + "QGemm", OPAQUE, expanded_only, expand=_expand_qgemm),
    OpDef(CONTRIB + "QLinearAdd", OPAQUE, expanded_only, expand=_expand_through_float(ADD, 2)),
    OpDef(CONTRIB + "QLinearMul", OPAQUE, expanded_only, expand=_expand_through_float(MUL, 2)),
    OpDef(CONTRIB + "QLinearSigmoid", OPAQUE, expanded_only, expand=_expand_through_float(SIGMOID, 1)),
    OpDef(CONTRIB + "QLinearLeakyRelu", OPAQUE, expanded_only, expand=_expand_through_float(LEAKY_RELU, 1, _leaky_attrs)),
    OpDef(CONTRIB + "QLinearGlobalAveragePool", OPAQUE, expanded_only,
          expand=_expand_through_float(GLOBAL_AVERAGE_POOL, 1, _pool_attrs)),
    OpDef(CONTRIB + "QLinearConcat", OPAQUE, expanded_only, expand=_expand_qlinear_concat),
    OpDef(CONTRIB + "QLinearAveragePool", OPAQUE, expanded_only,
          expand=_expand_through_float(AVERAGE_POOL, 1, _average_pool_attrs)),
    OpDef(CONTRIB + "QLinearSoftmax", OPAQUE, expanded_only,
          expand=lambda g, node: _expand_through_float(SOFTMAX, 1, lambda n: _softmax_attrs(g, n))(g, node)),
    OpDef(CONTRIB + "QLinearWhere", OPAQUE, expanded_only, expand=_expand_qlinear_where),
)
