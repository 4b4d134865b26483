"""RoiAlign against onnxruntime: both coordinate modes, average and max, fixed and adaptive
sampling, regions reaching past the map, and a two-stage detector's second stage pooling
the boxes a NonMaxSuppression kept (a count of regions known only at run time)."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from modelkiln.orchestrator.api import build
from tests import model_zoo
from tests.test_counted_sizes import _boxes
from tests.conftest import shared_cache

H = helper


def _model(nodes, inputs, outputs, inits=(), opset=17):
    graph = H.make_graph(nodes, "g", [H.make_tensor_value_info(n, t, s) for n, t, s in inputs],
                         [H.make_tensor_value_info(n, t, None) for n, t in outputs], list(inits))
    return H.make_model(graph, opset_imports=[H.make_opsetid("", opset)], ir_version=9)


def _regions(rng, count: int, side: float) -> np.ndarray:
    """Boxes [x1, y1, x2, y2] in image pixels, some reaching past the map's edges."""
    corner = rng.random((count, 2)) * side * 1.1 - side * 0.05
    return np.concatenate([corner, corner + 1 + rng.random((count, 2)) * side * 0.6], 1).astype(np.float32)


@pytest.mark.parametrize("mode,transform,ratio", [("avg", "half_pixel", 0), ("avg", "output_half_pixel", 2),
                                                  ("max", "half_pixel", 2), ("max", "output_half_pixel", 0)])
def test_roi_align_against_onnxruntime(mode, transform, ratio, executor):
    node = H.make_node("RoiAlign", ["x", "rois", "batch"], ["y"], mode=mode, coordinate_transformation_mode=transform,
                       output_height=5, output_width=4, sampling_ratio=ratio, spatial_scale=0.25)
    model = _model([node], [("x", TensorProto.FLOAT, [2, 3, 12, 10]), ("rois", TensorProto.FLOAT, [9, 4]),
                            ("batch", TensorProto.INT64, [9])], [("y", TensorProto.FLOAT)])
    module = build(model, executor=executor, cache=shared_cache(), progress=False).load()
    rng = np.random.default_rng(ratio)
    feeds = {"x": rng.standard_normal((2, 3, 12, 10)).astype(np.float32), "rois": _regions(rng, 9, 44),
             "batch": rng.integers(0, 2, 9).astype(np.int64)}
    np.testing.assert_allclose(module.run(feeds)["y"], model_zoo.onnxruntime_outputs(model, feeds)["y"],
                               rtol=1e-5, atol=1e-5)


def test_a_second_stage_pools_the_boxes_nms_kept(executor):
    """Boxes -> NonMaxSuppression -> the kept boxes gathered -> RoiAlign on a feature map:
    as many pooled regions as the data keep."""
    consts = [numpy_helper.from_array(np.array([6], np.int64), "most"),
              numpy_helper.from_array(np.array([0.4], np.float32), "iou"),
              numpy_helper.from_array(np.array([0.5], np.float32), "floor"),
              numpy_helper.from_array(np.array(2, np.int64), "two"),
              numpy_helper.from_array(np.array(0, np.int64), "zero")]
    nodes = [H.make_node("NonMaxSuppression", ["boxes", "scores", "most", "iou", "floor"], ["selected"]),
             H.make_node("Gather", ["selected", "two"], ["which"], axis=1),
             H.make_node("Gather", ["boxes", "zero"], ["image_boxes"], axis=0),
             H.make_node("Gather", ["image_boxes", "which"], ["kept"], axis=0),
             H.make_node("Gather", ["selected", "zero"], ["batch"], axis=1),
             H.make_node("RoiAlign", ["features", "kept", "batch"], ["pooled"], output_height=7, output_width=7,
                         sampling_ratio=2, spatial_scale=1.0)]
    model = _model(nodes, [("features", TensorProto.FLOAT, [1, 8, 16, 16]), ("boxes", TensorProto.FLOAT, [1, 40, 4]),
                           ("scores", TensorProto.FLOAT, [1, 1, 40])], [("pooled", TensorProto.FLOAT)], consts)
    module = build(model, executor=executor, cache=shared_cache(), progress=False).load()
    rng = np.random.default_rng(9)
    for _ in range(3):
        boxes = _boxes(rng, (1, 40), False) * 1.5  # (corners as [y1, x1, y2, x2]: RoiAlign reads them as x, y)
        feeds = {"features": rng.standard_normal((1, 8, 16, 16)).astype(np.float32), "boxes": boxes,
                 "scores": rng.random((1, 1, 40)).astype(np.float32)}
        got, want = module.run(feeds)["pooled"], model_zoo.onnxruntime_outputs(model, feeds)["pooled"]
        assert got.shape == want.shape and 0 < want.shape[0] <= 6
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
