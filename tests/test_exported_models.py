"""Graphs that real exporters wrote and the zoo lacked: each case is the smallest model with
the pattern of an architecture (timm, torchvision, transformers, exported by torch.onnx)
that Kiln refused, got wrong or ran far slower than onnxruntime. onnxruntime, numpy or
onnx's reference evaluator is the oracle."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from modelkiln.orchestrator.api import build
from tests.conftest import build_and_compare
from tests.model_zoo import GraphMaker
from tests.test_passes import ops, run_passes

F = TensorProto.FLOAT


def test_residual_batchnorm_read_in_the_conv_epilogue(executor):
    """RepVGG / FastViT: relu(conv3x3(x) + conv1x1(x) + bn(x)). The identity branch's
    BatchNorm has no conv to fold into; it is computed inside the 3x3 conv's kernel, at the
    epilogue's (batch, channel, pixel) points (the build had failed with an IndexError)."""
    g = GraphMaker(11)
    three, one = g.conv("x", 16, 16, 3), g.conv("x", 16, 16, 1)
    y = g.op("Relu", [g.op("Add", [g.op("Add", [three, one]), g.bn("x", 16)])])
    build_and_compare(g.model({"x": [1, 16, 14, 14]}, [y]), executor)


def test_channel_slice_of_a_concat_read_in_the_conv_epilogue(executor):
    """GhostNet: a ghost module's output (Concat of a conv and a depthwise conv of it, sliced
    to the block's channels) added to the shortcut conv. The Concat and Slice are inlined into
    the shortcut conv's epilogue; they used to index its collapsed (channel, pixel) points as
    (channel, row, column) and read the wrong elements, silently (2.9e-3 off on GhostNet)."""
    g = GraphMaker(12)
    primary = g.conv("x", 8, 6, 1)
    cheap = g.conv(primary, 6, 6, 3, group=6)
    ghost = g.op("Slice", [g.op("Concat", [primary, cheap], axis=1), g.const(np.array([0], np.int64)),
                           g.const(np.array([10], np.int64)), g.const(np.array([1], np.int64))])
    shortcut = g.conv("x", 8, 10, 1)
    y = g.op("Add", [ghost, shortcut])
    build_and_compare(g.model({"x": [1, 8, 12, 12]}, [y]), executor)


def _batchnorm_training_model(shape, outputs: int, momentum=0.9):
    rng = np.random.default_rng(5)
    c = shape[1]
    inits = [numpy_helper.from_array(v.astype(np.float32), n) for v, n in (
        (rng.random(c) + 0.5, "scale"), (rng.standard_normal(c), "bias"),
        (rng.standard_normal(c), "mean"), (rng.random(c) + 0.5, "var"))]
    names = ["y", "running_mean", "running_var"][:outputs]
    node = helper.make_node("BatchNormalization", ["x", "scale", "bias", "mean", "var"], names,
                            training_mode=1, epsilon=1e-3, momentum=momentum)
    graph = helper.make_graph([node], "bn_training", [helper.make_tensor_value_info("x", F, shape)],
                              [helper.make_tensor_value_info(n, F, None) for n in names], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)], ir_version=8)


@pytest.mark.parametrize("shape,outputs", [([4, 3, 5, 5], 3), ([2, 6, 7], 1), ([8, 5], 3)])
def test_batchnorm_in_training_mode(shape, outputs, executor):
    """training_mode=1 normalizes with the batch's own statistics and outputs the running ones
    updated; onnx's reference evaluator is the oracle."""
    model = _batchnorm_training_model(shape, outputs)
    x = (np.random.default_rng(6).standard_normal(shape) * 3 + 1).astype(np.float32)
    got = build(model, executor=executor, cache=None, progress=False).load().run({"x": x})
    want = ReferenceEvaluator(model).run(None, {"x": x})
    for name, w in zip(["y", "running_mean", "running_var"], want):
        np.testing.assert_allclose(got[name], w, rtol=1e-4, atol=1e-5, err_msg=name)


def test_weight_standardized_conv(executor):
    """timm's NFNets standardize each conv's weights with a BatchNormalization in training
    mode over the weights themselves (as exported): a constant, folded at build time."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal((12, 6, 3, 3)).astype(np.float32)
    gain = (rng.random(12) + 0.5).astype(np.float32)
    inits = [numpy_helper.from_array(w.reshape(1, 12, -1), "w_rows"), numpy_helper.from_array(gain, "gain"),
             numpy_helper.from_array(np.zeros(12, np.float32), "zeros"),
             numpy_helper.from_array(np.ones(12, np.float32), "ones"),
             numpy_helper.from_array(np.array(w.shape, np.int64), "w_shape")]
    nodes = [helper.make_node("BatchNormalization", ["w_rows", "gain", "zeros", "zeros", "ones"], ["w_std"],
                              training_mode=1, epsilon=1e-5, momentum=0.0),
             helper.make_node("Reshape", ["w_std", "w_shape"], ["w"]),
             helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])]
    graph = helper.make_graph(nodes, "ws_conv", [helper.make_tensor_value_info("x", F, [1, 6, 10, 10])],
                              [helper.make_tensor_value_info("y", F, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)], ir_version=8)
    assert "BatchNormalization" not in ops(run_passes(model))  # (folded: its input is a constant)
    x = np.random.default_rng(8).standard_normal((1, 6, 10, 10)).astype(np.float32)
    got = build(model, executor=executor, cache=None, progress=False).load().run({"x": x})["y"]
    np.testing.assert_allclose(got, ReferenceEvaluator(model).run(None, {"x": x})[0], rtol=1e-4, atol=1e-4)
