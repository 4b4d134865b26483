"""Sizes computed from the model's data (ir/ops/value_ranges.py, kiln.ReadSizes): read while
the model runs, within bounds derived from the ops that compute them, at the top level and in
a loop's body each iteration (Mask R-CNN pastes each mask into the image at its box's size),
against onnxruntime."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from modelkiln.ir.errors import KilnError
from modelkiln.ir.frontend_onnx import from_onnx
from modelkiln.ir.ops.inference import resolve
from modelkiln.ir.ops.value_ranges import value_range
from modelkiln.ir.symbolic import greatest
from modelkiln.orchestrator.api import build
from tests import model_zoo
from tests.conftest import shared_cache

F, I64 = TensorProto.FLOAT, TensorProto.INT64


def _model(nodes, inputs, outputs, inits=()):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(*i) for i in inputs],
                              [helper.make_tensor_value_info(o, t, None) for o, t in outputs],
                              [numpy_helper.from_array(np.asarray(v), n) for n, v in inits])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _build(model):
    return build(model, executor="inprocess", cache=shared_cache(), progress=False).load()


def _check(module, model, feeds, atol=1e-5):
    got, want = module.run(feeds), model_zoo.onnxruntime_outputs(model, feeds)
    for name, w in want.items():
        assert got[name].shape == w.shape, name
        np.testing.assert_allclose(got[name], w, rtol=1e-5, atol=atol, err_msg=name)


def _n(node, *args, **attrs):
    return helper.make_node(node, *args, **attrs)


def sized_from_data_model():
    """n = int(clip(max(x) * 4, 1, 6)) decides a Resize's size, a Slice's end and a
    ConstantOfShape's shape; s = int(clip(y, -5, 5)) a Slice's start that may be negative."""
    nodes = [_n("ReduceMax", ["x"], ["m"], keepdims=0), _n("Mul", ["m", "four"], ["m4"]),
             _n("Clip", ["m4", "one", "six"], ["c"]), _n("Cast", ["c"], ["n"], to=I64),
             _n("Unsqueeze", ["n", "zero"], ["n1"]), _n("Concat", ["ones", "n1", "n1"], ["sizes"], axis=0),
             _n("Resize", ["img", "", "", "sizes"], ["resized"], mode="linear"),
             _n("Slice", ["x", "zero", "n1", "one_axis"], ["head"]),
             _n("ConstantOfShape", ["n1"], ["filled"], value=helper.make_tensor("v", F, [1], [2.5])),
             _n("Clip", ["y", "minus5", "five"], ["yc"]), _n("Cast", ["yc"], ["start"], to=I64),
             _n("Unsqueeze", ["start", "zero"], ["start1"]), _n("Slice", ["row", "start1", "big", "zero"], ["tail"])]
    inits = [("four", np.float32(4)), ("one", np.float32(1)), ("six", np.float32(6)), ("zero", np.array([0])),
             ("one_axis", np.array([1])), ("ones", np.array([1, 1])), ("minus5", np.float32(-5)),
             ("five", np.float32(5)), ("big", np.array([100]))]
    return _model(nodes, [("x", F, [1, 8]), ("img", F, [1, 1, 4, 4]), ("y", F, []), ("row", F, [9])],
                  [("resized", F), ("head", F), ("filled", F), ("tail", F)], inits)


def test_sizes_computed_from_data_are_read_as_the_model_runs():
    model = sized_from_data_model()
    module = _build(model)
    rng = np.random.default_rng(0)
    for scale, y in ((0.1, -4.7), (0.5, -1.2), (1.0, 0.0), (2.0, 3.9), (9.0, 7.0)):
        _check(module, model, {"x": (rng.random((1, 8)) * scale).astype(np.float32),
                               "img": rng.standard_normal((1, 1, 4, 4)).astype(np.float32),
                               "y": np.array(y, np.float32), "row": rng.standard_normal(9).astype(np.float32)})


def test_a_size_outside_its_bounds_stops_the_call_by_name():
    """NaN cast to an integer is no size: the module names the size and stops."""
    module = _build(sized_from_data_model())
    feeds = {"x": np.full((1, 8), np.nan, np.float32), "img": np.zeros((1, 1, 4, 4), np.float32),
             "y": np.array(0, np.float32), "row": np.zeros(9, np.float32)}
    with pytest.raises(KilnError, match=r"outside the bounds.*element 2 of 'sizes'.*outside 0\.\.7"):
        module.run(feeds)


def test_a_size_from_unbounded_data_is_refused_naming_where_its_bounds_are_lost():
    nodes = [_n("ReduceMax", ["x"], ["m"], keepdims=0), _n("Cast", ["m"], ["n"], to=I64),
             _n("Unsqueeze", ["n", "zero"], ["n1"]), _n("Slice", ["x", "zero", "n1", "one"], ["head"])]
    model = _model(nodes, [("x", F, [1, 8])], [("head", F)], [("zero", np.array([0])), ("one", np.array([1]))])
    with pytest.raises(KilnError, match=r"'n1'.*computed at run time.*the values of 'x', which the graph reads, "
                                        r"have no bounds"):
        _build(model)


def _ranges(model, *names, dims=None):
    g = resolve(from_onnx(model, dims=dims), fold_floats=False)
    return [value_range(g, n) for n in names]


def test_value_ranges_follow_the_ops():
    """Clip, Max/Min with a bound on one side, per-element Concat and Cast's rounding slack;
    a division by a range holding 0 bounds nothing."""
    nodes = [_n("Clip", ["x", "lo", "hi"], ["c"]), _n("Max", ["x", "lo"], ["at_least"]),
             _n("Min", ["at_least", "hi"], ["both"]), _n("Mul", ["c", "minus2"], ["scaled"]),
             _n("Cast", ["scaled"], ["ints"], to=I64), _n("Concat", ["ones", "ints"], ["joined"], axis=0),
             _n("Div", ["one_f", "c"], ["inverse"]), _n("Sub", ["both", "c"], ["diff"])]
    model = _model(nodes, [("x", F, [2])], [("joined", I64), ("inverse", F), ("diff", F)],
                   [("lo", np.float32(-1)), ("hi", np.float32(3)), ("minus2", np.float32(-2)),
                    ("ones", np.array([1, 1])), ("one_f", np.float32(1))])
    c, both, joined, inverse, diff = _ranges(model, "c", "both", "joined", "inverse", "diff")
    np.testing.assert_array_equal(c[0], [-1, -1]), np.testing.assert_array_equal(c[1], [3, 3])
    np.testing.assert_array_equal(both[0], [-1, -1]), np.testing.assert_array_equal(both[1], [3, 3])
    np.testing.assert_array_equal(joined[0], [1, 1, -7, -7])  # (-6 .. 2, one step of slack each way)
    np.testing.assert_array_equal(joined[1], [1, 1, 3, 3])
    assert inverse is None
    np.testing.assert_array_equal(diff[0], [-4, -4])  # (intervals forget that both and c are one value)


def test_values_that_move_with_the_sizes_are_bounded_together():
    """A detector's boxes clipped to the resized image's width s = w + h, then scaled back by
    w / s (torchvision's resize_boxes): below w at every image size. Interval arithmetic alone
    takes s's greatest times the ratio's, 128 * 64 / 16 = 512 on images of 8 to 64 a side;
    each bound's ends kept as expressions of the sizes and bounded over every size give w's
    greatest, 64 (ir/ops/joint_ranges.py). A Max on one side bounds the clip from below only."""
    nodes = [_n("Shape", ["img"], ["shape"]), _n("Gather", ["shape", "one_s"], ["h"], axis=0),
             _n("Gather", ["shape", "two_s"], ["w"], axis=0), _n("Cast", ["h"], ["hf"], to=F),
             _n("Cast", ["w"], ["wf"], to=F), _n("Add", ["wf", "hf"], ["s"]), _n("Div", ["wf", "s"], ["ratio"]),
             _n("Max", ["boxes", "zero_f"], ["at_least"]), _n("Min", ["at_least", "s"], ["clipped"]),
             _n("Mul", ["clipped", "ratio"], ["scaled"]), _n("Cast", ["scaled"], ["ints"], to=I64)]
    model = _model(nodes, [("img", F, [3, "height", "width"]), ("boxes", F, ["n", 4])], [("ints", I64)],
                   [("one_s", np.array(1)), ("two_s", np.array(2)), ("zero_f", np.float32(0))])
    scaled, ints = _ranges(model, "scaled", "ints", dims={"height": (8, 64), "width": (8, 64), "n": (1, 5)})
    assert scaled[0].min() == 0 and 64 <= scaled[1].max() <= 64.01, scaled
    assert -1 <= ints[0].min() <= 0 and 65 <= ints[1].max() <= 65.01, ints  # (a cast to an integer: a step of slack)


# ---- Mask R-CNN's paste loop, as torchvision's exporter writes it ------------------------------

H_IMG, W_IMG, M = 20, 24, 6  # the image, and each mask's side before the pad of one


def paste_masks_model(dynamic: bool = False):
    """Detections kept by score (NonZero: a count n), their boxes clipped to the image and
    expanded by (M + 2) / M about their centres, cast to int64; masks padded by one. Then,
    for each detection (a Loop over n): the mask resized to its box's width and height (at
    least 1), the part inside the image sliced out and padded with zeros to the image's size,
    appended to the result (`res = torch.cat((res, mask))`), and its box's score appended
    through a Cast as Keypoint R-CNN's loop does. `dynamic`: the image's size is an input's
    [3, height, width], read by Shape, as torchvision's export with dynamic axes reads it."""
    def scalar(name):
        return helper.make_tensor_value_info(name, I64, [])
    body_nodes = [
        _n("Identity", ["cond_in"], ["cond_out"]),
        _n("Gather", ["padded", "i"], ["m1"], axis=0), _n("Gather", ["m1", "zero_s"], ["mask"], axis=0),
        _n("Gather", ["boxes_i", "i"], ["box"], axis=0),
        *[_n("Gather", ["box", f"k{k}"], [f"b{k}"], axis=0) for k in range(4)],
        _n("Sub", ["b2", "b0"], ["w0"]), _n("Add", ["w0", "one_i"], ["w1"]),
        _n("Unsqueeze", ["w1", "zero"], ["w2"]), _n("Concat", ["w2", "one_v"], ["w3"], axis=0),
        _n("ReduceMax", ["w3"], ["w"], keepdims=0),
        _n("Sub", ["b3", "b1"], ["h0"]), _n("Add", ["h0", "one_i"], ["h1"]),
        _n("Unsqueeze", ["h1", "zero"], ["h2"]), _n("Concat", ["h2", "one_v"], ["h3"], axis=0),
        _n("ReduceMax", ["h3"], ["h"], keepdims=0),
        _n("Reshape", ["mask", "mask4_shape"], ["mask4"]),
        _n("Unsqueeze", ["h", "zero"], ["hu"]), _n("Unsqueeze", ["w", "zero"], ["wu"]),
        _n("Concat", ["ones", "hu", "wu"], ["sizes"], axis=0),
        _n("Resize", ["mask4", "", "", "sizes"], ["big"], mode="linear"),
        _n("Gather", ["big", "zero_s"], ["big1"], axis=0), _n("Gather", ["big1", "zero_s"], ["resized"], axis=0),
        *[op for name, v, other, f in (("x_0", "b0", "zero", "ReduceMax"), ("y_0", "b1", "zero", "ReduceMax"))
          for op in (_n("Unsqueeze", [v, "zero"], [f"{name}u"]),
                     _n("Concat", [f"{name}u", other], [f"{name}c"], axis=0),
                     _n(f, [f"{name}c"], [name], keepdims=0))],
        *[op for name, v, limit in (("x_1", "b2", "im_w"), ("y_1", "b3", "im_h"))
          for op in (_n("Add", [v, "one_i"], [f"{name}p"]), _n("Unsqueeze", [f"{name}p", "zero"], [f"{name}u"]),
                     _n("Concat", [f"{name}u", limit], [f"{name}c"], axis=0),
                     _n("ReduceMin", [f"{name}c"], [name], keepdims=0))],
        _n("Sub", ["y_0", "b1"], ["ys"]), _n("Sub", ["y_1", "b1"], ["ye"]),
        _n("Unsqueeze", ["ys", "zero"], ["ysu"]), _n("Unsqueeze", ["ye", "zero"], ["yeu"]),
        _n("Slice", ["resized", "ysu", "yeu", "zero"], ["rows"]),
        _n("Sub", ["x_0", "b0"], ["xs"]), _n("Sub", ["x_1", "b0"], ["xe"]),
        _n("Unsqueeze", ["xs", "zero"], ["xsu"]), _n("Unsqueeze", ["xe", "zero"], ["xeu"]),
        _n("Slice", ["rows", "xsu", "xeu", "one_v"], ["inside"]),
        _n("Shape", ["inside"], ["inside_shape"]), _n("Gather", ["inside_shape", "one_s"], ["cols"], axis=0),
        _n("Unsqueeze", ["cols", "zero"], ["colsu"]),
        _n("Unsqueeze", ["y_0", "zero"], ["y0u"]), _n("Concat", ["y0u", "colsu"], ["top_shape"], axis=0),
        _n("ConstantOfShape", ["top_shape"], ["top"]),
        _n("Sub", ["h_img", "y_1"], ["below"]), _n("Unsqueeze", ["below", "zero"], ["belowu"]),
        _n("Concat", ["belowu", "colsu"], ["bottom_shape"], axis=0),
        _n("ConstantOfShape", ["bottom_shape"], ["bottom"]),
        _n("Concat", ["top", "inside", "bottom"], ["tall"], axis=0),
        _n("Slice", ["tall", "zero", "im_h", "zero"], ["column"]),
        _n("Shape", ["column"], ["column_shape"]), _n("Gather", ["column_shape", "zero_s"], ["col_rows"], axis=0),
        _n("Unsqueeze", ["col_rows", "zero"], ["col_rowsu"]),
        _n("Unsqueeze", ["x_0", "zero"], ["x0u"]), _n("Concat", ["col_rowsu", "x0u"], ["left_shape"], axis=0),
        _n("ConstantOfShape", ["left_shape"], ["left"]),
        _n("Sub", ["w_img", "x_1"], ["right_w"]), _n("Unsqueeze", ["right_w", "zero"], ["right_wu"]),
        _n("Concat", ["col_rowsu", "right_wu"], ["right_shape"], axis=0),
        _n("ConstantOfShape", ["right_shape"], ["right"]),
        _n("Concat", ["left", "column", "right"], ["wide"], axis=1),
        _n("Slice", ["wide", "zero", "im_w", "one_v"], ["pasted"]),
        _n("Unsqueeze", ["pasted", "zero"], ["pasted1"]),
        _n("Concat", ["res_in", "pasted1"], ["res_out"], axis=0),
        _n("Gather", ["kept_scores", "i"], ["score"], axis=0), _n("Unsqueeze", ["score", "zero"], ["score1"]),
        _n("Cast", ["scores_in"], ["scores_as_is"], to=F),
        _n("Concat", ["scores_as_is", "score1"], ["scores_out"], axis=0)]
    body = helper.make_graph(
        body_nodes, "paste",
        [scalar("i"), helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("res_in", F, None), helper.make_tensor_value_info("scores_in", F, None)],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("res_out", F, None), helper.make_tensor_value_info("scores_out", F, None)])
    scale = (M + 2) / M
    nodes = [
        _n("Greater", ["scores", "threshold"], ["keep_mask"]), _n("NonZero", ["keep_mask"], ["keep2"]),
        _n("Reshape", ["keep2", "minus1"], ["keep"]),
        _n("Gather", ["boxes", "keep"], ["kept_boxes"], axis=0),
        _n("Gather", ["scores", "keep"], ["kept_scores"], axis=0),
        _n("Gather", ["masks", "keep"], ["kept_masks"], axis=0),
        _n("Max", ["kept_boxes", "zero_f"], ["b_lo"]), _n("Min", ["b_lo", "image_corner"], ["clipped"]),
        *[_n("Gather", ["clipped", f"k{k}"], [f"c{k}"], axis=1) for k in range(4)],
        _n("Add", ["c0", "c2"], ["sx"]), _n("Mul", ["sx", "half"], ["cx"]),
        _n("Add", ["c1", "c3"], ["sy"]), _n("Mul", ["sy", "half"], ["cy"]),
        _n("Sub", ["c2", "c0"], ["bw"]), _n("Mul", ["bw", "half_scale"], ["hw"]),
        _n("Sub", ["c3", "c1"], ["bh"]), _n("Mul", ["bh", "half_scale"], ["hh"]),
        _n("Sub", ["cx", "hw"], ["e0"]), _n("Sub", ["cy", "hh"], ["e1"]),
        _n("Add", ["cx", "hw"], ["e2"]), _n("Add", ["cy", "hh"], ["e3"]),
        *[_n("Unsqueeze", [f"e{k}", "one_v"], [f"e{k}u"]) for k in range(4)],
        _n("Concat", ["e0u", "e1u", "e2u", "e3u"], ["expanded"], axis=1),
        _n("Cast", ["expanded"], ["boxes_i"], to=I64),
        _n("Pad", ["kept_masks", "mask_pads"], ["padded"]),
        _n("Shape", ["padded"], ["padded_shape"]), _n("Gather", ["padded_shape", "zero_s"], ["trip"], axis=0),
        _n("Loop", ["trip", "", "res0", "scores0"], ["pasted_masks", "pasted_scores"], body=body)]
    image_size = {"image_corner": np.array([W_IMG, H_IMG, W_IMG, H_IMG], np.float32), "im_h": np.array([H_IMG]),
                  "im_w": np.array([W_IMG]), "h_img": np.array(H_IMG), "w_img": np.array(W_IMG),
                  "res0": np.zeros((0, H_IMG, W_IMG), np.float32)}
    inputs = [("boxes", F, [7, 4]), ("scores", F, [7]), ("masks", F, [7, 1, M, M])]
    if dynamic:  # (each of image_size computed from the image's Shape instead)
        nodes[:0] = [_n("Shape", ["image"], ["image_shape"]),
                     _n("Gather", ["image_shape", "one_s"], ["h_img"], axis=0),
                     _n("Gather", ["image_shape", "two_s"], ["w_img"], axis=0),
                     _n("Unsqueeze", ["h_img", "zero"], ["im_h"]), _n("Unsqueeze", ["w_img", "zero"], ["im_w"]),
                     _n("Concat", ["im_w", "im_h", "im_w", "im_h"], ["corner_i"], axis=0),
                     _n("Cast", ["corner_i"], ["image_corner"], to=F),
                     _n("Concat", ["zero", "im_h", "im_w"], ["res0_shape"], axis=0),
                     _n("ConstantOfShape", ["res0_shape"], ["res0"])]
        image_size = {"two_s": np.array(2)}
        inputs.append(("image", F, [3, "height", "width"]))
    inits = [("threshold", np.float32(0.3)), ("minus1", np.array([-1])), ("zero_f", np.float32(0)),
             *image_size.items(), ("half", np.float32(0.5)),
             ("half_scale", np.float32(0.5 * scale)), ("one_v", np.array([1])), ("zero", np.array([0])),
             ("zero_s", np.array(0)), ("one_s", np.array(1)), ("one_i", np.array(1)),
             ("mask_pads", np.array([0, 0, 1, 1, 0, 0, 1, 1])), ("mask4_shape", np.array([1, 1, M + 2, M + 2])),
             ("ones", np.array([1, 1])), ("scores0", np.zeros(0, np.float32)),
             *[(f"k{k}", np.array(k)) for k in range(4)]]
    return _model(nodes, inputs, [("pasted_masks", F), ("pasted_scores", F), ("boxes_i", I64)], inits)


