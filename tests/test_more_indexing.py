"""ReverseSequence, Det, Col2Im, Upsample and Scatter (the old names of Resize and
ScatterElements) against onnxruntime, numpy and onnx's reference evaluator: each in the forms
models use, beyond onnx's one or two node cases."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from modelkiln.orchestrator.api import build
from tests import model_zoo
from tests.conftest import shared_cache

H = helper


def _model(nodes, inputs, outputs, inits=(), opset=17):
    graph = H.make_graph(nodes, "g", [H.make_tensor_value_info(n, t, s) for n, t, s in inputs],
                         [H.make_tensor_value_info(n, t, None) for n, t in outputs], list(inits))
    return H.make_model(graph, opset_imports=[H.make_opsetid("", opset)], ir_version=8)


@pytest.mark.parametrize("batch_axis,time_axis", [(1, 0), (0, 1)])
def test_reverse_sequence(batch_axis, time_axis, executor):
    """A bidirectional RNN's reversal of each sequence's first length steps, lengths fed at
    run time (0 and the whole length among them), over a 3-D tensor."""
    shape = [5, 4, 6] if batch_axis == 1 else [4, 5, 6]
    node = H.make_node("ReverseSequence", ["x", "lengths"], ["y"], batch_axis=batch_axis, time_axis=time_axis)
    model = _model([node], [("x", TensorProto.FLOAT, shape), ("lengths", TensorProto.INT64, [4])],
                   [("y", TensorProto.FLOAT)])
    module = build(model, executor=executor, cache=shared_cache(), progress=False).load()
    steps = shape[time_axis]
    x = np.random.default_rng(time_axis).standard_normal(shape).astype(np.float32)
    lengths = np.array([0, steps, 1, steps - 2], np.int64)
    np.testing.assert_array_equal(module.run({"x": x, "lengths": lengths})["y"],
                                  model_zoo.onnxruntime_outputs(model, {"x": x, "lengths": lengths})["y"])


def test_det_of_a_batch_of_matrices(executor):
    """Determinants of [2, 3] matrices of 1x1, 3x3 and 6x6 (one singular, one needing a row
    swap first), against numpy's."""
    rng = np.random.default_rng(2)
    for n in (1, 3, 6):
        model = _model([H.make_node("Det", ["x"], ["d"])], [("x", TensorProto.FLOAT, [2, 3, n, n])],
                       [("d", TensorProto.FLOAT)], opset=22)
        x = rng.standard_normal((2, 3, n, n)).astype(np.float32)
        if n > 1:
            x[0, 0, -1] = x[0, 0, 0]  # (singular: two equal rows)
            x[0, 1, 0, 0] = 0.0  # (a zero first pivot)
        got = build(model, executor=executor, cache=shared_cache(), progress=False).load().run({"x": x})["d"]
        np.testing.assert_allclose(got, np.linalg.det(x.astype(np.float64)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_upsample_is_resize_of_opset_9(mode, executor):
    scales = numpy_helper.from_array(np.array([1, 1, 2, 3], np.float32), "scales")
    model = _model([H.make_node("Upsample", ["x", "scales"], ["y"], mode=mode)],
                   [("x", TensorProto.FLOAT, [1, 2, 3, 4])], [("y", TensorProto.FLOAT)], [scales], opset=9)
    x = np.random.default_rng(3).standard_normal((1, 2, 3, 4)).astype(np.float32)
    got = build(model, executor=executor, cache=shared_cache(), progress=False).load().run({"x": x})["y"]
    np.testing.assert_allclose(got, model_zoo.onnxruntime_outputs(model, {"x": x})["y"], rtol=1e-6, atol=1e-6)


def test_scatter_is_scatter_elements(executor):
    model = _model([H.make_node("Scatter", ["data", "indices", "updates"], ["y"], axis=1)],
                   [("data", TensorProto.FLOAT, [3, 5]), ("indices", TensorProto.INT64, [3, 2]),
                    ("updates", TensorProto.FLOAT, [3, 2])], [("y", TensorProto.FLOAT)], opset=10)
    feeds = {"data": np.zeros((3, 5), np.float32), "indices": np.array([[0, 4], [1, 3], [3, 2]], np.int64),
             "updates": np.arange(1, 7, dtype=np.float32).reshape(3, 2)}
    got = build(model, executor=executor, cache=shared_cache(), progress=False).load().run(feeds)["y"]
    np.testing.assert_array_equal(got, model_zoo.onnxruntime_outputs(model, feeds)["y"])


@pytest.mark.parametrize("image,block,attrs", [
    ([7, 9], [3, 2], {"strides": [2, 1], "dilations": [1, 2], "pads": [1, 0, 2, 1]}),
    ([6, 6], [2, 2], {}),
    ([4, 5, 3], [2, 3, 2], {"strides": [1, 2, 1], "pads": [0, 1, 1, 1, 0, 0]})])
def test_col2im(image, block, attrs, executor):
    """Overlapping blocks summed back (strides, dilations, padding; a volume too), as an
    input and as a constant folded at build time, against onnx's reference evaluator."""
    from onnx.reference import ReferenceEvaluator
    dims = len(image)
    strides, dilations = attrs.get("strides", [1] * dims), attrs.get("dilations", [1] * dims)
    pads = attrs.get("pads", [0] * 2 * dims)
    blocks = [(image[d] + pads[d] + pads[d + dims] - dilations[d] * (block[d] - 1) - 1) // strides[d] + 1
              for d in range(dims)]
    shape = [2, 3 * int(np.prod(block)), int(np.prod(blocks))]
    x = np.random.default_rng(dims).standard_normal(shape).astype(np.float32)
    sizes = [numpy_helper.from_array(np.array(image, np.int64), "image"),
             numpy_helper.from_array(np.array(block, np.int64), "block")]
    node = H.make_node("Col2Im", ["x", "image", "block"], ["y"], **attrs)
    for constant in (False, True):
        inits = sizes + ([numpy_helper.from_array(x, "x")] if constant else [])
        model = _model([node], [] if constant else [("x", TensorProto.FLOAT, shape)], [("y", TensorProto.FLOAT)],
                       inits, opset=18)
        got = build(model, executor=executor, cache=shared_cache(), progress=False).load().run({} if constant else {"x": x})
        want = ReferenceEvaluator(model).run(None, {} if constant else {"x": x})[0]
        np.testing.assert_allclose(got["y"], want, rtol=1e-5, atol=1e-5)
