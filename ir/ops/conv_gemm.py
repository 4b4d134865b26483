"""Convolutions and matrix products: Conv, ConvTranspose, MatMul, Gemm (Einsum: einsum.py). Anchors that run
the GEMM micro-kernel (ir/lower/gemm.py), with bias, scale, activation and residual adds
fused as their epilogue."""
from __future__ import annotations

from ..attrs import check_attrs
from ..dtypes import dtype
from ..graph import ShapeError, TensorType, UnsupportedError
from ..lower.builder import collapse_shapes
from ..lower.conv import lower_conv
from ..lower.gemm import is_depthwise, lower_conv_transpose, lower_gemm, lower_matmul
from ..symbolic import floor_div, is_symbolic, least, require_equal
from .broadcast import broadcast
from .registry import BROADCAST, OUT_EWISE_FUSABLE, OpDef, op_def, register


def resolve_window(node, p, spatial, kernel, is_transpose=False, out_padding=None, auto=None):
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
    # (A transposed conv's pads may be negative: an output_shape larger than the default one.)
    negative_pads = min(pads, default=0) < 0 and not is_transpose
    if len(pads) != 2 * n or negative_pads or min(strides, default=1) < 1 or min(dil, default=1) < 1:
        raise ShapeError(f"{node.describe()}: pads {pads}, strides {strides} and dilations {dil} do not describe "
                         f"a {n}-d window (pads must be >= 0, strides and dilations >= 1)")
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


def _check_float32_compute(node, t: TensorType) -> None:
    """Convolutions run on the float32 micro-kernel: float16 and bfloat16 load into it,
    other types have no convolution kernel."""
    if dtype(t.dtype).compute != "f32":
        raise UnsupportedError(f"{node.describe()}: {node.op} of {t.dtype} is not supported "
                               f"(float32, float16, bfloat16)")


def infer_conv(g, node, p, check_type=True):
    x, w = g.types[node.inputs[0]], g.types[node.inputs[1]]
    if check_type:
        _check_float32_compute(node, x)
    spatial = x.shape[2:]
    kernel = node.attrs.get("kernel_shape", list(w.shape[2:]))
    group = node.attrs.get("group", 1)
    if len(x.shape) != len(w.shape) or x.shape[1] != w.shape[1] * group:
        raise ShapeError(f"{node.describe()}: input {x} does not match weight {w} with group={group}")
    strides, dil, pads = resolve_window(node, p, spatial, kernel)
    n = len(spatial)
    out = [floor_div(spatial[i] + pads[i] + pads[i + n] - ((kernel[i] - 1) * dil[i] + 1), strides[i]) + 1
           for i in range(n)]
    if min(least(o) for o in out) <= 0:
        raise ShapeError(f"{node.describe()}: kernel {kernel} does not fit input {x}")
    return TensorType((x.shape[0], w.shape[0]) + tuple(out), x.dtype)


def _conv_transpose(g, node, p):
    x, w = g.types[node.inputs[0]], g.types[node.inputs[1]]
    _check_float32_compute(node, x)
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
    strides, dil, pads = resolve_window(node, p, spatial, kernel, is_transpose=True, out_padding=out_pad, auto=explicit)
    p["output_padding"] = out_pad
    out = [strides[i] * (spatial[i] - 1) + out_pad[i] + (kernel[i] - 1) * dil[i] + 1 - pads[i] - pads[i + n]
           for i in range(n)]
    return TensorType((x.shape[0], w.shape[1] * group) + tuple(out), x.dtype)


def infer_matmul(g, node, p):
    a, b = g.types[node.inputs[0]], g.types[node.inputs[1]]
    sa, sb = list(a.shape), list(b.shape)
    if not sa or not sb:
        raise ShapeError(f"{node.describe()}: MatMul of a scalar")
    va, vb = len(sa) == 1, len(sb) == 1
    sa = [1] + sa if va else sa
    sb = sb + [1] if vb else sb
    if sa[-1] != sb[-2]:
        if not (is_symbolic(sa[-1]) or is_symbolic(sb[-2])):
            raise ShapeError(f"{node.describe()}: inner dimensions of {a} and {b} differ")
        sa[-1] = sb[-2] = require_equal(sa[-1], sb[-2], f"{node.describe()}: the inner dimensions")
    batch = broadcast([tuple(sa[:-2]), tuple(sb[:-2])], node)
    out = list(batch) + ([] if va else [sa[-2]]) + ([] if vb else [sb[-1]])
    return TensorType(tuple(out), a.dtype)


def _gemm(g, node, p):
    a, b = g.types[node.inputs[0]], g.types[node.inputs[1]]
    m = a.shape[1] if node.attrs.get("transA", 0) else a.shape[0]
    ka = a.shape[0] if node.attrs.get("transA", 0) else a.shape[1]
    kb, n = (b.shape[1], b.shape[0]) if node.attrs.get("transB", 0) else b.shape
    if ka != kb:
        raise ShapeError(f"{node.describe()}: inner dimensions of {a} and {b} differ")
    if len(node.inputs) > 2 and node.inputs[2]:
        broadcast([g.types[node.inputs[2]].shape, (m, n)], node)
    return TensorType((m, n), a.dtype)


def collapse_rows(b, node, names) -> None:
    """A MatMul of [..., K] by a matrix that computes one GEMM over the rows ([batch, seq, K]
    x [K, N] as [rows, N]: ir/lower/gemm.py's _lower_matmul_rows) has its epilogue index
    (row, column) where every epilogue tensor lets the leading dims merge."""
    ta, tb = b.g.types[node.inputs[0]], b.g.types[node.inputs[1]]
    if ta.is_static:
        rows_gemm = len(ta.shape) > 2 and tb.is_static and b.compute(node.inputs[0]) == "f32"
    else:
        rows_gemm = node.inputs[1] in b.g.constants
    if rows_gemm and len(tb.shape) == 2 and \
            all(m is node or op_def(m.op).kind <= BROADCAST for m in b.members):  # (readers that index the full shape)
        collapse_shapes(b, names, b.shape(node.outputs[0]), into=2)


def _collapse_conv_epilogue(b, node, names) -> None:
    """A GEMM conv's epilogue indexes (batch, channel, pixel) where every epilogue tensor lets
    the spatial dims merge into one; else (a constant broadcast along W alone, or along H)
    (batch, channel, *spatial)."""
    if not is_depthwise(b, node):
        b.conv_collapsed = collapse_shapes(b, names, b.type(node.outputs[0]).shape, fixed=2, into=3)


CONV, CONV_TRANSPOSE, GEMM = "Conv", "ConvTranspose", "Gemm"  # the producers a BatchNorm folds into
MATMUL = "MatMul"
register(
    OpDef(CONV, OUT_EWISE_FUSABLE, infer_conv, anchor=lambda b, node, store, out: lower_conv(b, node, store),
          prepare_epilogue=_collapse_conv_epilogue),
    OpDef(CONV_TRANSPOSE, OUT_EWISE_FUSABLE, _conv_transpose,
          anchor=lambda b, node, store, out: lower_conv_transpose(b, node, store)),
    OpDef(MATMUL, OUT_EWISE_FUSABLE, infer_matmul, anchor=lambda b, node, store, out: lower_matmul(b, node, store, out),
          prepare_epilogue=collapse_rows),
    OpDef(GEMM, OUT_EWISE_FUSABLE, _gemm, anchor=lambda b, node, store, out: lower_gemm(b, node, store)),
)