def _detections(rng, kept: int, reach: float = 30):
    """Boxes anywhere from well outside the image (up to `reach`) to inside it, some
    degenerate; `kept` of them scoring above the threshold."""
    corners = rng.uniform(-8, reach, (7, 2)).astype(np.float32)
    sides = rng.uniform(-2, 14, (7, 2)).astype(np.float32)
    boxes = np.concatenate([corners, corners + sides], axis=1)
    scores = np.where(np.arange(7) < kept, 0.5 + 0.4 * rng.random(7), 0.2 * rng.random(7)).astype(np.float32)
    return {"boxes": boxes, "scores": rng.permutation(scores),
            "masks": rng.random((7, 1, M, M)).astype(np.float32)}


def test_masks_pasted_at_their_boxes_sizes_in_a_loop():
    """Each iteration's mask size is read after the kernels computing it; the appended
    results stack as a scan output; every kept count, none included."""
    model = paste_masks_model()
    module = _build(model)
    rng = np.random.default_rng(7)
    for kept in (0, 1, 3, 7, 7, 5):
        _check(module, model, _detections(rng, kept))


def test_masks_pasted_into_images_of_any_size():
    """Mask R-CNN exported with a dynamic image size: one build for every size in the bounds.
    Each pasted mask is cut to the image's height and width from rows and columns that only
    the data bound, so its size is the image's only where Kiln follows the image's size into
    the loop (the captured height a size, not data) and takes each cut at the data's largest;
    the size `zeros(h, n)` reads is the height it names, not one more read from data."""
    model = paste_masks_model(dynamic=True)
    module = build(model, executor="inprocess", cache=None, progress=False,
                   dims={"height": (8, 48), "width": (8, 48)}).load()
    rng = np.random.default_rng(11)
    for (h, w), kept in zip([(20, 24), (9, 40), (48, 8), (33, 17), (48, 48)], (3, 7, 5, 0, 7)):
        feeds = {**_detections(rng, kept, reach=max(h, w) + 4), "image": np.zeros((3, h, w), np.float32)}
        _check(module, model, feeds)
        assert module.run(feeds)["pasted_masks"].shape == (kept, h, w)
    # Outputs side by side in one buffer, each as large as out_shapes says: the module checks
    # they do not overlap by the sizes of this call, not by the bounds'.
    feeds = {**_detections(rng, 3, reach=24), "image": np.zeros((3, 20, 24), np.float32)}
    shapes = module.out_shapes(feeds)
    masks, scores = (int(np.prod(shapes[n])) for n in ("pasted_masks", "pasted_scores"))
    block = np.empty(masks + scores, np.float32)
    out = {"pasted_masks": block[:masks].reshape(shapes["pasted_masks"]),
           "pasted_scores": block[masks:].reshape(shapes["pasted_scores"]),
           "boxes_i": np.empty(shapes["boxes_i"], np.int64)}
    got, want = module.run(feeds, out=out), model_zoo.onnxruntime_outputs(model, feeds)
    np.testing.assert_allclose(got["pasted_masks"], want["pasted_masks"], rtol=1e-5, atol=1e-5)


