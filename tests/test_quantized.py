"""Quantized models against the exact oracle, onnx's reference evaluator (tests/int8_reference.py).

Integer results (MatMulInteger, ConvInteger, QuantizeLinear, the QLinear ops) are compared
exactly: Kiln sums 8-bit products in int32 exactly and requantizes with onnxruntime's own
arithmetic (float(acc + bias) * (sx * sw / sy), rounded half to even, then + zy).
onnxruntime is a second opinion only on hosts where its int8 is exact (VNNI): without VNNI
its kernels saturate 16-bit pair sums, and its answers are not ONNX's.

One tolerance is stated where the two do different arithmetic on purpose: the reference runs
a QDQ model's Conv and MatMul as written, in float on dequantized values, where Kiln
computes the same sums exactly in int32. Where the float sum lands within rounding of a
half step, the two round to neighbouring levels: at most one step of the output's scale.
"""
import re

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from modelkiln.ir.errors import KilnError
from modelkiln.orchestrator.api import build
from tests import model_zoo, transformer_zoo
from tests.conftest import kernel_statements, shared_cache
from tests.int8_reference import onnxruntime_int8_is_exact, reference_outputs
from tests.isa import (AVX2, AVX2_VNNI, AVX512_NO_VNNI, VECTOR_SIGNS, X86_TARGETS, kernel_assembly, lanes,
                       run_or_inspect)

F, U8, I8, I32 = TensorProto.FLOAT, TensorProto.UINT8, TensorProto.INT8, TensorProto.INT32
NP = {U8: np.uint8, I8: np.int8, TensorProto.INT16: np.int16, TensorProto.UINT16: np.uint16}


def _model(nodes, inputs, outputs, inits=(), opset=21, domains=()):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
                              [helper.make_tensor_value_info(n, t, None) for n, t in outputs],
                              [numpy_helper.from_array(v, n) for n, v in inits])
    opsets = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, 1) for d in domains]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


def _oracles(model, feeds) -> list[tuple[str, dict]]:
    """The reference's outputs, and onnxruntime's where its int8 arithmetic is exact."""
    oracles = [("onnx.reference", reference_outputs(model, feeds))]
    if onnxruntime_int8_is_exact():
        oracles.append(("onnxruntime", model_zoo.onnxruntime_outputs(model, feeds)))
    return oracles


def _compare(model, feeds, exact=True, atol=0.0):
    got = build(model, executor="inprocess", cache=shared_cache(), progress=False).load().run(feeds)
    for oracle, want in _oracles(model, feeds):
        for name in want:
            what = f"{name} against {oracle}"
            assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, what
            if exact:
                np.testing.assert_array_equal(got[name], want[name], err_msg=what)
            else:
                np.testing.assert_allclose(got[name], want[name], rtol=0, atol=atol, err_msg=what)
    return got


def _bytes(shape, t, seed=0):
    info = np.iinfo(NP[t])
    return np.random.default_rng(seed).integers(info.min, info.max + 1, shape).astype(NP[t])


# ---- QuantizeLinear and DequantizeLinear --------------------------------------------------------

@pytest.mark.parametrize("out_type", [U8, I8, TensorProto.INT16, TensorProto.UINT16])
@pytest.mark.parametrize("layout", ["tensor", "axis", "block"])
def test_quantize_then_dequantize(out_type, layout):
    """x * 3 -> QuantizeLinear -> (output) -> DequantizeLinear -> (output): rounding half to
    even, saturation, zero points, per axis and per block (opset 21)."""
    shape = [2, 6, 4]
    scale_shape, attrs = {"tensor": ([], {}), "axis": ([6], {"axis": 1}),
                          "block": ([2, 6, 2], {"axis": 2, "block_size": 2})}[layout]
    rng = np.random.default_rng(1)
    scale = (rng.random(scale_shape) * 0.05 + 0.01).astype(np.float32)
    zp = _bytes(scale_shape, out_type, 2) // 4
    nodes = [helper.make_node("Mul", ["x", "three"], ["x3"]),
             helper.make_node("QuantizeLinear", ["x3", "s", "z"], ["q"], **attrs),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], **attrs)]
    # Values on exact half steps (ties), and some far past saturation.
    x = (np.round(rng.standard_normal(shape) * 40) / 2 * 0.01).astype(np.float32)
    x[0, 0] = [1e4, -1e4, 0.0, 0.015]
    model = _model(nodes, [("x", F, shape)], [("q", out_type), ("y", F)],
                   [("three", np.float32(3)), ("s", scale), ("z", zp)])
    _compare(model, {"x": x})


