"""The exact oracle of the integer tests: onnx's reference evaluator.

onnxruntime is not one on every CPU. Its int8 GEMM and conv kernels for x86 CPUs without VNNI
add u8 x s8 products in pairs with a 16-bit saturating add (`vpmaddubsw`): on an AVX2 host its
MatMulInteger is wrong on most outputs of a random int8 product and QLinearConv up to a hundred
steps off. `onnx.reference` sums in numpy's integers and requantizes in float, as the spec says.
onnxruntime stays a second opinion where its int8 is exact (`onnxruntime_int8_is_exact`).

The reference evaluator knows ONNX's own ops only; the com.microsoft QLinear ops that
onnxruntime's QOperator format writes are defined here by their documentation: dequantize each
quantized input, apply the float op, quantize the result.
"""
from __future__ import annotations

import numpy as np
from onnx import version_converter
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from modelkiln.artifacts.cpu_features import host_flags


def onnxruntime_int8_is_exact() -> bool:
    """onnxruntime sums int8 products exactly where the CPU has VNNI (AVX-512 or AVX) dot
    products, and on hosts that are not x86 (its Arm kernels widen to 16 bits first)."""
    flags = host_flags()
    return flags is None or bool({"avx512_vnni", "avx_vnni"} & flags)


def _dequantize(x, scale, zero_point=None):
    zp = 0 if zero_point is None else zero_point.astype(np.float64)
    return (x.astype(np.float64) - zp) * np.float64(scale)


def _quantize(y, scale, zero_point=None):
    dtype = np.uint8 if zero_point is None else zero_point.dtype
    info = np.iinfo(dtype)
    zp = 0 if zero_point is None else int(zero_point)
    return np.clip(np.rint(y / np.float64(scale)) + zp, info.min, info.max).astype(dtype)


def _through_float(n_quantized: int, fn):
    """An OpRun class for a com.microsoft QLinear op: (x, sx, zx) per quantized input, then
    the output's scale and zero point."""
    def _run(self, *inputs, **attrs):
        inputs = list(inputs) + [None] * 3
        floats = [_dequantize(*inputs[3 * i:3 * i + 3]) for i in range(n_quantized)]
        sy, zy = inputs[3 * n_quantized:3 * n_quantized + 2]
        return (_quantize(fn(self, *floats), sy, zy),)
    return _run


class QLinearAdd(OpRun):
    op_domain = "com.microsoft"
    _run = _through_float(2, lambda self, a, b: a + b)


class QLinearMul(OpRun):
    op_domain = "com.microsoft"
    _run = _through_float(2, lambda self, a, b: a * b)


class QLinearSigmoid(OpRun):
    op_domain = "com.microsoft"
    _run = _through_float(1, lambda self, x: 1 / (1 + np.exp(-x)))


class QLinearLeakyRelu(OpRun):
    op_domain = "com.microsoft"
    _run = _through_float(1, lambda self, x: np.where(x >= 0, x, x * (0.01 if self.alpha is None else self.alpha)))


class QLinearGlobalAveragePool(OpRun):
    op_domain = "com.microsoft"
    _run = _through_float(1, lambda self, x: x.mean(axis=tuple(range(2, x.ndim)), keepdims=True))


class QLinearConcat(OpRun):
    op_domain = "com.microsoft"

    def _run(self, sy, zy, *rest, axis=None):
        parts = [_dequantize(*rest[i:i + 3]) for i in range(0, len(rest), 3)]
        return (_quantize(np.concatenate(parts, axis=axis), sy, zy),)


class QGemm(OpRun):
    """alpha * sa * sb * ((A - za) @ (B - zb) + C): the int32 sum exact, then quantized with
    y_scale and y_zero_point, or float32 without them."""
    op_domain = "com.microsoft"

    def _run(self, a, sa, za, b, sb, zb, c=None, sy=None, zy=None, alpha=None, transA=None, transB=None):
        a = a.astype(np.int64) - (0 if za is None else za.astype(np.int64))
        b = b.astype(np.int64) - (0 if zb is None else zb.astype(np.int64))
        a, b = (a.T if transA else a), (b.T if transB else b)
        acc = a @ b + (0 if c is None else c.astype(np.int64))
        y = acc * (np.float64(1.0 if alpha is None else alpha) * np.float64(sa) * sb.astype(np.float64))
        return (y.astype(np.float32),) if sy is None else (_quantize(y, sy, zy),)


CONTRIB_OPS = [QLinearAdd, QLinearMul, QLinearSigmoid, QLinearLeakyRelu, QLinearGlobalAveragePool, QLinearConcat,
               QGemm]


# The reference evaluator implements DequantizeLinear and QuantizeLinear from opset 19 on (which
# only added element types); onnxruntime's quantizer writes opset 18 and below.
FIRST_REFERENCE_QDQ_OPSET = 19


def reference_outputs(model, feeds: dict) -> dict:
    """Every output of `model` on `feeds`, by onnx's reference evaluator."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), FIRST_REFERENCE_QDQ_OPSET)
    if opset < FIRST_REFERENCE_QDQ_OPSET:
        model = version_converter.convert_version(model, FIRST_REFERENCE_QDQ_OPSET)
    evaluator = ReferenceEvaluator(model, new_ops=CONTRIB_OPS)
    names = [o.name for o in model.graph.output]
    return dict(zip(names, evaluator.run(names, feeds)))
