"""Element types end to end: every ONNX type Kiln computes in, as inputs, constants,
intermediates and outputs. The oracles are numpy (whose same-type integer arithmetic wraps
as ONNX's does, and whose float16 and ml_dtypes' bfloat16 conversions round to nearest
even) and onnxruntime where it implements the op for the type."""
import math

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from modelkiln.orchestrator.api import build
from tests import model_zoo
from tests.isa import X86_TARGETS, run_or_inspect
from tests.conftest import shared_cache

INTS = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
FLOATS = ["float16", "bfloat16", "float32", "float64"]
ALL = INTS + FLOATS + ["bool"]
ONNX_TYPE = {"float32": TensorProto.FLOAT, "uint8": TensorProto.UINT8, "int8": TensorProto.INT8,
             "uint16": TensorProto.UINT16, "int16": TensorProto.INT16, "int32": TensorProto.INT32,
             "int64": TensorProto.INT64, "bool": TensorProto.BOOL, "float16": TensorProto.FLOAT16,
             "float64": TensorProto.DOUBLE, "uint32": TensorProto.UINT32, "uint64": TensorProto.UINT64,
             "bfloat16": TensorProto.BFLOAT16}


def _np(name):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _graph_model(nodes, inputs, outputs, inits=(), opset=21):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, ONNX_TYPE[t], s) for n, t, s in inputs],
                              [helper.make_tensor_value_info(n, ONNX_TYPE[t], None) for n, t in outputs], list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _run(model, feeds, executor="inprocess"):
    return build(model, executor=executor, cache=shared_cache(), progress=False).load().run(feeds)


def _values(name, shape, seed=0):
    rng = np.random.default_rng(seed)
    if name == "bool":
        return rng.random(shape) < 0.5
    if name in INTS:
        info = np.iinfo(name)
        return rng.integers(info.min, info.max, shape, dtype=name, endpoint=True)  # the full range: wraps happen
    return (rng.standard_normal(shape) * 4).astype(_np(name))


