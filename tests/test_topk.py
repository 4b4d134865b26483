"""TopK on long lines, as LLM sampling (a vocabulary's logits) and detectors (thousands of
scores) call it: k from 1 to the whole line, largest and smallest, ties and NaN, along the
last axis and a strided one, integers, a k known at run time only, and TopK of constants
folded at build time, each against onnx's reference evaluator (onnxruntime agrees with it
on NaN: the largest value)."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from modelkiln.orchestrator.api import build
from tests import model_zoo
from tests.conftest import shared_cache

H = helper


def _topk_model(shape, k: int, axis: int, largest: int, dtype=TensorProto.FLOAT, constant=None):
    inits = [numpy_helper.from_array(np.array([k], np.int64), "k")]
    inputs = [H.make_tensor_value_info("x", dtype, shape)] if constant is None else []
    if constant is not None:
        inits.append(numpy_helper.from_array(constant, "x"))
    graph = H.make_graph([H.make_node("TopK", ["x", "k"], ["v", "i"], axis=axis, largest=largest)], "g", inputs,
                         [H.make_tensor_value_info("v", dtype, None), H.make_tensor_value_info("i", TensorProto.INT64,
                                                                                               None)], inits)
    return H.make_model(graph, opset_imports=[H.make_opsetid("", 17)], ir_version=9)


def _line(rng, shape, ties: bool, nans: bool) -> np.ndarray:
    x = rng.standard_normal(shape).astype(np.float32)
    if ties:
        x = np.round(x * 3) / 3
    if nans:
        x.reshape(-1)[rng.choice(x.size, max(x.size // 50, 2), replace=False)] = np.nan
    return x


@pytest.mark.parametrize("k", [1, 16, 1000, 3000])
@pytest.mark.parametrize("largest", [1, 0])
def test_topk_of_long_lines(k, largest, executor):
    model = _topk_model([3, 3000], k, -1, largest)
    module = build(model, executor=executor, cache=shared_cache(), progress=False).load()
    rng = np.random.default_rng(k + largest)
    for ties, nans in ((False, False), (True, False), (True, True)):
        x = _line(rng, (3, 3000), ties, nans)
        got, (values, indices) = module.run({"x": x}), ReferenceEvaluator(model).run(None, {"x": x})
        np.testing.assert_array_equal(got["i"], indices)
        np.testing.assert_array_equal(got["v"], values)


def test_topk_along_a_strided_axis_and_of_integers(executor):
    rng = np.random.default_rng(3)
    model = _topk_model([700, 4], 40, 0, 1)
    module = build(model, executor=executor, cache=shared_cache(), progress=False).load()
    x = _line(rng, (700, 4), True, True)
    got, want = module.run({"x": x}), ReferenceEvaluator(model).run(None, {"x": x})
    np.testing.assert_array_equal(got["i"], want[1])
    ints = _topk_model([2, 900], 33, 1, 0, TensorProto.INT32)
    module = build(ints, executor=executor, cache=shared_cache(), progress=False).load()
    x = rng.integers(-20, 20, (2, 900)).astype(np.int32)  # (many ties: the lower index first)
    got, want = module.run({"x": x}), model_zoo.onnxruntime_outputs(ints, {"x": x})
    np.testing.assert_array_equal(got["i"], want["i"])
    np.testing.assert_array_equal(got["v"], want["v"])


def test_topk_of_constants_folds_as_the_kernel_orders(executor):
    x = _line(np.random.default_rng(4), (2, 50), True, True)
    for largest in (1, 0):
        model = _topk_model([2, 50], 20, 1, largest, constant=x)
        got = build(model, executor=executor, cache=shared_cache(), progress=False).load().run({})
        want = ReferenceEvaluator(model).run(None, {})
        np.testing.assert_array_equal(got["i"], want[1])


def test_topk_of_a_count_known_at_run_time(executor):
    """The best min(5, n) of a selection n long (a detector's top candidates after its score
    threshold): k a size computed from a count."""
    nodes = [H.make_node("Greater", ["x", "zero"], ["keep"]), H.make_node("Compress", ["x", "keep"], ["kept"]),
             H.make_node("Shape", ["kept"], ["n"]), H.make_node("Min", ["n", "five"], ["k"]),
             H.make_node("TopK", ["kept", "k"], ["v", "i"])]
    graph = H.make_graph(nodes, "g", [H.make_tensor_value_info("x", TensorProto.FLOAT, [40])],
                         [H.make_tensor_value_info("v", TensorProto.FLOAT, None),
                          H.make_tensor_value_info("i", TensorProto.INT64, None)],
                         [numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
                          numpy_helper.from_array(np.array([5], np.int64), "five")])
    model = H.make_model(graph, opset_imports=[H.make_opsetid("", 17)], ir_version=9)
    module = build(model, executor=executor, cache=shared_cache(), progress=False).load()
    rng = np.random.default_rng(5)
    for shift in (-3.0, -1.5, 0.0, 3.0):  # (from no element kept to all)
        x = (rng.standard_normal(40) + shift).astype(np.float32)
        got, want = module.run({"x": x}), model_zoo.onnxruntime_outputs(model, {"x": x})
        assert got["v"].shape == want["v"].shape
        np.testing.assert_array_equal(got["i"], want["i"])
