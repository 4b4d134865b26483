"""MaxPool's Indices output and MaxUnpool (ir/ops/pool_indices.py), against onnxruntime, and
against onnx's reference evaluator where the two disagree (an output_shape larger than the
pool's inferred input: see the last test)."""
import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from modelkiln.orchestrator.api import build
from tests.conftest import shared_cache


def _model(nodes, x_shape, outputs, inits=()):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info(n, t, None) for n, t in outputs], list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)])


def _onnxruntime(model, feeds):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in model.graph.output], session.run(None, feeds)))


def _kiln(model, feeds, executor):
    return build(model, executor=executor, cache=shared_cache(), progress=False).load().run(feeds)


@pytest.mark.parametrize("shape,attrs", [
    ([2, 3, 9, 11], dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    ([2, 3, 8, 8], dict(kernel_shape=[2, 2], strides=[2, 2])),
    ([1, 2, 10, 9], dict(kernel_shape=[3, 3], dilations=[2, 2], pads=[2, 2, 2, 2])),
    ([1, 2, 9, 9], dict(kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1)),
    ([1, 2, 7, 6], dict(kernel_shape=[3, 2], strides=[2, 1], storage_order=1)),
    ([2, 3, 17], dict(kernel_shape=[3], strides=[2], pads=[1, 1])),
    ([1, 2, 5, 6, 7], dict(kernel_shape=[2, 3, 2], strides=[2, 2, 2])),
], ids=["3x3-s2-pad", "2x2-s2", "dilated", "ceil", "storage-order", "1d", "3d"])
def test_max_pool_indices_match_onnxruntime(shape, attrs, executor):
    model = _model([helper.make_node("MaxPool", ["x"], ["y", "i"], **attrs)], shape,
                   [("y", TensorProto.FLOAT), ("i", TensorProto.INT64)])
    x = np.random.default_rng(len(shape) + sum(shape)).standard_normal(shape).astype(np.float32)
    got, want = _kiln(model, {"x": x}, executor), _onnxruntime(model, {"x": x})
    np.testing.assert_array_equal(got["y"], want["y"])
    assert got["i"].dtype == np.int64
    np.testing.assert_array_equal(got["i"], want["i"])


def test_the_first_tap_inside_wins_a_window_of_minus_infinity(executor):
    """A window whose every value is -inf points at its first tap inside the input, as
    onnxruntime has it. (onnx 1.23's reference evaluator is no oracle here: it gives -1 for
    the corner window and 13 where the window's maximum, 1.0, is at 15.)"""
    x = np.full((1, 1, 4, 4), -np.inf, np.float32)
    x[0, 0, 3, 3] = 1.0
    model = _model([helper.make_node("MaxPool", ["x"], ["y", "i"], kernel_shape=[3, 3], pads=[1, 1, 1, 1])],
                   [1, 1, 4, 4], [("y", TensorProto.FLOAT), ("i", TensorProto.INT64)])
    got, want = _kiln(model, {"x": x}, executor), _onnxruntime(model, {"x": x})
    np.testing.assert_array_equal(got["y"], want["y"])
    np.testing.assert_array_equal(got["i"], want["i"])


@pytest.mark.parametrize("output_shape", [False, True], ids=["inferred", "given"])
def test_segnet_style_pool_and_unpool_match_onnxruntime(output_shape, executor):
    """A SegNet decoder step: pool with indices, a conv on the pooled map, unpool with the
    pool's indices back to the pool's input size (inferred from the window, or given)."""
    rng = np.random.default_rng(16)
    w = numpy_helper.from_array(rng.standard_normal((4, 4, 3, 3)).astype(np.float32) * 0.3, "w")
    shape = numpy_helper.from_array(np.array([2, 4, 12, 10], np.int64), "shape")
    nodes = [helper.make_node("MaxPool", ["x"], ["p", "i"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Conv", ["p", "w"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("MaxUnpool", ["c", "i"] + (["shape"] if output_shape else []), ["y"],
                              kernel_shape=[2, 2], strides=[2, 2])]
    model = _model(nodes, [2, 4, 12, 10], [("y", TensorProto.FLOAT)], [w, shape])
    x = rng.standard_normal((2, 4, 12, 10)).astype(np.float32)
    got, want = _kiln(model, {"x": x}, executor)["y"], _onnxruntime(model, {"x": x})["y"]
    assert got.shape == (2, 4, 12, 10)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.count_nonzero(got) == 2 * 4 * 6 * 5  # one value back per window


def test_unpool_into_a_larger_output_shape_follows_onnx(executor):
    """With an output_shape larger than the shape the window infers, onnx (its reference
    evaluator and its node test case) reads the indices in the inferred shape and places
    that at the output's top-left corner; onnxruntime reads them in the output's shape. The
    two agree wherever the shapes are equal (the test above); here Kiln follows onnx."""
    x = np.array([[[[5, 6], [7, 8]]]], np.float32)
    i = np.array([[[[5, 7], [13, 15]]]], np.int64)
    graph = helper.make_graph(
        [helper.make_node("MaxUnpool", ["x", "i", "shape"], ["y"], kernel_shape=[2, 2], strides=[2, 2])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 2, 2]),
         helper.make_tensor_value_info("i", TensorProto.INT64, [1, 1, 2, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.array([1, 1, 5, 5], np.int64), "shape")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)])
    got = _kiln(model, {"x": x, "i": i}, executor)["y"]
    np.testing.assert_array_equal(got, ReferenceEvaluator(model).run(None, {"x": x, "i": i})[0])
    assert got[0, 0, 1, 1] == 5 and got[0, 0, 3, 3] == 8


def test_indices_over_run_time_sizes_are_refused_by_name():
    """(Refused by type inference, naming the node, before anything is lowered.)"""
    model = _model([helper.make_node("MaxPool", ["x"], ["y", "i"], kernel_shape=[2, 2], strides=[2, 2])],
                   [1, 2, "h", "w"], [("y", TensorProto.FLOAT), ("i", TensorProto.INT64)])
    with pytest.raises(Exception, match="MaxPool's Indices of .* sizes known at run time only"):
        build(model, executor="inprocess", cache=None, progress=False, dims={"h": (2, 32), "w": (2, 32)})