@pytest.mark.parametrize("dtype", INTS)
def test_integer_arithmetic_wraps_at_the_width(dtype, executor):
    """(a + b) * a - b, max and integer Div, with a constant, all at the type's own width."""
    a, b = _values(dtype, (3, 17), 1), _values(dtype, (3, 17), 2)
    b[b == 0] = 1
    if dtype.startswith("int"):
        b[b == -1] = 3  # INT_MIN / -1 overflows the hardware divider
    c = np.array(7, dtype)
    nodes = [helper.make_node("Add", ["a", "b"], ["s"]), helper.make_node("Mul", ["s", "a"], ["m"]),
             helper.make_node("Sub", ["m", "c"], ["y"]), helper.make_node("Max", ["y", "b"], ["mx"]),
             helper.make_node("Div", ["a", "b"], ["q"]), helper.make_node("Less", ["a", "b"], ["lt"])]
    model = _graph_model(nodes, [("a", dtype, [3, 17]), ("b", dtype, [3, 17])],
                         [("y", dtype), ("mx", dtype), ("q", dtype), ("lt", "bool")],
                         [numpy_helper.from_array(c, "c")])
    got = _run(model, {"a": a, "b": b}, executor)
    with np.errstate(over="ignore"):
        y = (a + b) * a - c
    q = np.trunc(a.astype(np.float64) / b).astype(dtype) if dtype != "int64" and dtype != "uint64" else \
        np.where((a < 0) != (b < 0), -(np.abs(a) // np.abs(b)), np.abs(a) // np.abs(b)).astype(dtype)
    for name, want in (("y", y), ("mx", np.maximum(y, b)), ("q", q), ("lt", a < b)):
        assert got[name].dtype == want.dtype, name
        np.testing.assert_array_equal(got[name], want, err_msg=name)


@pytest.mark.parametrize("src", ALL)
def test_cast_to_every_type(src):
    """One model casts an input of `src` to all thirteen types; numpy's astype is the oracle
    (float sources stay inside every target's range: ONNX leaves overflow undefined)."""
    x = _values(src, (40,), 3)
    if src in FLOATS:
        x = np.clip(x.astype(np.float32), -100, 100).astype(_np(src))
        x[:6] = np.array([0.5, 1.5, 2.5, -0.5, 1e-3, 65.0], np.float32).astype(_np(src))
    nodes = [helper.make_node("Cast", ["x"], [f"to_{d}"], to=ONNX_TYPE[d]) for d in ALL]
    model = _graph_model(nodes, [("x", src, [40])], [(f"to_{d}", d) for d in ALL])
    got = _run(model, {"x": x})
    for d in ALL:
        # A negative float to an unsigned type is undefined: those are compared where x >= 0.
        keep = (x.astype(np.float32) >= 0) if src in FLOATS and d.startswith("uint") else np.ones(x.shape, bool)
        source = x.astype(np.float32) if src == "bfloat16" and d in INTS else x
        with np.errstate(over="ignore"):  # int64 to float16: Inf, as Kiln gives too
            want = source.astype(_np(d))
        out = got[f"to_{d}"]
        assert out.dtype == _np(d)
        as_compared = (lambda v: v.astype(np.float64)) if d in FLOATS else (lambda v: v)
        np.testing.assert_array_equal(as_compared(out)[keep], as_compared(want)[keep], err_msg=f"{src} -> {d}")


@pytest.mark.parametrize("half", ["float16", "bfloat16"])
def test_16_bit_floats_round_to_nearest_even(half):
    """Stores round exactly as numpy and ml_dtypes do: ties to even, overflow to Inf,
    denormals, signed zeros, NaN; loads widen exactly."""
    f = np.float32
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, 65504.0, 65520.0, 70000.0, 6e-8, 3e-8, 1e-5, -2e-7,
               1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 3.4e38, 1e-40]
    rng = np.random.default_rng(5)
    x = np.concatenate([np.array(special, f), (rng.standard_normal(200) * 10 ** rng.uniform(-8, 5, 200)).astype(f)])
    nodes = [helper.make_node("Cast", ["x"], ["h"], to=ONNX_TYPE[half]), helper.make_node("Cast", ["h"], ["back"],
                                                                                          to=TensorProto.FLOAT)]
    got = _run(_graph_model(nodes, [("x", "float32", [len(x)])], [("h", half), ("back", "float32")]), {"x": x})
    with np.errstate(over="ignore"):
        want = x.astype(_np(half))
    np.testing.assert_array_equal(got["h"].view(np.uint16)[~np.isnan(want.astype(f))],
                                  want.view(np.uint16)[~np.isnan(want.astype(f))])
    np.testing.assert_array_equal(np.isnan(got["h"].astype(f)), np.isnan(want.astype(f)))
    np.testing.assert_array_equal(got["back"], want.astype(f))


def test_float64_keeps_double_precision(executor):
    """float64 computes in float64 end to end, math functions included (not via float32)."""
    x = np.array([1 + 1e-12, np.pi, 1e300, -2.5e-300, 0.75, 20.0])
    nodes = [helper.make_node("Mul", ["x", "x"], ["sq"]), helper.make_node("Sub", ["sq", "one"], ["d"]),
             helper.make_node("Exp", ["x_small"], ["e"]), helper.make_node("Tanh", ["x_small"], ["t"]),
             helper.make_node("Erf", ["x_small"], ["r"])]
    small = np.array([1e-9, 0.5, -3.0])
    model = _graph_model(nodes, [("x", "float64", [6]), ("x_small", "float64", [3])],
                         [("d", "float64"), ("e", "float64"), ("t", "float64"), ("r", "float64")],
                         [numpy_helper.from_array(np.array(1.0), "one")])
    got = _run(model, {"x": x, "x_small": small}, executor)
    with np.errstate(over="ignore"):
        want = [x * x - 1, np.exp(small), np.tanh(small), np.array([math.erf(v) for v in small])]
    for name, w in zip(("d", "e", "t", "r"), want):
        assert got[name].dtype == np.float64
        # 1e-9: double precision (float32 gives 1e-7 at best), with room for fused multiply-adds
        np.testing.assert_allclose(got[name], w, rtol=1e-9, atol=1e-300, err_msg=name)
    assert got["d"][0] != 0  # float32 would have lost the 1e-12


@pytest.mark.parametrize("target", X86_TARGETS)
@pytest.mark.parametrize("op", ["Erf", "Tanh"])
def test_float32_erf_and_tanh_are_accurate_across_their_range(op, target, executor):
    """Erf and Tanh in float32 (GELU's, GPT-2's GELU's and the LSTM's) against math.erf and
    math.tanh in double: within 5e-7 everywhere, within 1e-6 of their own size near 0 (where
    1 - q exp(-x^2) once lost 1% of erf, and 1 - 2 / (exp(2x) + 1) 0.14% of tanh, to
    cancellation), never beyond [-1, 1], and NaN and the infinities as IEEE has them."""
    dense = np.linspace(-6, 6, 24001)
    tiny = np.concatenate([np.geomspace(1e-30, 0.5, 400), -np.geomspace(1e-30, 0.5, 400)])
    x = np.concatenate([dense, tiny, [0.0, -0.0, np.inf, -np.inf, np.nan, 3.9, 4.0, 4.1, 1e30, -1e30]])
    x = x.astype(np.float32)
    model = _graph_model([helper.make_node(op, ["x"], ["y"])], [("x", "float32", [len(x)])], [("y", "float32")])
    result = build(model, target=target, executor=executor, cache=None, progress=False)

    def run():
        got = result.load().run({"x": x})["y"].astype(np.float64)
        want = np.array([{"Erf": math.erf, "Tanh": math.tanh}[op](v) for v in x.astype(np.float64)])
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        ok = ~np.isnan(want)
        assert np.abs(got[ok] - want[ok]).max() <= 5e-7
        near_zero = ok & (np.abs(x) < 0.5) & (x != 0)
        assert (np.abs(got[near_zero] - want[near_zero]) <= 1e-6 * np.abs(want[near_zero])).all()
        assert np.abs(got[ok]).max() <= 1.0
    run_or_inspect(result, run)


@pytest.mark.parametrize("target", X86_TARGETS)
@pytest.mark.parametrize("op", ["Exp", "Sigmoid"])
def test_float32_exp_and_sigmoid_are_accurate_across_their_range(op, target, executor):
    """Exp and Sigmoid in float32 (softmax's, SiLU's) against double: within 2e-7 of their
    own size from 1.8e-38 (the foot of float32's normal range, where exp flushes to +0) to
    float32's greatest, +inf past it, and NaN and the infinities as IEEE has them."""
    x = np.concatenate([np.linspace(-90, 90, 360001), np.geomspace(1e-30, 1, 200), -np.geomspace(1e-30, 1, 200),
                        [0.0, -0.0, np.inf, -np.inf, np.nan, 88.72, 88.73, -86.99, -87.0, -87.34, 1e30, -1e30]])
    x = x.astype(np.float32)
    model = _graph_model([helper.make_node(op, ["x"], ["y"])], [("x", "float32", [len(x)])], [("y", "float32")])
    result = build(model, target=target, executor=executor, cache=None, progress=False)

    def run():
        got = result.load().run({"x": x})["y"].astype(np.float64)
        xd = x.astype(np.float64)
        with np.errstate(over="ignore"):
            want = np.exp(xd) if op == "Exp" else 1 / (1 + np.exp(-xd))
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        normal = ~np.isnan(want) & (want >= 1.8e-38) & (want <= np.finfo(np.float32).max)
        assert (np.abs(got[normal] - want[normal]) <= 2e-7 * want[normal]).all()
        below = ~np.isnan(want) & (want < 1.8e-38)
        assert (got[below] >= 0).all() and (got[below] <= 1.8e-38).all()
        assert (got[~np.isnan(want) & (want > np.finfo(np.float32).max)] == np.inf).all()
    run_or_inspect(result, run)


@pytest.mark.parametrize("dtype", ["int32", "int64", "float64"])
def test_matmul_and_gemm_in_their_own_type(dtype, executor):
    a, b = _values(dtype, (2, 5, 7), 6), _values(dtype, (7, 3), 7)
    if dtype != "float64":
        a, b = a % 100, b % 100  # ints: results checked exactly, keep them in range
    c = _values(dtype, (3,), 8)
    nodes = [helper.make_node("MatMul", ["a", "b"], ["y"]),
             helper.make_node("Gemm", ["a2", "b"], ["z"], transA=1)]
    a2 = np.ascontiguousarray(a[0].T)
    model = _graph_model(nodes + [helper.make_node("Add", ["z", "c"], ["zc"])],
                         [("a", dtype, [2, 5, 7]), ("a2", dtype, [7, 5])], [("y", dtype), ("zc", dtype)],
                         [numpy_helper.from_array(b, "b"), numpy_helper.from_array(c, "c")])
    got = _run(model, {"a": a, "a2": a2}, executor)
    np.testing.assert_allclose(got["y"], a @ b, rtol=1e-12)
    np.testing.assert_allclose(got["zc"], a[0] @ b + c, rtol=1e-12)
    assert got["y"].dtype == np.dtype(dtype)


def _small_cnn(half_io: bool):
    """Conv-BN-Relu-MaxPool-Conv-GlobalAveragePool-Gemm-Softmax in float32, converted to float16
    by onnxconverter-common's convert_float_to_float16 as users convert models: with fp16
    inputs and outputs, or (keep_io_types) fp32 ones behind Casts."""
    from onnxconverter_common import float16
    rng = np.random.default_rng(11)
    f = np.float32
    w1, w2 = (rng.standard_normal((8, 3, 3, 3)) * 0.3).astype(f), (rng.standard_normal((6, 8, 3, 3)) * 0.2).astype(f)
    scale, bias = (rng.random(8) + 0.5).astype(f), (rng.standard_normal(8) * 0.1).astype(f)
    mean, var = (rng.standard_normal(8) * 0.1).astype(f), (rng.random(8) + 0.5).astype(f)
    fc, fb = (rng.standard_normal((6, 5)) * 0.5).astype(f), (rng.standard_normal(5) * 0.1).astype(f)
    inits = [numpy_helper.from_array(v, n) for n, v in (("w1", w1), ("w2", w2), ("s", scale), ("b", bias),
                                                         ("m", mean), ("v", var), ("fc", fc), ("fb", fb))]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c1", "s", "b", "m", "v"], ["bn"]),
             helper.make_node("Relu", ["bn"], ["r"]), helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2],
                                                                        strides=[2, 2]),
             helper.make_node("Conv", ["p", "w2"], ["c2"], pads=[1, 1, 1, 1]),
             helper.make_node("GlobalAveragePool", ["c2"], ["g"]), helper.make_node("Flatten", ["g"], ["f"]),
             helper.make_node("Gemm", ["f", "fc", "fb"], ["logits"]), helper.make_node("Softmax", ["logits"], ["y"])]
    model = _graph_model(nodes, [("x", "float32", [2, 3, 16, 16])], [("y", "float32")], inits, opset=17)
    return float16.convert_float_to_float16(model, keep_io_types=not half_io)