def test_a_scan_output_of_another_size_each_iteration_stops_the_call():
    """ONNX stacks scan outputs of one shape: a body whose part's size changes with the
    iteration's data is checked each iteration, the size named."""
    body = helper.make_graph(
        [_n("Identity", ["cond_in"], ["cond_out"]), _n("Gather", ["lengths", "i"], ["n"], axis=0),
         _n("Unsqueeze", ["n", "zero"], ["n1"]), _n("Slice", ["row", "zero", "n1", "zero"], ["part"]),
         _n("Identity", ["part"], ["scan"])], "body",
        [helper.make_tensor_value_info("i", I64, []), helper.make_tensor_value_info("cond_in", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), helper.make_tensor_value_info("scan", F, None)])
    nodes = [_n("Clip", ["lengths_f", "one", "nine"], ["c"]), _n("Cast", ["c"], ["lengths"], to=I64),
             _n("Loop", ["trips", "go"], ["stacked"], body=body)]
    model = _model(nodes, [("lengths_f", F, [20]), ("row", F, [9])], [("stacked", F)],
                   [("one", np.float32(1)), ("nine", np.float32(9)), ("zero", np.array([0])),
                    ("trips", np.array(20)), ("go", np.array(True))])
    module = _build(model)
    row = np.arange(9, dtype=np.float32)
    _check(module, model, {"lengths_f": np.full(20, 9, np.float32), "row": row})
    with pytest.raises(KilnError, match=r"differ where the model needs them equal.*must be the same in every "
                                        r"iteration.*: 4 and 9"):
        module.run({"lengths_f": np.full(20, 4, np.float32), "row": row})


