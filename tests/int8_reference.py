"""The exact oracle of the integer tests: onnx's reference evaluator.

onnxruntime is not one on every CPU. Its int8 GEMM and conv kernels for x86 CPUs without VNNI
add u8 x s8 products in pairs with a 16-bit saturating add (`vpmaddubsw`): on an AVX2 host its
MatMulInteger is wrong on most outputs of a random int8 product and QLinearConv up to a hundred
steps off. `onnx.reference` sums in numpy's integers and requantizes in float, as the spec says.
onnxruntime stays a second opinion where its int8 is exact (`onnxruntime_int8_is_exact`).

The reference evaluator knows ONNX's own ops only; the com.microsoft QLinear ops that
onnxruntime's QOperator format writes are defined here by their documentation: dequantize each
quantized input, apply the float op, quantize the result. DynamicQuantizeLSTM, whose
documentation does not say how the activations are quantized, follows onnxruntime's kernel.
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


def _softmax(x, axis: int, opset: int):
    """Softmax as the opset the quantizer wrote reads axis: from 13 that axis; before, the
    input as a matrix of everything before the axis by everything from it on."""
    axes = (axis,) if opset >= 13 else tuple(range(axis % x.ndim, x.ndim))
    e = np.exp(x - x.max(axis=axes, keepdims=True))
    return e / e.sum(axis=axes, keepdims=True)


class QLinearSoftmax(OpRun):
    op_domain = "com.microsoft"

    def _softmax_of(self, x):
        opset = getattr(self, "opset", 13)
        return _softmax(x, getattr(self, "axis", -1 if opset >= 13 else 1), opset)

    _run = _through_float(1, _softmax_of)


class QLinearAveragePool(OpRun):
    """AveragePool of 2-D windows over the dequantized input (count_include_pad, pads; no
    ceil_mode, dilations or channels_last)."""
    op_domain = "com.microsoft"

    def _pool(self, x):
        attr = lambda name, default=None: getattr(self, name, None) or default  # noqa: E731
        (kh, kw), (sh, sw) = self.kernel_shape, attr("strides", (1, 1))
        top, left, bottom, right = attr("pads", (0, 0, 0, 0))
        if attr("ceil_mode") or any(d != 1 for d in attr("dilations", ())) or attr("channels_last"):
            raise NotImplementedError("QLinearAveragePool: ceil_mode, dilations or channels_last")
        padded = np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)))
        ones = np.pad(np.ones_like(x), ((0, 0), (0, 0), (top, bottom), (left, right)))
        oh, ow = (padded.shape[2] - kh) // sh + 1, (padded.shape[3] - kw) // sw + 1
        total, count = np.zeros(x.shape[:2] + (oh, ow)), np.zeros(x.shape[:2] + (oh, ow))
        for i in range(kh):
            for j in range(kw):
                total += padded[:, :, i:i + sh * oh:sh, j:j + sw * ow:sw]
                count += ones[:, :, i:i + sh * oh:sh, j:j + sw * ow:sw]
        return total / (kh * kw if attr("count_include_pad") else count)

    _run = _through_float(1, _pool)


class QLinearWhere(OpRun):
    op_domain = "com.microsoft"

    def _run(self, cond, x, sx, zx, y, sy, zy, sz, zz=None):
        return (_quantize(np.where(cond, _dequantize(x, sx, zx), _dequantize(y, sy, zy)), sz, zz),)


class QGemm(OpRun):
    """alpha * sa * sb * ((A - za) @ (B - zb) + C): the int32 sum exact, then quantized with
    y_scale and y_zero_point, or float32 without them."""
    op_domain = "com.microsoft"

    def _run(self, a, sa, za, b, sb, zb, c=None, sy=None, zy=None, alpha=None, transA=None, transB=None):
        # (transposed first: a per-channel B's zero points and scales are per column of B as used)
        a, b = (a.T if transA else a), (b.T if transB else b)
        a = a.astype(np.int64) - (0 if za is None else za.astype(np.int64))
        b = b.astype(np.int64) - (0 if zb is None else zb.astype(np.int64))
        acc = a @ b + (0 if c is None else c.astype(np.int64))
        y = acc * (np.float64(1.0 if alpha is None else alpha) * np.float64(sa) * sb.astype(np.float64))
        return (y.astype(np.float32),) if sy is None else (_quantize(y, sy, zy),)


def _dynamic_uint8(a: np.ndarray):
    """onnxruntime's dynamic quantization of a float32 matrix to uint8 (its
    GetQuantizationParameter): the range widened to hold 0, scale = range / 255 or 1 if the
    range is empty, zero point round(-min / scale); then round(a / scale) + zp, saturated.
    Returns the centred values (q - zp) and the scale."""
    lo, hi = min(np.float32(a.min(initial=0)), np.float32(0)), max(np.float32(a.max(initial=0)), np.float32(0))
    scale = np.float32(1) if hi == lo else np.float32(hi - lo) / np.float32(255)
    zp = np.rint(np.clip(-(lo / scale), 0, 255))
    q = np.clip(np.rint(a / scale) + zp, 0, 255)
    return (q - zp).astype(np.int64), scale


_LSTM_ACTIVATIONS = {"Sigmoid": lambda x: 1 / (1 + np.exp(-x)), "Tanh": np.tanh, "Relu": lambda x: np.maximum(x, 0)}


class DynamicQuantizeLSTM(OpRun):
    """An LSTM (gates i, o, f, c) with 8-bit W [dirs, input, 4H] and R [dirs, H, 4H], its
    activations quantized as onnxruntime's kernel does: X (the steps up to the longest
    sequence) once, h_prev at every step, both to uint8 with `_dynamic_uint8`; the products
    sum exactly and are scaled by the two scales, the biases added after. A row's h_prev
    counts as 0 once the row is past its sequence length (onnxruntime zeroes those rows of
    Y). The activation names Sigmoid, Tanh and Relu are known."""
    op_domain = "com.microsoft"

    def _run(self, x, w, r, b=None, lens=None, h0=None, c0=None, p=None, w_scale=None, w_zero=None, r_scale=None,
             r_zero=None, activation_alpha=None, activation_beta=None, activations=None, clip=None, direction=None,
             hidden_size=None, input_forget=None):
        seq, batch, _ = x.shape
        dirs, hidden, gh = r.shape[0], r.shape[1], r.shape[2]
        lens = np.full(batch, seq) if lens is None else lens.astype(np.int64)
        longest = int(lens.max())
        acts = [a.decode() if isinstance(a, bytes) else a for a in (activations or ["Sigmoid", "Tanh", "Tanh"] * dirs)]
        acts = acts * 2 if len(acts) == 3 and dirs == 2 else acts
        bias = np.zeros((dirs, 2 * gh), np.float32) if b is None else b
        x_q, x_scale = _dynamic_uint8(x[:longest])
        per_column = lambda v, d: np.broadcast_to(v.reshape(dirs, -1)[d], (gh,))  # noqa: E731
        y = np.zeros((seq, dirs, batch, hidden), np.float32)
        y_h, y_c = np.zeros((dirs, batch, hidden), np.float32), np.zeros((dirs, batch, hidden), np.float32)
        for d in range(dirs):
            sig, g_act, h_act = (_LSTM_ACTIVATIONS[n] for n in acts[3 * d:3 * d + 3])
            wc = w[d].astype(np.int64) - per_column(w_zero, d).astype(np.int64)
            rc = r[d].astype(np.int64) - per_column(r_zero, d).astype(np.int64)
            xw = (x_q @ wc).astype(np.float32) * (x_scale * per_column(w_scale, d).astype(np.float32))
            b_sum = bias[d, :gh] + bias[d, gh:]
            h = np.zeros((batch, hidden), np.float32) if h0 is None else h0[d].copy()
            c = np.zeros((batch, hidden), np.float32) if c0 is None else c0[d].copy()
            prev = h.copy()  # the matrix onnxruntime quantizes: h0, then Y's rows
            reverse = direction == "reverse" or (direction == "bidirectional" and d == 1)
            for s in range(longest):
                active = s < lens
                t = np.where(active & reverse, lens - 1 - s, s)
                h_q, h_scale = _dynamic_uint8(prev)
                gates = (xw[t, np.arange(batch)] + (h_q @ rc).astype(np.float32) * (h_scale * per_column(r_scale, d))
                         + b_sum)
                if clip is not None:
                    gates = np.clip(gates, -clip, clip)
                gi, go, gf, gc = np.split(gates, 4, axis=1)
                if p is not None:
                    pi, po, pf = np.split(p[d], 3)
                    gi, gf = gi + pi * c, gf + pf * c
                i = sig(gi)
                f = 1 - i if input_forget else sig(gf)
                c_new = f * c + i * g_act(gc)
                if p is not None:
                    go = go + po * c_new
                h_new = sig(go) * h_act(c_new)
                c = np.where(active[:, None], c_new, c)
                h = np.where(active[:, None], h_new, h)
                prev = np.where(active[:, None], h_new, 0).astype(np.float32)
                y[t[active], d, np.arange(batch)[active]] = h_new[active]
            y_h[d], y_c[d] = h, c
        return y, y_h, y_c


CONTRIB_OPS = [QLinearAdd, QLinearMul, QLinearSigmoid, QLinearLeakyRelu, QLinearGlobalAveragePool, QLinearConcat,
               QLinearSoftmax, QLinearAveragePool, QLinearWhere, QGemm, DynamicQuantizeLSTM]


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
