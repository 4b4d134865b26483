"""The 8- and 4-bit float element types (float8 E4M3FN, E4M3FNUZ, E5M2, E5M2FNUZ and
float4 E2M1): every code decoded, float32 rounded to each (ties, subnormals, overflow, Inf,
NaN; with and without Cast's `saturate`), as inputs, constants and outputs, and through
QuantizeLinear and DequantizeLinear. The oracle is onnx's reference evaluator (ml_dtypes'
conversions, which ONNX specifies)."""
import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from modelkiln.orchestrator.api import build
from tests.conftest import shared_cache

FORMATS = {"float8_e4m3fn": TensorProto.FLOAT8E4M3FN, "float8_e4m3fnuz": TensorProto.FLOAT8E4M3FNUZ,
           "float8_e5m2": TensorProto.FLOAT8E5M2, "float8_e5m2fnuz": TensorProto.FLOAT8E5M2FNUZ,
           "float4_e2m1fn": TensorProto.FLOAT4E2M1}


def _model(nodes, inputs, outputs, inits=()):
    types = {**FORMATS, "float32": TensorProto.FLOAT}
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, types[t], s) for n, t, s in inputs],
                              [helper.make_tensor_value_info(n, types[t], None) for n, t in outputs], list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=11)


def _codes(fmt: str) -> np.ndarray:
    """Every code of the format, as its ml_dtypes array."""
    count = 16 if fmt.startswith("float4") else 256
    return np.arange(count, dtype=np.uint8).view(getattr(ml_dtypes, fmt))