def test_a_shape_read_from_data_that_may_be_negative_is_checked_when_read():
    """ConstantOfShape of a size whose bounds reach below 0: built, run where it is not
    negative, and stopped by name where it is (onnxruntime refuses a negative shape too)."""
    nodes = [_n("Clip", ["x", "lo", "hi"], ["c"]), _n("Cast", ["c"], ["n"], to=I64),
             _n("ConstantOfShape", ["n"], ["filled"], value=helper.make_tensor("v", F, [1], [1.5]))]
    model = _model(nodes, [("x", F, [2])], [("filled", F)], [("lo", np.float32(-3)), ("hi", np.float32(5))])
    module = _build(model)
    for x in ((2.0, 3.0), (0.0, 5.0), (4.9, 1.0)):
        _check(module, model, {"x": np.array(x, np.float32)})
    with pytest.raises(KilnError, match=r"differ where the model needs them equal.*dim 1 of its shape must not be "
                                        r"negative"):
        module.run({"x": np.array([2.0, -2.0], np.float32)})


def test_value_ranges_walk_a_long_chain():
    """Bounds through 3000 Adds after a Clip: the walk is no recursion."""
    nodes = [_n("Clip", ["x", "lo", "hi"], ["v0"])] + [_n("Add", [f"v{k}", "one"], [f"v{k + 1}"]) for k in range(3000)]
    model = _model(nodes, [("x", F, [2])], [("v3000", F)],
                   [("lo", np.float32(0)), ("hi", np.float32(2)), ("one", np.float32(1))])
    (r,) = _ranges(model, "v3000")
    np.testing.assert_array_equal(r[0], [3000, 3000]), np.testing.assert_array_equal(r[1], [3002, 3002])



