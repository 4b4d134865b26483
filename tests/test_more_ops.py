"""The comparison, logic and activation ops added through the op registry, against
onnxruntime: each on random values with NaN, Inf and the edges of its thresholds mixed in."""
import dataclasses

import numpy as np
import pytest
from onnx import TensorProto, helper

from modelkiln.orchestrator.api import build
from tests import model_zoo
from tests.conftest import shared_cache

EDGES = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 0.5, -0.5, 1.0, -1.0, 2.5, -2.5, 30.0, -30.0, 100.0],
                 np.float32)


def _model(op, inputs, out_type=TensorProto.FLOAT, inits=(), opset=20, **attrs):
    ins = [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs]
    node = helper.make_node(op, [n for n, _, _ in inputs] + [i.name for i in inits], ["y"], **attrs)
    graph = helper.make_graph([node], "g", ins, [helper.make_tensor_value_info("y", out_type, None)], list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


def _compare(model, feeds, executor):
    got = build(model, executor=executor, cache=shared_cache(), progress=False).load().run(feeds)["y"]
    want = model_zoo.onnxruntime_outputs(model, feeds)["y"]
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype.kind == "f":
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        ok = ~np.isnan(want)
        np.testing.assert_allclose(got[ok], want[ok], rtol=1e-5, atol=1e-6)
    else:
        np.testing.assert_array_equal(got, want)


def _x(shape=(4, 14), seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    x.reshape(-1)[:len(EDGES)] = EDGES
    return x


@pytest.mark.parametrize("op,attrs", [
    ("Floor", {}), ("Ceil", {}), ("Round", {}), ("Sign", {}), ("Softplus", {}), ("Softsign", {}),
    ("Elu", {"alpha": 0.7}), ("Selu", {}), ("Celu", {"alpha": 1.5}), ("ThresholdedRelu", {"alpha": 0.5}),
    ("Shrink", {"lambd": 1.0, "bias": 0.25}), ("Mish", {})])
def test_unary_activation(op, attrs, executor):
    x = _x()
    if op == "Round":
        x.reshape(-1)[-6:] = [0.5, 1.5, 2.5, -0.5, -1.5, 3.5]  # halves round to even
    _compare(_model(op, [("x", TensorProto.FLOAT, [4, 14])], opset=20 if op != "Celu" else 12, **attrs), {"x": x},
             executor)


@pytest.mark.parametrize("op,attrs", [("IsNaN", {}), ("IsInf", {}), ("IsInf", {"detect_negative": 0}),
                                      ("IsInf", {"detect_positive": 0})])
def test_nan_and_inf_tests(op, attrs, executor):
    _compare(_model(op, [("x", TensorProto.FLOAT, [4, 14])], TensorProto.BOOL, **attrs), {"x": _x()}, executor)


@pytest.mark.parametrize("op", ["GreaterOrEqual", "LessOrEqual"])
def test_comparisons_broadcast(op, executor):
    model = _model(op, [("a", TensorProto.FLOAT, [4, 14]), ("b", TensorProto.FLOAT, [1, 14])], TensorProto.BOOL)
    b = _x((1, 14), seed=1)
    b[0, :3] = [0.0, np.nan, 2.5]
    _compare(model, {"a": _x(), "b": b}, executor)


@pytest.mark.parametrize("op", ["And", "Or", "Xor"])
def test_logic(op, executor):
    rng = np.random.default_rng(2)
    model = _model(op, [("a", TensorProto.BOOL, [3, 8]), ("b", TensorProto.BOOL, [8])], TensorProto.BOOL)
    _compare(model, {"a": rng.random((3, 8)) < 0.5, "b": rng.random(8) < 0.5}, executor)


def test_prelu_with_a_slope_per_channel(executor):
    slope = helper.make_tensor("slope", TensorProto.FLOAT, [3, 1, 1], [0.1, -0.2, 0.3])
    model = _model("PRelu", [("x", TensorProto.FLOAT, [2, 3, 4, 5])], inits=[slope])
    _compare(model, {"x": _x((2, 3, 4, 5))}, executor)


def test_causal_mask_from_a_comparison(executor):
    """The mask exporters build for a decoder: positions compared, then Where over scores."""
    g = model_zoo.GraphMaker(9)
    rows = g.const(np.arange(6, dtype=np.float32).reshape(6, 1))
    cols = g.const(np.arange(6, dtype=np.float32).reshape(1, 6))
    mask = g.op("LessOrEqual", [cols, rows])
    scores = g.op("Where", [mask, "x", g.const(np.float32(-np.inf))])
    y = g.op("Softmax", [scores], axis=-1)
    model = g.model({"x": [2, 6, 6]}, [y])
    x = np.random.default_rng(3).standard_normal((2, 6, 6)).astype(np.float32)
    got = build(model, executor=executor, cache=shared_cache(), progress=False).load().run({"x": x})
    want = model_zoo.onnxruntime_outputs(model, {"x": x})
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)


def test_a_short_row_is_vectorized_along_itself(executor):
    """A [960, 49] row times a per-row scale (squeeze-excite's rescale at 7x7): the 49-wide
    row is vectorized with a masked tail. Left to LLVM, it unrolled the row and vectorized
    across rows with gathers and scatters, ten times slower."""
    from modelkiln.codegen_worker.compile import compile_kernel
    from modelkiln.ir.lower import ScheduleConfig, lower
    from modelkiln.orchestrator.api import optimize
    from modelkiln.orchestrator.target import parse_target
    model = _model("Mul", [("x", TensorProto.FLOAT, [1, 960, 7, 7]), ("s", TensorProto.FLOAT, [1, 960, 1, 1])])
    rng = np.random.default_rng(0)
    _compare(model, {"x": rng.standard_normal((1, 960, 7, 7)).astype(np.float32),
                     "s": rng.standard_normal((1, 960, 1, 1)).astype(np.float32)}, executor)
    graph, _ = optimize(model)
    [call] = lower(graph, ScheduleConfig.for_vector_width(16)).calls
    target = parse_target("llvm -mcpu=skylake-avx512")
    asm = compile_kernel(call.kernel.to_bytes(), call.kernel.symbol, target.to_dict(), emit_asm=True)["asm"]
    assert "gather" not in asm and "scatter" not in asm
    assert any("vmulps" in line and "zmm" in line for line in asm.splitlines())


@pytest.mark.parametrize("op,attrs,shape", [
    ("GlobalAveragePool", {}, [1, 120, 28, 28]),  # squeeze-excite's pool
    ("ReduceMax", {"keepdims": 0}, [2, 3, 5, 7]),
    ("InstanceNormalization", {}, [1, 4, 9, 9]),
])
def test_a_reduction_over_trailing_axes_is_one_contiguous_loop(op, attrs, shape, executor):
    """Reduced axes that are the input's last ones are one loop over their product, reading
    a unit-stride row (no index divisions left): as a loop per axis, a 28x28 global pool
    summed each 28-wide row apart and ran 14x slower."""
    from modelkiln.ir.loop import Bin, For, Load
    from modelkiln.ir.lower import ScheduleConfig, lower
    from modelkiln.orchestrator.api import optimize
    rng = np.random.default_rng(0)
    inputs, inits = [("x", TensorProto.FLOAT, shape)], ()
    if op == "InstanceNormalization":
        inits = (helper.make_tensor("s", TensorProto.FLOAT, [shape[1]], rng.standard_normal(shape[1]).tolist()),
                 helper.make_tensor("b", TensorProto.FLOAT, [shape[1]], rng.standard_normal(shape[1]).tolist()))
    model = _model(op, inputs, inits=inits, opset=17, **({"axes": [2, 3]} if op == "ReduceMax" else {}), **attrs)
    _compare(model, {"x": _x(shape)}, executor)
    graph, _ = optimize(model)
    [call] = lower(graph, ScheduleConfig.for_vector_width(16)).calls
    plane = shape[2] * shape[3]
    loops = [s for s in _parts(call.kernel.body) if isinstance(s, For) and s.kind == "reduce"]
    assert loops and all(s.extent == plane for s in loops), [s.extent for s in loops]
    indices = [e.index for s in loops for e in _parts(s.body) if isinstance(e, Load) and e.buf.startswith("i")]
    assert indices and not any(isinstance(e, Bin) and e.op in ("div", "rem") for i in indices for e in _parts(i))


def _parts(node):
    """Every statement and expression in a kernel body (or one node), depth first."""
    if isinstance(node, (tuple, list)):
        for n in node:
            yield from _parts(n)
    elif dataclasses.is_dataclass(node):
        yield node
        for f in dataclasses.fields(node):
            yield from _parts(getattr(node, f.name))