@pytest.mark.parametrize("scale", [1.0, 0.25, 2.0 ** -12, 0.3])
def test_quantize_by_a_power_of_two_multiplies(scale):
    """A constant power-of-two scale quantizes as a multiply by its reciprocal, which is the
    same value as the division (ties included); any other scale still divides."""
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"])]
    model = _model(nodes, [("x", F, [4, 64])], [("q", I8)], [("s", np.float32(scale)), ("z", np.int8(1))])
    rng = np.random.default_rng(5)
    # Half steps of the scale (ties to even), values between, and past saturation.
    x = (np.round(rng.standard_normal((4, 64)) * 200) / 2 * scale).astype(np.float32)
    x[0, :4] = [1e30, -1e30, 0.5 * scale, -2.5 * scale]
    x[1] = rng.standard_normal(64).astype(np.float32) * 60 * scale
    got = build(model, executor="inprocess", cache=shared_cache(), progress=False).load().run({"x": x})["q"]
    # (the reference casts rint(x / s) to int32 before it saturates, so +-1e30 overflows there;
    # +-1e9 steps saturate the same way by the spec and stay in range)
    clamped = np.clip(x, -1e9 * scale, 1e9 * scale).astype(np.float32)
    for oracle, want in _oracles(model, {"x": clamped}):
        np.testing.assert_array_equal(got, want["q"], err_msg=oracle)
    [call] = build(model, executor="inprocess", cache=None, progress=False).lowered.calls
    assert ("op='div'" in repr(call.kernel.body)) == (scale == 0.3)


def test_dequantize_int32_and_float16_scale():
    nodes = [helper.make_node("DequantizeLinear", ["x", "s"], ["y"]),
             helper.make_node("DequantizeLinear", ["h", "sh"], ["yh"])]
    model = _model(nodes, [("x", I32, [3, 5]), ("h", I8, [4])], [("y", F), ("yh", TensorProto.FLOAT16)],
                   [("s", np.float32(0.125)), ("sh", np.float16(0.3))])
    _compare(model, {"x": np.random.default_rng(0).integers(-10**6, 10**6, (3, 5)).astype(np.int32),
                     "h": _bytes([4], I8)})


def test_dynamic_quantize_linear():
    """onnx's function body for DynamicQuantizeLinear, against the reference's kernel."""
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "s", "z"])]
    model = _model(nodes, [("x", F, [4, 33])], [("q", U8), ("s", F), ("z", U8)])
    _compare(model, {"x": (np.random.default_rng(3).standard_normal((4, 33)) * 2 + 0.5).astype(np.float32)})


# ---- integer products ---------------------------------------------------------------------------

def _words_gemms(result) -> set:
    """b_words of every 8-bit Gemm of a build: whether B was packed in 16-bit pairs."""
    return {s.b_words for c in result.lowered.calls for s in kernel_statements(c.kernel.body)
            if type(s).__name__ == "Gemm" and s.kind != "f32"}