def test_a_cut_to_a_size_is_no_longer_than_that_size():
    """x[:h] of a row whose length only its data bound is at most h's greatest (Mask R-CNN
    cuts each pasted mask to the image's height from a concatenation of data-sized parts),
    and runs as onnxruntime does whether the row is longer or shorter than h."""
    nodes = [_n("ReduceMax", ["y"], ["m"], keepdims=0), _n("Clip", ["m", "zero_f", "forty"], ["c"]),
             _n("Cast", ["c"], ["n"], to=I64), _n("Unsqueeze", ["n", "zero"], ["n1"]),
             _n("Slice", ["row", "zero", "n1", "zero"], ["part"]), _n("Concat", ["part", "part"], ["both"], axis=0),
             _n("Shape", ["img"], ["img_shape"]), _n("Gather", ["img_shape", "zero"], ["h"], axis=0),
             _n("Slice", ["both", "zero", "h", "zero"], ["cut"])]
    model = _model(nodes, [("y", F, [3]), ("row", F, [40]), ("img", F, ["height"])], [("cut", F)],
                   [("zero", np.array([0])), ("zero_f", np.float32(0)), ("forty", np.float32(40))])
    g = resolve(from_onnx(model, dims={"height": (1, 16)}), fold_floats=False)
    assert greatest(g.types["both"].shape[0]) >= 80 and greatest(g.types["cut"].shape[0]) == 16
    module = build(model, executor="inprocess", cache=None, progress=False, dims={"height": (1, 16)}).load()
    rng = np.random.default_rng(5)
    for m, h in ((2.5, 16), (30.0, 9), (0.2, 1), (6.0, 13)):
        _check(module, model, {"y": np.array([m, 0, 0], np.float32), "row": rng.standard_normal(40).astype(np.float32),
                               "img": np.zeros(h, np.float32)})



