"""GridSample in every mode, padding mode and corner convention, against onnxruntime: grids
reaching past the image (up to several image widths, where reflection folds more than once),
the grid computed by the ops before it and the output used by the ops after it, as in a
spatial transformer. onnx's own 18 cases run in the conformance table as well."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from modelkiln.orchestrator.api import build
from tests import model_zoo
from tests.conftest import shared_cache

F = TensorProto.FLOAT


def _model(x_shape, grid_shape, opset=20, **attrs):
    """x, g -> GridSample(x, 2.5 * tanh(g) + 0.1) -> Relu: the grid fused before, Relu after."""
    nodes = [helper.make_node("Tanh", ["g"], ["t"]), helper.make_node("Mul", ["t", "reach"], ["r"]),
             helper.make_node("Add", ["r", "shift"], ["grid"]),
             helper.make_node("GridSample", ["x", "grid"], ["s"], **attrs), helper.make_node("Relu", ["s"], ["y"])]
    graph = helper.make_graph(nodes, "gs", [helper.make_tensor_value_info("x", F, x_shape),
                                            helper.make_tensor_value_info("g", F, grid_shape)],
                              [helper.make_tensor_value_info("y", F, None)],
                              [numpy_helper.from_array(np.array(2.5, np.float32), "reach"),
                               numpy_helper.from_array(np.array(0.1, np.float32), "shift")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


def _compare(model, x_shape, grid_shape, executor, seed=0):
    rng = np.random.default_rng(seed)
    feeds = {"x": rng.standard_normal(x_shape).astype(np.float32),
             "g": rng.standard_normal(grid_shape).astype(np.float32)}
    got = build(model, executor=executor, cache=shared_cache(), progress=False).load().run(feeds)["y"]
    want = model_zoo.onnxruntime_outputs(model, feeds)["y"]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["linear", "nearest", "cubic"])
@pytest.mark.parametrize("padding_mode", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("align_corners", [0, 1])
def test_grid_sample_2d(mode, padding_mode, align_corners, executor):
    _compare(_model([2, 3, 5, 7], [2, 4, 6, 2], mode=mode, padding_mode=padding_mode, align_corners=align_corners),
             [2, 3, 5, 7], [2, 4, 6, 2], executor)


@pytest.mark.parametrize("mode", ["bilinear", "nearest", "bicubic"])
def test_grid_sample_of_opset_16_names_its_modes_as_then(mode, executor):
    _compare(_model([1, 2, 4, 4], [1, 3, 3, 2], opset=16, mode=mode, padding_mode="reflection"),
             [1, 2, 4, 4], [1, 3, 3, 2], executor)


@pytest.mark.parametrize("mode", ["linear", "nearest"])
def test_grid_sample_volumetric(mode, executor):
    _compare(_model([1, 2, 3, 4, 5], [1, 2, 3, 4, 3], mode=mode, padding_mode="border"), [1, 2, 3, 4, 5],
             [1, 2, 3, 4, 3], executor)


def test_a_grid_of_the_wrong_shape_is_refused_by_name():
    from modelkiln.ir.errors import KilnError
    model = _model([1, 2, 4, 4], [1, 3, 3, 3])
    model.graph.node[3].name = "sampler"
    with pytest.raises(KilnError, match=r"'sampler'.*grid"):
        build(model, cache=None, progress=False)


@pytest.mark.parametrize("align_corners", [0, 1])
def test_a_spatial_transformer_affine_grid_then_grid_sample(align_corners, executor):
    """AffineGrid (built from its onnx function body: an If in it) makes the grid a predicted
    theta gives; GridSample warps the image by it, as a spatial transformer network does."""
    nodes = [helper.make_node("AffineGrid", ["theta", "size"], ["grid"], align_corners=align_corners),
             helper.make_node("GridSample", ["x", "grid"], ["y"], align_corners=align_corners)]
    graph = helper.make_graph(nodes, "stn", [helper.make_tensor_value_info("x", F, [2, 3, 6, 8]),
                                             helper.make_tensor_value_info("theta", F, [2, 2, 3])],
                              [helper.make_tensor_value_info("y", F, None)],
                              [numpy_helper.from_array(np.array([2, 3, 5, 7], np.int64), "size")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=9)
    rng = np.random.default_rng(1)
    theta = (np.array([[1, 0, 0], [0, 1, 0]], np.float32) + 0.3 * rng.standard_normal((2, 2, 3))).astype(np.float32)
    feeds = {"x": rng.standard_normal((2, 3, 6, 8)).astype(np.float32), "theta": theta}
    got = build(model, executor=executor, cache=shared_cache(), progress=False).load().run(feeds)["y"]
    np.testing.assert_allclose(got, model_zoo.onnxruntime_outputs(model, feeds)["y"], rtol=1e-4, atol=1e-5)


def test_an_image_of_run_time_size_is_refused_by_name():
    """The image's sizes must be known at build time (the grid's may vary)."""
    from modelkiln.ir.errors import KilnError
    model = _model([1, 2, "h", "w"], [1, 3, 3, 2])
    model.graph.node[3].name = "sampler"
    with pytest.raises(KilnError, match=r"'sampler'.*known at run time"):
        build(model, dims={"h": (2, 8), "w": (2, 8)}, cache=None, progress=False)