@pytest.mark.parametrize("half_io", [True, False], ids=["fp16-io", "fp32-io"])
def test_float16_model_matches_onnxruntime(half_io, executor):
    model = _small_cnn(half_io)
    x = np.random.default_rng(12).standard_normal((2, 3, 16, 16)).astype(np.float16 if half_io else np.float32)
    got = _run(model, {"x": x}, executor)["y"]
    want = model_zoo.onnxruntime_outputs(model, {"x": x})["y"]
    assert got.dtype == want.dtype == (np.float16 if half_io else np.float32)
    # onnxruntime rounds to float16 after every op, Kiln once per fused kernel: a few ulps.
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=1e-2, atol=2e-3)


def test_bfloat16_io_and_constants(executor):
    """bfloat16 in, a bfloat16 constant, bfloat16 out: computed in float32, rounded at the store."""
    x = (np.random.default_rng(13).standard_normal((4, 9)) * 3).astype(ml_dtypes.bfloat16)
    k = np.array([1.5, -0.25, 3.0], np.float32).astype(ml_dtypes.bfloat16)
    nodes = [helper.make_node("Mul", ["x", "k"], ["m"]), helper.make_node("Relu", ["m"], ["y"])]
    model = _graph_model(nodes, [("x", "bfloat16", [4, 9])], [("y", "bfloat16")],
                         [numpy_helper.from_array(np.tile(k, 3).reshape(1, 9), "k")])
    got = _run(model, {"x": x}, executor)["y"]
    want = np.maximum(x.astype(np.float32) * np.tile(k, 3).astype(np.float32), 0).astype(ml_dtypes.bfloat16)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


def test_an_input_of_another_kind_is_refused():
    model = _graph_model([helper.make_node("Add", ["a", "a"], ["y"])], [("a", "int32", [3])], [("y", "int32")])
    module = build(model, executor="inprocess", cache=shared_cache(), progress=False).load()
    with pytest.raises(Exception, match="input 'a': expected dtype int32, got float"):
        module.run({"a": np.ones(3, np.float32)})
    np.testing.assert_array_equal(module.run({"a": np.array([1, 2, 3], np.int8)})["y"], [2, 4, 6])