def _slicing_loop(end: str, grow: str = "Add"):
    """40 iterations (a loop in the entry, not unrolled) each summing row[:end] for an `end`
    the body does not compute: `n1` from data around the loop, or `k`, carried and grown by
    `grow` with 1 (torch.jit.script's `x[:k]` with `k += 1`) or another op with 2."""
    body = helper.make_graph(
        [_n("Identity", ["cond_in"], ["cond_out"]), _n(grow, ["k", "one_v" if grow == "Add" else "two_v"], ["k_out"]),
         _n("Slice", ["row", "zero", end, "zero"], ["head"]), _n("ReduceSum", ["head"], ["scan"], keepdims=0)],
        "body",
        [helper.make_tensor_value_info("i", I64, []), helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("k", I64, [1])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("k_out", I64, [1]), helper.make_tensor_value_info("scan", F, [])])
    nodes = [_n("ReduceMax", ["x"], ["m"], keepdims=0), _n("Clip", ["m", "one", "nine"], ["c"]),
             _n("Cast", ["c"], ["n"], to=I64), _n("Unsqueeze", ["n", "zero"], ["n1"]),
             _n("Loop", ["trips", "go", "k0"], ["k_last", "stacked"], body=body)]
    return _model(nodes, [("x", F, [4]), ("row", F, [9])], [("k_last", I64), ("stacked", F)],
                  [("one", np.float32(1)), ("nine", np.float32(9)), ("zero", np.array([0])), ("one_v", np.array([1])),
                   ("two_v", np.array([2])), ("trips", np.array(40)), ("go", np.array(True)), ("k0", np.array([1]))])


def test_a_loop_body_reads_a_size_from_around_it():
    """A size the body reads from a tensor computed around the loop, or from one it carries
    and adds a constant to each iteration (bounded by its first value and the iterations), is
    read in the loop (a kiln.ReadSizes), never from the caller's inputs; one it carries and
    doubles has no bounds, and the refusal names it."""
    rng = np.random.default_rng(9)
    for model in (_slicing_loop("n1"), _slicing_loop("k")):
        module = _build(model)
        for top in (0.5, 4.2, 8.7):
            _check(module, model, {"x": np.array([top, 0, -1, 2], np.float32),
                                   "row": rng.standard_normal(9).astype(np.float32)})
    with pytest.raises(KilnError, match=r"'Slice.*'k'.*the values of 'k', which the graph reads, have no bounds"):
        _build(_slicing_loop("k", grow="Mul"))
