"""Sizes computed in float32 from the input's sizes, as torchvision's detectors resize an image
of any size (`floor(h * min(320 / min(h, w), 640 / max(h, w)))`) and pad it to a multiple of
32: one build for every size, each call sized as onnxruntime sizes it."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from modelkiln.ir.errors import KilnError
from modelkiln.orchestrator.api import build
from tests import model_zoo
from tests.conftest import shared_cache

H = helper
F, I64 = TensorProto.FLOAT, TensorProto.INT64
BOUNDS = {"h": (64, 1024), "w": (64, 1024)}


def _model(nodes, outputs, inits):
    graph = H.make_graph(nodes, "g", [H.make_tensor_value_info("x", F, [1, 3, "h", "w"])],
                         [H.make_tensor_value_info(n, t, None) for n, t in outputs],
                         [numpy_helper.from_array(np.asarray(v), n) for n, v in inits.items()])
    return H.make_model(graph, opset_imports=[H.make_opsetid("", 17)], ir_version=9)


def _resize_model():
    """GeneralizedRCNNTransform's resize as its TorchScript export spells it; the scale is an
    output too (the nodes computing it still run, for what reads it as data)."""
    nodes = [H.make_node("Shape", ["x"], ["shape"]), H.make_node("Slice", ["shape", "two", "four"], ["hw"]),
             H.make_node("ReduceMin", ["hw"], ["short"], keepdims=0),
             H.make_node("ReduceMax", ["hw"], ["long"], keepdims=0)]
    for side, limit in (("short", "min_size"), ("long", "max_size")):
        nodes += [H.make_node("Cast", [side], [f"{side}_f"], to=F),
                  H.make_node("Reciprocal", [f"{side}_f"], [f"{side}_inv"]),
                  H.make_node("Mul", [f"{side}_inv", limit], [f"{side}_scale"])]
    nodes += [H.make_node("Min", ["short_scale", "long_scale"], ["scale"]),
              H.make_node("Cast", ["hw"], ["hw_f"], to=F), H.make_node("Mul", ["hw_f", "scale"], ["scaled"]),
              H.make_node("Floor", ["scaled"], ["floored"]), H.make_node("Cast", ["floored"], ["new_hw"], to=I64),
              H.make_node("Concat", ["batch_channels", "new_hw"], ["sizes"], axis=0),
              H.make_node("Resize", ["x", "", "", "sizes"], ["y"], mode="linear")]
    inits = {"two": np.array([2], np.int64), "four": np.array([4], np.int64), "min_size": np.float32(320),
             "max_size": np.float32(640), "batch_channels": np.array([1, 3], np.int64)}
    return _model(nodes, [("y", F), ("scale", F)], inits)


SIZES = [(64, 64), (333, 500), (97, 1000), (1024, 1024), (777, 131), (480, 640)]


def test_an_image_resized_as_torchvisions_detectors_resize_it(executor):
    model = _resize_model()
    module = build(model, executor=executor, cache=shared_cache(), progress=False, dims=BOUNDS).load()
    rng = np.random.default_rng(0)
    for h, w in SIZES:
        x = rng.random((1, 3, h, w), dtype=np.float32)
        got, want = module.run({"x": x}), model_zoo.onnxruntime_outputs(model, {"x": x})
        assert got["y"].shape == want["y"].shape, (h, w)
        # (the scale out / in: onnxruntime rounds it to float32, Kiln keeps the ratio of the sizes)
        np.testing.assert_allclose(got["y"], want["y"], rtol=1e-4, atol=1e-4)
        assert got["scale"] == want["scale"]


def test_the_sizes_bounds_are_the_values_they_take(executor):
    """Bounds from intervals would let h * 320 / min(h, w) reach 5120; over the grid of h
    and w the sizes stay within [40, 640] and reach both ends (numpy in float32 the oracle)."""
    module = build(_resize_model(), executor=executor, cache=shared_cache(), progress=False, dims=BOUNDS).load()
    h, w = np.meshgrid(np.arange(64, 1025), np.arange(64, 1025), indexing="ij")
    short, long = np.minimum(h, w).astype(np.float32), np.maximum(h, w).astype(np.float32)
    scale = np.minimum(np.float32(1) / short * np.float32(320), np.float32(1) / long * np.float32(640))
    new_h = np.floor(h.astype(np.float32) * scale).astype(np.int64)
    (bounds,) = {(d["least"], d["greatest"]) for d in module.manifest.derived if d["name"].startswith("new_hw")}
    assert bounds == (new_h.min(), new_h.max()) == (40, 640)


def test_a_batch_padded_to_a_multiple_of_32(executor):
    """ceil(h / 32) * 32 computed in floats, the pad its difference from h."""
    nodes = [H.make_node("Shape", ["x"], ["shape"]), H.make_node("Slice", ["shape", "two", "four"], ["hw"]),
             H.make_node("Cast", ["hw"], ["hw_f"], to=F), H.make_node("Div", ["hw_f", "stride"], ["blocks"]),
             H.make_node("Ceil", ["blocks"], ["whole"]), H.make_node("Mul", ["whole", "stride"], ["padded_f"]),
             H.make_node("Cast", ["padded_f"], ["padded"], to=I64), H.make_node("Sub", ["padded", "hw"], ["extra"]),
             H.make_node("Concat", ["zeros", "extra"], ["pads"], axis=0),
             H.make_node("Pad", ["x", "pads"], ["y"])]
    inits = {"two": np.array([2], np.int64), "four": np.array([4], np.int64), "stride": np.float32(32),
             "zeros": np.zeros(6, np.int64)}
    model = _model(nodes, [("y", F)], inits)
    module = build(model, executor=executor, cache=shared_cache(), progress=False, dims=BOUNDS).load()
    for h, w in ((64, 64), (65, 95), (1000, 1024)):
        x = np.ones((1, 3, h, w), np.float32)
        got, want = module.run({"x": x}), model_zoo.onnxruntime_outputs(model, {"x": x})
        assert got["y"].shape == want["y"].shape == (1, 3, -(-h // 32) * 32, -(-w // 32) * 32)
        np.testing.assert_array_equal(got["y"], want["y"])


def test_a_float_size_without_a_bound_is_refused_naming_the_op(executor):
    """1 / (h - 64) may divide by zero within h's bounds: no bound for the size, so the
    Resize that would need it names it."""
    nodes = [H.make_node("Shape", ["x"], ["shape"]), H.make_node("Slice", ["shape", "two", "three"], ["h"]),
             H.make_node("Sub", ["h", "sixty_four"], ["d"]), H.make_node("Cast", ["d"], ["d_f"], to=F),
             H.make_node("Reciprocal", ["d_f"], ["inv"]), H.make_node("Cast", ["inv"], ["n"], to=I64),
             H.make_node("Concat", ["head", "n", "n"], ["sizes"], axis=0),
             H.make_node("Resize", ["x", "", "", "sizes"], ["y"], name="grow")]
    inits = {"two": np.array([2], np.int64), "three": np.array([3], np.int64),
             "sixty_four": np.array([64], np.int64), "head": np.array([1, 3], np.int64)}
    with pytest.raises(KilnError, match="grow.*sizes"):
        build(_model(nodes, [("y", F)], inits), executor=executor, cache=None, progress=False, dims=BOUNDS)


def test_a_float_computed_from_sizes_that_may_be_negative_stays_data(executor):
    """int(h - 100.5) is no size for h in [64, 1024] (it may be negative): the Cast runs on
    the data, and the value is onnxruntime's at either sign."""
    nodes = [H.make_node("Shape", ["x"], ["shape"]), H.make_node("Slice", ["shape", "two", "three"], ["h"]),
             H.make_node("Cast", ["h"], ["h_f"], to=F), H.make_node("Sub", ["h_f", "offset"], ["d"]),
             H.make_node("Cast", ["d"], ["y"], to=I64)]
    inits = {"two": np.array([2], np.int64), "three": np.array([3], np.int64), "offset": np.float32(100.5)}
    model = _model(nodes, [("y", I64)], inits)
    module = build(model, executor=executor, cache=shared_cache(), progress=False, dims=BOUNDS).load()
    for h in (64, 100, 101, 1024):
        x = np.zeros((1, 3, h, 70), np.float32)
        np.testing.assert_array_equal(module.run({"x": x})["y"], model_zoo.onnxruntime_outputs(model, {"x": x})["y"])