def _assert_same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Equal dtypes, NaN where the oracle has NaN, and elsewhere the same bits (so -0 is -0)."""
    assert got.dtype == want.dtype, what
    nan = np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan, err_msg=what)
    bits = np.uint8 if got.dtype.itemsize == 1 else np.uint32
    np.testing.assert_array_equal(got[~nan].view(bits), want[~nan].view(bits), err_msg=what)


def _values_around(fmt: str) -> np.ndarray:
    """float32 values that test rounding: every finite value of the format and of its
    negation, the midpoints between neighbours (ties go to the even code), a float32 step
    either side of each midpoint, the least subnormal's halves, past the greatest value,
    Inf, -Inf, NaN and -0."""
    finite = np.unique(_codes(fmt).astype(np.float32))
    finite = finite[np.isfinite(finite)]
    mids = (finite[:-1] + finite[1:]) / 2
    near = np.concatenate([np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf))])
    top = float(ml_dtypes.finfo(getattr(ml_dtypes, fmt)).max)
    tiny = float(ml_dtypes.finfo(getattr(ml_dtypes, fmt)).smallest_subnormal)
    extra = [tiny / 2, tiny / 4, tiny * 0.75, top * 1.03, top * 1.2, top * 4, 3e38, np.inf, -np.inf, np.nan, -0.0]
    x = np.concatenate([finite, mids, near, np.array(extra, np.float32)]).astype(np.float32)
    return np.concatenate([x, -x])


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_code_decodes(fmt, executor):
    """Each code of the format cast to float32 (a load and an exact conversion), and passed
    through unchanged."""
    codes = _codes(fmt)
    model = _model([helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT),
                    helper.make_node("Identity", ["x"], ["same"])],
                   [("x", fmt, [codes.size])], [("y", "float32"), ("same", fmt)])
    got = build(model, executor=executor, cache=shared_cache(), progress=False).load().run({"x": codes})
    _assert_same(got["y"], codes.astype(np.float32), "decoded")
    np.testing.assert_array_equal(got["same"].view(np.uint8), codes.view(np.uint8))


@pytest.mark.parametrize("saturate", [1, 0], ids=["saturate", "overflow"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_float32_rounds_to_nearest_even(fmt, saturate, executor):
    """Cast from float32, stored (the output) and passed on in the same kernel (cast back to
    float32), against the reference evaluator."""
    x = _values_around(fmt)
    nodes = [helper.make_node("Cast", ["x"], ["y"], to=FORMATS[fmt], saturate=saturate),
             helper.make_node("Cast", ["y"], ["back"], to=TensorProto.FLOAT)]
    model = _model(nodes, [("x", "float32", [x.size])], [("y", fmt), ("back", "float32")])
    got = build(model, executor=executor, cache=shared_cache(), progress=False).load().run({"x": x})
    want_y, want_back = ReferenceEvaluator(model).run(None, {"x": x})
    _assert_same(got["y"], want_y, "stored")
    _assert_same(got["back"], want_back, "passed on")


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_and_dequantize(fmt, executor):
    """QuantizeLinear to the format with a scale per channel (values past the greatest one
    saturate), DequantizeLinear of the result, and of a constant of the format."""
    rng = np.random.default_rng(11)
    top = float(ml_dtypes.finfo(getattr(ml_dtypes, fmt)).max)
    x = (rng.standard_normal((3, 40)) * top / 3).astype(np.float32)
    scale = np.array([0.5, 1.0, 0.125], np.float32)
    zero = np.zeros(3, getattr(ml_dtypes, fmt))
    w = rng.standard_normal((3, 5)).astype(getattr(ml_dtypes, fmt))
    inits = [numpy_helper.from_array(scale, "s"), numpy_helper.from_array(zero, "z"), numpy_helper.from_array(w, "w")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], axis=0),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"], axis=0),
             helper.make_node("DequantizeLinear", ["w", "s", "z"], ["dw"], axis=0)]
    model = _model(nodes, [("x", "float32", [3, 40])], [("q", fmt), ("d", "float32"), ("dw", "float32")], inits)
    got = build(model, executor=executor, cache=shared_cache(), progress=False).load().run({"x": x})
    for name, want in zip(("q", "d", "dw"), ReferenceEvaluator(model).run(None, {"x": x})):
        _assert_same(got[name], want, name)
    assert np.abs(got["q"].astype(np.float32)).max() == top  # saturated


def test_every_e8m0_code_decodes(executor):
    """E8M0 (float8_e8m0fnu): 2^(code - 127), 0xFF NaN."""
    codes = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu)
    graph = helper.make_graph([helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT)], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT8E8M0, [256])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)], ir_version=11)
    got = build(model, executor=executor, cache=shared_cache(), progress=False).load().run({"x": codes})["y"]
    _assert_same(got, codes.astype(np.float32), "decoded")


@pytest.mark.parametrize("saturate", [1, 0], ids=["saturate", "overflow"])
@pytest.mark.parametrize("round_mode", ["up", "down", "nearest"])
def test_float32_to_e8m0_rounds_as_asked(round_mode, saturate, executor):
    """Cast to E8M0 by the float's exponent, rounded by round_mode (the fraction's bits decide),
    saturating at 2^127 or not; stored and passed on (cast back in the same kernel)."""
    rng = np.random.default_rng(14)
    powers = np.ldexp(1.0, np.arange(-126, 128)).astype(np.float32)
    between = [powers * f for f in (1.25, 1.5, 1.75, np.float32(1.5) + np.float32(2.0 ** -22))]
    extra = np.array([0.0, -0.0, 2.0 ** -127, 1e-45, 2.0 ** 127 * 1.5, 3.4e38, np.inf, -np.inf, np.nan], np.float32)
    x = np.concatenate([powers, *between, -powers * 1.5, extra, rng.standard_normal(64).astype(np.float32)])
    nodes = [helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT8E8M0, saturate=saturate, round_mode=round_mode),
             helper.make_node("Cast", ["y"], ["back"], to=TensorProto.FLOAT)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [x.size])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT8E8M0, None),
                               helper.make_tensor_value_info("back", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)], ir_version=11)
    got = build(model, executor=executor, cache=shared_cache(), progress=False).load().run({"x": x})
    want_y, want_back = ReferenceEvaluator(model).run(None, {"x": x})
    _assert_same(got["y"], want_y, "stored")
    _assert_same(got["back"], want_back, "passed on")