@pytest.mark.parametrize("target", X86_TARGETS)
@pytest.mark.parametrize("a_type,b_type", [(U8, I8), (I8, I8), (U8, U8), (I8, U8)])
@pytest.mark.parametrize("k", [64, 30])
@pytest.mark.parametrize("weight_range", [200, 255])
def test_matmul_integer(a_type, b_type, k, weight_range, target):
    """Every signedness pair, K a multiple of 4 and not (the padded copy), a batch dim,
    per-column weight zero points and a zero point computed at run time. Centred weights
    that fit a signed byte take the GEMM (on AVX2 B packed in 16-bit pairs for vpmaddwd, on
    AVX-512 in byte quads for vpdpbusd); full-range ones the plain loop."""
    w = (_bytes([k, 40], b_type, 1).astype(np.int32) * weight_range // 255).astype(NP[b_type])
    zb = (_bytes([40], b_type, 2).astype(np.int32) // 8 + (85 if b_type == U8 else 0)).astype(NP[b_type])
    nodes = [helper.make_node("Add", ["za_in", "zero"], ["za"]),
             helper.make_node("MatMulInteger", ["a", "w", "za", "zb"], ["y"])]
    zero = np.zeros((), NP[a_type])
    model = _model(nodes, [("a", a_type, [2, 17, k]), ("za_in", a_type, [])], [("y", I32)],
                   [("w", w), ("zb", zb), ("zero", zero)])
    result = _compare_for(model, {"a": _bytes([2, 17, k], a_type, 3), "za_in": np.array(5, NP[a_type])}, target)
    assert _words_gemms(result) == ({lanes(target) == 8} if weight_range < 255 else set())


def test_matmul_integer_larger_than_l2():
    """3000 columns of weights: the GEMM walks B in L2-sized chunks of panels. Exact against
    numpy's int64 product."""
    a, w = _bytes([20, 96], U8, 1), _bytes([96, 3000], I8, 2)
    model = _model([helper.make_node("MatMulInteger", ["a", "w"], ["y"])], [("a", U8, [20, 96])], [("y", I32)],
                   [("w", w)])
    got = build(model, executor="inprocess", cache=shared_cache(), progress=False).load().run({"a": a})["y"]
    np.testing.assert_array_equal(got, (a.astype(np.int64) @ w.astype(np.int64)).astype(np.int32))


@pytest.mark.parametrize("target", X86_TARGETS)
@pytest.mark.parametrize("x_type", [U8, I8])
@pytest.mark.parametrize("case", [dict(), dict(strides=[2, 2], pads=[1, 1, 1, 1]),
                                  dict(dilations=[2, 2], pads=[2, 1, 0, 2]), dict(group=2, pads=[1, 1, 1, 1]),
                                  dict(kernel=1),
                                  dict(shape=[1, 3, 9, 20], pads=[1, 2, 1, 0]),  # one quad of channels
                                  dict(shape=[1, 70, 5, 37], pads=[0, 1, 2, 1]),  # 18 quads, 37 columns
                                  dict(shape=[2, 16, 9, 11], group=4, strides=[2, 1], pads=[1, 1, 1, 1]),
                                  dict(shape=[1, 48, 8, 13], group=3, dilations=[2, 2], pads=[2, 0, 1, 2]),
                                  dict(shape=[1, 32, 6, 7], group=2, kernel=1),
                                  dict(weight_range=255)])  # w - zw outside a signed byte
def test_conv_integer(x_type, case, target):
    """The channels-last implicit GEMM (pads hold the zero point; its input copy transposes
    blocks of up to 16 channel quads x 16 pixels, partial ones at the edges), one per group
    where a group has 4k channels; the pointwise GEMM (1x1, stride 1, no pads: weights as A,
    the activations packed as B) and the plain loop (groups of other sizes; weights whose
    centred values leave a byte): exact int32. On AVX2 both operands are 16-bit (Gemm.b_words)."""
    case = dict(case)
    k, shape = case.pop("kernel", 3), case.pop("shape", [2, 10, 11, 13])
    weight_range = case.pop("weight_range", 200)
    group = case.get("group", 1)
    w = (_bytes([12, shape[1] // group, k, k], I8, 1).astype(np.int32) * weight_range // 255).astype(np.int8)
    model = _model([helper.make_node("ConvInteger", ["x", "w", "zx", "zw"], ["y"], **case)],
                   [("x", x_type, shape)], [("y", I32)],
                   [("w", w), ("zw", np.array(-3, np.int8)), ("zx", np.array(7, NP[x_type]))])
    feeds = {"x": _bytes(shape, x_type, 3)}
    # The plain loop is scalar on every target, so its assembly holds no sign of the vector
    # width; its x86-64-v3 build runs (and is compared) on every x86 host.
    plain_loop = (group != 1 and shape[1] // group % 4 != 0) or weight_range >= 255
    result = _compare_for(model, feeds, target, instructions=() if plain_loop else None)
    gemms = [s for c in result.lowered.calls for s in kernel_statements(c.kernel.body) if type(s).__name__ == "Gemm"]
    assert bool(gemms) == (not plain_loop) and reference_outputs(model, feeds)["y"].any()
    pointwise = k == 1 and not case
    assert all(g.b_words == (lanes(target) == 8) and g.kind == ("s8u8" if pointwise else "u8s8") for g in gemms)


def _depthwise_path(result) -> str:
    """"bytes" where lowering ran the depthwise conv on bytes (a WindowDot), else "float"."""
    kinds = {type(s).__name__ for c in result.lowered.calls for s in kernel_statements(c.kernel.body)}
    return "bytes" if "WindowDot" in kinds else "float"


def _compare_for(model, feeds, target, instructions=None):
    """The build for an explicit target, compared where this host runs it, its assembly
    checked for `instructions` elsewhere (tests/isa.py)."""
    result = build(model, target=target, executor="inprocess", cache=None, progress=False)

    def run():
        got = result.load().run(feeds)
        for oracle, want in _oracles(model, feeds):
            for name in want:
                np.testing.assert_array_equal(got[name], want[name], err_msg=f"{name} against {oracle}")
    run_or_inspect(result, run, instructions)
    return result


@pytest.mark.parametrize("target", X86_TARGETS)
@pytest.mark.parametrize("x_type", [U8, I8])
@pytest.mark.parametrize("case", [
    dict(strides=[1, 1]), dict(strides=[2, 2]),
    dict(kernel=5, strides=[2, 2], dilations=[2, 2], pads=[4, 3, 2, 4]),  # two quads of taps, one of them ragged
    dict(shape=[1, 8, 40, 37]),  # rows of several 16-output vectors, the last one partial
    dict(strides=[5, 5], path="float"),  # 16 outputs' inputs span over 64 bytes
    dict(weight_range=255, path="float"),  # w - zw outside a signed byte
])
def test_depthwise_conv_integer(x_type, case, target):
    """Depthwise (a channel multiplier of 2) summed in int32 on bytes, four taps per vpdpbusd
    (WindowDot, 16-lane targets), or where it does not apply (8-lane targets too) the float32
    direct kernel on x - zx and w - zw, whose sums are exact. Exact int32."""
    case = dict(case)
    k, shape, path = case.pop("kernel", 3), case.pop("shape", [2, 8, 11, 13]), case.pop("path", "bytes")
    w = (_bytes([16, 1, k, k], I8, 1).astype(np.int32) * case.pop("weight_range", 200) // 255).astype(np.int8)
    attrs = dict(pads=[1, 0, 1, 2]) | case
    model = _model([helper.make_node("ConvInteger", ["x", "w", "zx", "zw"], ["y"], group=8, **attrs)],
                   [("x", x_type, shape)], [("y", I32)],
                   [("w", w), ("zw", np.array(5, np.int8)), ("zx", np.array(-9 if x_type == I8 else 200, NP[x_type]))])
    result = _compare_for(model, {"x": _bytes(shape, x_type, 3)}, target)
    assert _depthwise_path(result) == (path if lanes(target) == 16 else "float")


@pytest.mark.parametrize("target", X86_TARGETS)
def test_depthwise_conv_integer_runtime_and_per_channel_zero_points(target):
    """The input's zero point fed at run time (the border of the byte plane holds it) and one
    weight zero point per channel, which onnxruntime's ConvInteger does not take: the oracle
    is onnxruntime's float Conv on x - zx and w - zw, exact for these integers."""
    w = _bytes([8, 1, 3, 3], U8, 1) // 2 + 60
    zw = (np.arange(8) * 7 + 100).astype(np.uint8)
    model = _model([helper.make_node("ConvInteger", ["x", "w", "zx", "zw"], ["y"], group=8, strides=[2, 1],
                                     pads=[1, 1, 0, 1])],
                   [("x", I8, [1, 8, 9, 21]), ("zx", I8, [])], [("y", I32)], [("w", w), ("zw", zw)])
    x, zx = _bytes([1, 8, 9, 21], I8, 3), np.array(-17, np.int8)
    result = build(model, target=target, executor="inprocess", cache=None, progress=False)
    assert _depthwise_path(result) == ("bytes" if lanes(target) == 16 else "float")

    def run():
        got = result.load().run({"x": x, "zx": zx})["y"]
        centred = _model([helper.make_node("Conv", ["x", "w"], ["y"], group=8, strides=[2, 1], pads=[1, 1, 0, 1])],
                         [("x", F, [1, 8, 9, 21])], [("y", F)],
                         [("w", (w.astype(np.float32) - zw.reshape(8, 1, 1, 1)))])
        want = model_zoo.onnxruntime_outputs(centred, {"x": x.astype(np.float32) - zx})["y"]
        np.testing.assert_array_equal(got, want.astype(np.int32))
    run_or_inspect(result, run)


def _conv_reference(x, w, pads):
    """int64 direct convolution in numpy (stride 1, no groups)."""
    xp = np.pad(x.astype(np.int64), [(0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])])
    co, ci, kh, kw = w.shape
    oh, ow = xp.shape[2] - kh + 1, xp.shape[3] - kw + 1
    out = np.zeros((x.shape[0], co, oh, ow), np.int64)
    for i in range(kh):
        for j in range(kw):
            out += np.einsum("bchw,oc->bohw", xp[:, :, i:i + oh, j:j + ow], w[:, :, i, j].astype(np.int64))
    return out


def test_conv_integer_per_channel_weight_zero_points():
    """onnxruntime's ConvInteger takes one weight zero point only; the spec allows one per
    output channel, checked here against a numpy convolution (pads hold x's zero point)."""
    w = _bytes([6, 5, 3, 3], U8, 1)
    zw = _bytes([6], U8, 2) // 4 + 100
    x = _bytes([1, 5, 7, 8], U8, 3)
    model = _model([helper.make_node("ConvInteger", ["x", "w", "zx", "zw"], ["y"], pads=[1, 1, 1, 1])],
                   [("x", U8, [1, 5, 7, 8])], [("y", I32)], [("w", w), ("zw", zw), ("zx", np.array(9, np.uint8))])
    got = build(model, executor="inprocess", cache=shared_cache(), progress=False).load().run({"x": x})["y"]
    xc = x.astype(np.int64) - 9  # the zero padding of (x - zx) is what padding x with zx gives
    want = _conv_reference(xc, w.astype(np.int64) - zw.reshape(6, 1, 1, 1), [1, 1, 1, 1])
    np.testing.assert_array_equal(got, want.astype(np.int32))


def test_qlinear_conv_and_matmul():
    """QLinearConv (per-channel weights, int32 bias) into QLinearMatMul: requantized exactly
    as onnxruntime's kernels do."""
    rng = np.random.default_rng(4)
    w = _bytes([8, 3, 3, 3], I8, 1)
    nodes = [helper.make_node("QLinearConv", ["x", "sx", "zx", "w", "sw", "zw", "sy", "zy", "b"], ["c"],
                              pads=[1, 1, 1, 1]),
             helper.make_node("Reshape", ["c", "shape"], ["flat"]),
             helper.make_node("QLinearMatMul", ["flat", "sy", "zy", "m", "sm", "zm", "so", "zo"], ["y"])]
    inits = [("sx", np.float32(0.02)), ("zx", np.uint8(128)), ("w", w),
             ("sw", (rng.random(8) * 0.01 + 0.002).astype(np.float32)), ("zw", np.zeros(8, np.int8)),
             ("sy", np.float32(0.05)), ("zy", np.uint8(100)), ("b", rng.integers(-500, 500, 8).astype(np.int32)),
             ("shape", np.array([8, 36], np.int64)), ("m", _bytes([36, 5], U8, 5)), ("sm", np.float32(0.01)),
             ("zm", np.uint8(128)), ("so", np.float32(0.2)), ("zo", np.uint8(128))]
    model = _model(nodes, [("x", U8, [1, 3, 6, 6])], [("c", U8), ("y", U8)], inits)
    _compare(model, {"x": _bytes([1, 3, 6, 6], U8, 6)})


def test_contrib_qlinear_ops():
    """onnxruntime's com.microsoft QLinearAdd, QLinearMul, QLinearSigmoid, QLinearLeakyRelu,
    QLinearGlobalAveragePool and QLinearConcat, as its QOperator format writes them."""
    ms = "com.microsoft"
    q = lambda s, z: [s, z]  # noqa: E731
    nodes = [helper.make_node("QLinearAdd", ["a", *q("sa", "za"), "b", *q("sb", "zb"), *q("sc", "zc")], ["add"],
                              domain=ms),
             helper.make_node("QLinearMul", ["add", *q("sc", "zc"), "b", *q("sb", "zb"), *q("sa", "za")], ["mul"],
                              domain=ms),
             helper.make_node("QLinearSigmoid", ["mul", *q("sa", "za"), *q("sc", "zc")], ["sig"], domain=ms),
             helper.make_node("QLinearLeakyRelu", ["a", *q("sa", "za"), *q("sb", "zb")], ["leaky"], domain=ms,
                              alpha=0.2),
             helper.make_node("QLinearGlobalAveragePool", ["a", *q("sa", "za"), *q("sc", "zc")], ["pool"],
                              domain=ms, channels_last=0),
             helper.make_node("QLinearConcat", [*q("sc", "zc"), "a", *q("sa", "za"), "sig", *q("sc", "zc")],
                              ["cat"], domain=ms, axis=1)]
    inits = [("sa", np.float32(0.03)), ("za", np.uint8(120)), ("sb", np.float32(0.05)), ("zb", np.uint8(128)),
             ("sc", np.float32(0.07)), ("zc", np.uint8(130))]
    outs = [(n, U8) for n in ("add", "mul", "sig", "leaky", "pool", "cat")]
    model = _model(nodes, [("a", U8, [1, 4, 5, 5]), ("b", U8, [1, 4, 5, 5])], outs, inits, opset=17, domains=[ms])
    _compare(model, {"a": _bytes([1, 4, 5, 5], U8, 1), "b": _bytes([1, 4, 5, 5], U8, 2)})


@pytest.mark.parametrize("opset", [11, 13])
def test_contrib_qlinear_softmax_average_pool_and_where(opset):
    """The rest of what onnxruntime's QOperator format writes: QLinearSoftmax (its axis read
    as the `opset` it names: before 13 everything from the axis on), QLinearAveragePool
    (strided, padded, with and without the padding counted) and QLinearWhere."""
    ms = "com.microsoft"
    nodes = [helper.make_node("QLinearSoftmax", ["a", "sa", "za", "sp", "zp"], ["soft"], domain=ms, axis=2,
                              opset=opset),
             helper.make_node("QLinearSoftmax", ["a", "sa", "za", "sp", "zp"], ["soft_last"], domain=ms, axis=-1,
                              opset=opset),
             helper.make_node("QLinearAveragePool", ["a", "sa", "za", "sc", "zc"], ["pool"], domain=ms,
                              kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], channels_last=0),
             helper.make_node("QLinearAveragePool", ["a", "sa", "za", "sc", "zc"], ["pool_all"], domain=ms,
                              kernel_shape=[2, 3], pads=[0, 1, 1, 0], count_include_pad=1),
             helper.make_node("Greater", ["b", "a"], ["b_greater"]),
             helper.make_node("QLinearWhere", ["b_greater", "a", "sa", "za", "b", "sb", "zb", "sc", "zc"], ["where"],
                              domain=ms)]
    inits = [("sa", np.float32(0.03)), ("za", np.uint8(120)), ("sb", np.float32(0.05)), ("zb", np.uint8(128)),
             ("sc", np.float32(0.07)), ("zc", np.uint8(130)), ("sp", np.float32(1 / 256)), ("zp", np.uint8(0))]
    outs = [(n, U8) for n in ("soft", "soft_last", "pool", "pool_all", "where")]
    model = _model(nodes, [("a", U8, [1, 4, 5, 6]), ("b", U8, [1, 4, 5, 6])], outs, inits, opset=opset, domains=[ms])
    # (in float32, as onnxruntime computes them; the reference's float64 may round a value
    # within float32's error of a half step the other way)
    _compare(model, {"a": _bytes([1, 4, 5, 6], U8, 1), "b": _bytes([1, 4, 5, 6], U8, 2)}, exact=False, atol=1)


@pytest.mark.parametrize("target", [AVX2, AVX512_NO_VNNI])
def test_int8_kernels_without_vnni(target):
    """Targets without AVX-512 VNNI (AVX2; AVX-512 before VNNI) sum the same bytes with
    widening multiplies: MatMulInteger, the channels-last, the pointwise and the depthwise
    ConvInteger (on AVX-512 without VBMI's byte shuffle too): exact int32."""
    nodes = [helper.make_node("MatMulInteger", ["a", "w", "za"], ["m"]),
             helper.make_node("ConvInteger", ["x", "k3", "zx"], ["c3"], pads=[1, 1, 1, 1]),
             helper.make_node("ConvInteger", ["x", "k1", "zx"], ["c1"]),
             helper.make_node("ConvInteger", ["x", "kd", "zx"], ["dw"], group=8, strides=[2, 2], pads=[1, 1, 1, 1])]
    inits = [("w", _bytes([36, 20], I8, 1)), ("za", np.array(3, np.uint8)), ("k3", _bytes([6, 8, 3, 3], I8, 2)),
             ("k1", _bytes([6, 8, 1, 1], I8, 3)), ("kd", _bytes([8, 1, 3, 3], I8, 4)), ("zx", np.array(-5, np.int8))]
    model = _model(nodes, [("a", U8, [7, 36]), ("x", I8, [1, 8, 9, 10])],
                   [("m", I32), ("c3", I32), ("c1", I32), ("dw", I32)], inits)
    feeds = {"a": _bytes([7, 36], U8, 4), "x": _bytes([1, 8, 9, 10], I8, 5)}
    asm = kernel_assembly(_compare_for(model, feeds, target))
    assert "vpmaddwd" in asm and "vpdpbusd" not in asm


def test_int8_kernels_with_avx_vnni():
    """An AVX2 target with AVX-VNNI (Alder Lake, Zen 5) sums bytes with the VEX-encoded
    vpdpbusd on ymm registers, B packed in byte quads: exact, no AVX-512 instruction."""
    nodes = [helper.make_node("MatMulInteger", ["a", "w", "za"], ["m"]),
             helper.make_node("ConvInteger", ["x", "k3", "zx"], ["c3"], pads=[1, 1, 1, 1])]
    inits = [("w", _bytes([36, 20], I8, 1)), ("za", np.array(3, np.uint8)), ("k3", _bytes([6, 8, 3, 3], I8, 2)),
             ("zx", np.array(-5, np.int8))]
    model = _model(nodes, [("a", U8, [7, 36]), ("x", I8, [1, 8, 9, 10])], [("m", I32), ("c3", I32)], inits)
    result = _compare_for(model, {"a": _bytes([7, 36], U8, 4), "x": _bytes([1, 8, 9, 10], I8, 5)}, AVX2_VNNI)
    asm = kernel_assembly(result)
    assert re.search(r"vpdpbusd\s+%ymm", asm) and not re.search(VECTOR_SIGNS[16], asm)
    assert _words_gemms(result) == {False}


# ---- order-preserving ops between a DQ and a Q of the same scale ------------------------------

@pytest.mark.parametrize("x_type", [U8, I8])
@pytest.mark.parametrize("same_params", [True, False])
def test_max_pool_and_moves_between_dq_and_q_run_on_bytes(x_type, same_params):
    """DQ -> MaxPool -> Q (and a Reshape, a Transpose) with one scale and zero point runs on
    the 8-bit values; with another scale on the Q it stays in float32. Exact either way."""
    zero = np.array(3 if x_type == U8 else -2, NP[x_type])
    q_scale = np.float32(0.0213) if same_params else np.float32(0.0371)
    nodes = [helper.make_node("DequantizeLinear", ["x", "s", "z"], ["xf"]),
             helper.make_node("MaxPool", ["xf"], ["pf"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
             helper.make_node("QuantizeLinear", ["pf", "qs", "z"], ["p"]),
             helper.make_node("DequantizeLinear", ["p", "qs", "z"], ["pf2"]),
             helper.make_node("Transpose", ["pf2"], ["tf"], perm=[0, 2, 3, 1]),
             helper.make_node("QuantizeLinear", ["tf", "qs", "z"], ["t"])]
    model = _model(nodes, [("x", x_type, [1, 8, 15, 20])], [("p", x_type), ("t", x_type)],
                   [("s", np.float32(0.0213)), ("qs", q_scale), ("z", zero)])
    _compare(model, {"x": _bytes((1, 8, 15, 20), x_type, 4)})
    lowered = build(model, executor="inprocess", cache=None, progress=False).lowered
    [pool] = [c for c in lowered.calls if "MaxPool" in c.ops]
    if same_params:  # the pool alone, reading and writing bytes
        assert list(pool.ops) == ["MaxPool"] and lowered.types[pool.outputs[0]].dtype == lowered.types["x"].dtype
    else:
        assert {"DequantizeLinear", "QuantizeLinear"} <= set(pool.ops), pool.ops


# ---- models quantized by onnxruntime's tool -----------------------------------------------------

def _kernel_ops(model):
    return [c.ops for c in build(model, executor="inprocess", cache=None, progress=False).lowered.calls]


def test_quantize_dynamic_cnn():
    model = model_zoo.quantized(model_zoo.residual_cnn(), "dynamic")
    feeds = model_zoo.random_inputs(model, 7)
    # Float output of exact integer sums: equal up to float32 rounding of the scale products.
    _compare(model, feeds, exact=False, atol=1e-5)
    ops = _kernel_ops(model)
    assert sum("ConvInteger" in o for o in ops) == 6 and sum("MatMulInteger" in o for o in ops) == 1, ops


def test_quantize_static_qdq_cnn_runs_int8_kernels():
    model = model_zoo.quantized(model_zoo.residual_cnn(), "qdq")
    step = _output_step(model)
    _compare(model, model_zoo.random_inputs(model, 7), exact=False, atol=step * 1.001)
    ops = _kernel_ops(model)
    # Each Conv and the classifier became one integer kernel with its requantize fused.
    assert sum(o[0] in ("ConvInteger", "MatMulInteger") for o in ops) == 6, ops
    assert not any("Conv" in o or "Gemm" in o or "MatMul" in o for o in ops), ops


def test_quantize_static_qoperator_cnn():
    model = model_zoo.quantized(model_zoo.residual_cnn(), "qoperator")
    assert {"QLinearConv", "QLinearAdd", "QGemm"} <= {n.op_type for n in model.graph.node}
    _compare(model, model_zoo.random_inputs(model, 7), exact=False, atol=_output_step(model) * 1.001)


@pytest.mark.parametrize("trans_b", [0, 1])
def test_qgemm_with_per_channel_weights(trans_b):
    """com.microsoft QGemm as a per-channel QOperator classifier writes it: B's zero points and
    scales one per output column, B stored transposed ([N, K], transB) or not, an int32 bias
    and a quantized output. Against the reference (whose QGemm subtracts the zero points from
    B's columns as used) and onnxruntime where its int8 is exact; within one output level."""
    m, k, n = 5, 40, 24
    rng = np.random.default_rng(3)
    b_shape = [n, k] if trans_b else [k, n]
    consts = [numpy_helper.from_array(v, name) for name, v in (
        ("sa", np.float32(0.02)), ("za", np.uint8(120)),
        ("b", rng.integers(-128, 128, b_shape).astype(np.int8)),
        ("sb", rng.uniform(0.002, 0.01, n).astype(np.float32)), ("zb", rng.integers(-5, 6, n).astype(np.int8)),
        ("c", rng.integers(-2000, 2000, n).astype(np.int32)), ("sy", np.float32(0.05)), ("zy", np.uint8(128)))]
    node = helper.make_node("QGemm", ["a", "sa", "za", "b", "sb", "zb", "c", "sy", "zy"], ["y"], domain="com.microsoft",
                            transB=trans_b, alpha=1.0)
    graph = helper.make_graph([node], "qgemm", [helper.make_tensor_value_info("a", U8, [m, k])],
                              [helper.make_tensor_value_info("y", U8, [m, n])], consts)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    _compare(model, {"a": _bytes([m, k], U8)}, exact=False, atol=1)


def test_quantize_dynamic_transformer():
    """A BERT-style encoder through quantize_dynamic: every MatMul with weights becomes
    DynamicQuantizeLinear + MatMulInteger; attention's activation products stay float."""
    float_model, feeds = transformer_zoo.bert_encoder("dynamo", seq=16, d=32, heads=2, layers=1)
    model = model_zoo.quantized(float_model, "dynamic")
    assert "MatMulInteger" in {n.op_type for n in model.graph.node}
    got = build(model, executor="inprocess", cache=shared_cache(), progress=False).load().run(feeds)
    for oracle, want in _oracles(model, feeds):
        for name in want:
            # LayerNorm and softmax between the quantized products are float: float32 tolerance.
            np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-4, err_msg=f"{name}, {oracle}")


def _output_step(model) -> float:
    """The scale of the DequantizeLinear that produces the model's output."""
    out = model.graph.output[0].name
    consts = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    node = next(n for n in model.graph.node if out in n.output)
    return float(consts[node.input[1]])


# ---- what stays refused -------------------------------------------------------------------------

def test_quantize_to_e8m0_is_refused_by_name():
    """E8M0 is a scale's type, not a quantized value's (ONNX's QuantizeLinear takes no E8M0
    output); the other float8 types and float4 are built: tests/test_small_floats.py."""
    model = _model([helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"])], [("x", F, [4])],
                   [("q", TensorProto.FLOAT8E8M0)],
                   [("s", np.float32(1)), ("z", np.zeros((), np.uint8))])
    z = model.graph.initializer[1]
    z.data_type = TensorProto.FLOAT8E8M0
    with pytest.raises(KilnError, match="QuantizeLinear.*quantizing to float8_e8m0fnu is not supported"):
        build(model, executor="inprocess", cache=None, progress=False)


def test_unknown_contrib_op_is_refused_by_name():
    model = _model([helper.make_node("QAttention", ["x"], ["y"], domain="com.microsoft")], [("x", U8, [4])],
                   [("y", F)], opset=17, domains=["com.microsoft"])
    with pytest.raises(KilnError, match="QAttention.*com.microsoft"):
        build(model, executor="inprocess", cache=None, progress=False)


def test_quantize_static_grouped_conv_runs_the_gemm():
    """RegNet's and ResNeXt's convs in groups of 8 channels, quantized by onnxruntime's tool:
    one channels-last GEMM per group (the plain loop was 17x slower than float32 there)."""
    g = model_zoo.GraphMaker(3)
    y = g.op("Relu", [g.conv("x", 64, 64, 3, stride=2, group=8)])
    y = g.op("Relu", [g.conv(y, 64, 48, 3, group=4)])
    model = model_zoo.quantized(g.model({"x": [1, 64, 15, 17]}, [y]), "qdq")
    _compare(model, model_zoo.random_inputs(model, 7), exact=False, atol=_output_step(model) * 1.001)
    lowered = build(model, executor="inprocess", cache=None, progress=False).lowered
    convs = [c for c in lowered.calls if c.ops[0] == "ConvInteger"]
    gemms = [[s for s in kernel_statements(c.kernel.body) if type(s).__name__ == "Gemm"] for c in convs]
    assert len(convs) == 2 and all(len(g) == 1 for g in gemms), [c.ops for c in lowered.calls]
