"""Sizes that depend on the data: NonZero and Compress, whose output length a kernel counts
while the model runs, and everything downstream of it, against onnxruntime. One build serves
every count from none to all; the caller gets outputs of the counted size."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from modelkiln.ir.errors import KilnError
from modelkiln.orchestrator.api import build
from modelkiln.orchestrator.explain import explain
from tests import model_zoo
from tests.fenced import FencedOutputs
from tests.conftest import shared_cache

H = helper


def _model(nodes, inputs, outputs, inits=(), opset=17):
    graph = H.make_graph(nodes, "g", [H.make_tensor_value_info(n, t, s) for n, t, s in inputs],
                         [H.make_tensor_value_info(n, t, None) for n, t in outputs], list(inits))
    return H.make_model(graph, opset_imports=[H.make_opsetid("", opset)], ir_version=9)


def _agree(module, model, feeds: dict) -> dict:
    got, want = module.run(feeds), model_zoo.onnxruntime_outputs(model, feeds)
    for name, w in want.items():
        assert got[name].shape == w.shape and got[name].dtype == w.dtype, name
        np.testing.assert_allclose(got[name], w, rtol=1e-6, atol=1e-6, err_msg=name)
    return got


def _sparse(shape, keep: float, seed: int, dtype=np.float32) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 3).astype(dtype)
    x[rng.random(shape) > keep] = 0
    return x


def test_nonzero_counts_from_none_to_all(executor):
    model = _model([H.make_node("NonZero", ["x"], ["y"])], [("x", TensorProto.FLOAT, [3, 4, 5])],
                   [("y", TensorProto.INT64)])
    module = build(model, executor=executor, cache=shared_cache(), progress=False).load()
    (counted,) = module.manifest.derived
    assert counted["greatest"] == 60 and module.manifest.outputs[0]["shape"][0] == 3
    assert "derived nonzero(x) = counted while the model runs" in explain(model)
    special = _sparse((3, 4, 5), 0.5, 9)
    special.reshape(-1)[:4] = [np.nan, -0.0, np.inf, 0.0]  # (NaN and Inf count; -0.0 does not)
    for x in (_sparse((3, 4, 5), keep, seed) for seed, keep in enumerate((0.0, 0.1, 0.5, 1.0))):
        _agree(module, model, {"x": x})
    assert _agree(module, model, {"x": special})["y"].shape[1] == np.count_nonzero(special)


@pytest.mark.parametrize("dtype,onnx_type", [(np.bool_, TensorProto.BOOL), (np.int8, TensorProto.INT8),
                                             (np.int64, TensorProto.INT64), (np.float16, TensorProto.FLOAT16)])
def test_nonzero_of_each_kind(dtype, onnx_type, executor):
    model = _model([H.make_node("NonZero", ["x"], ["y"])], [("x", onnx_type, [17])], [("y", TensorProto.INT64)])
    module = build(model, executor=executor, cache=shared_cache(), progress=False).load()
    rng = np.random.default_rng(1)
    for keep in (0.3, 0.8):  # (numpy's nonzero is the definition; onnxruntime has none for int8)
        x = (rng.integers(-3, 4, 17) * (rng.random(17) < keep)).astype(dtype)
        np.testing.assert_array_equal(module.run({"x": x})["y"], np.array(np.nonzero(x), np.int64))


def test_boolean_mask_indexing_over_a_run_time_batch(executor):
    """x[x > 0] as torch exports it (NonZero, Transpose, GatherND), then arithmetic, a
    reduction and the Shape of the selection, for batches 1..8 from one build."""
    zero = numpy_helper.from_array(np.array(0, np.float32), "zero")
    model = _model([H.make_node("Greater", ["x", "zero"], ["mask"]), H.make_node("NonZero", ["mask"], ["nz"]),
                    H.make_node("Transpose", ["nz"], ["idx"], perm=[1, 0]),
                    H.make_node("GatherND", ["x", "idx"], ["picked"]),
                    H.make_node("Mul", ["picked", "picked"], ["squares"]),
                    H.make_node("ReduceSum", ["squares"], ["total"], keepdims=0),
                    H.make_node("Shape", ["picked"], ["count"])],
                   [("x", TensorProto.FLOAT, ["batch", 6])],
                   [("idx", TensorProto.INT64), ("squares", TensorProto.FLOAT), ("total", TensorProto.FLOAT),
                    ("count", TensorProto.INT64)], [zero])
    module = build(model, executor=executor, cache=None, progress=False, dims={"batch": (1, 8)}).load()
    for batch, keep in ((1, 0.5), (8, 1.0), (5, 0.0), (3, 0.7)):
        got = _agree(module, model, {"x": _sparse((batch, 6), keep, batch)})
        assert got["count"][0] == got["squares"].shape[0]


@pytest.mark.parametrize("axis", [None, 0, 1, -1])
def test_compress_with_a_condition_fed_at_run_time(axis, executor):
    length = 4 if axis == 0 else 20 if axis is None else 5
    model = _model([H.make_node("Compress", ["x", "keep"], ["y"], **({} if axis is None else {"axis": axis}))],
                   [("x", TensorProto.FLOAT, [4, 5]), ("keep", TensorProto.BOOL, [length])], [("y", TensorProto.FLOAT)])
    module = build(model, executor=executor, cache=shared_cache(), progress=False).load()
    rng = np.random.default_rng(2)
    for keep in (np.zeros(length, bool), np.ones(length, bool), rng.random(length) < 0.5):
        _agree(module, model, {"x": rng.standard_normal((4, 5)).astype(np.float32), "keep": keep})


def test_a_constant_condition_folds(executor):
    """NonZero of a constant is a constant: no size is counted at run time."""
    keep = numpy_helper.from_array(np.array([True, False, True, True, False]), "keep")
    model = _model([H.make_node("Compress", ["x", "keep"], ["y"], axis=1)], [("x", TensorProto.FLOAT, [2, 5])],
                   [("y", TensorProto.FLOAT)], [keep])
    module = build(model, executor=executor, cache=shared_cache(), progress=False).load()
    assert not module.manifest.derived and module.manifest.outputs[0]["shape"] == [2, 3]
    _agree(module, model, {"x": np.arange(10, dtype=np.float32).reshape(2, 5)})


def test_twin_nonzeros_share_one_count(executor):
    """Two NonZero of one input are one after CSE: one count, read once."""
    model = _model([H.make_node("NonZero", ["x"], ["a"]), H.make_node("NonZero", ["x"], ["b"]),
                    H.make_node("Add", ["a", "b"], ["y"])], [("x", TensorProto.FLOAT, [9])], [("y", TensorProto.INT64)])
    module = build(model, executor=executor, cache=shared_cache(), progress=False).load()
    assert len(module.manifest.derived) == 1
    _agree(module, model, {"x": _sparse((9,), 0.5, 3)})


def test_out_arrays_at_the_greatest_shape(executor):
    """`out=` takes each counted output at its greatest shape (`out_shapes`); the kernels
    write its front and run returns a view of it, nothing outside it touched."""
    model = _model([H.make_node("NonZero", ["x"], ["y"]), H.make_node("Relu", ["x"], ["r"])],
                   [("x", TensorProto.FLOAT, [2, 6])], [("y", TensorProto.INT64), ("r", TensorProto.FLOAT)])
    module = build(model, executor=executor, cache=shared_cache(), progress=False).load()
    x = _sparse((2, 6), 0.5, 4)
    shapes = module.out_shapes({"x": x})
    assert shapes == {"y": (2, 12), "r": (2, 6)}
    fenced = FencedOutputs({name: np.zeros(shape, np.int64 if name == "y" else np.float32)
                            for name, shape in shapes.items()})
    got = module.run({"x": x}, out=fenced.arrays)
    assert not fenced.trespassed()
    want = model_zoo.onnxruntime_outputs(model, {"x": x})
    np.testing.assert_array_equal(got["y"], want["y"])
    assert np.shares_memory(got["y"], fenced.arrays["y"]) and got["r"] is fenced.arrays["r"]
    with pytest.raises(KilnError, match=r"out\['y'\].*shape \(2, 12\)"):
        module.run({"x": x}, out={"y": np.zeros(want["y"].shape, np.int64), "r": fenced.arrays["r"]})


def test_two_counts_that_must_agree_are_checked_once_counted(executor):
    """Two selections combined: the module checks their lengths agree once both are counted
    (a named error where they differ, nothing returned)."""
    model = _model([H.make_node("Compress", ["x", "c1"], ["a"]), H.make_node("Compress", ["x", "c2"], ["b"]),
                    H.make_node("Add", ["a", "b"], ["y"])],
                   [("x", TensorProto.FLOAT, [6]), ("c1", TensorProto.BOOL, [6]), ("c2", TensorProto.BOOL, [6])],
                   [("y", TensorProto.FLOAT)])
    module = build(model, executor=executor, cache=shared_cache(), progress=False).load()
    x = np.arange(6, dtype=np.float32)
    _agree(module, model, {"x": x, "c1": np.array([1, 0, 1, 0, 1, 0], bool), "c2": np.array([0, 1, 1, 0, 0, 1], bool)})
    with pytest.raises(KilnError, match="differ where the model needs them equal"):
        module.run({"x": x, "c1": np.array([1, 0, 1, 0, 1, 0], bool), "c2": np.array([0, 1, 1, 0, 0, 0], bool)})


def first_five_padded(fill: float) -> tuple[list, list]:
    """(nodes, constants) keeping the first five of x[keep] ("kept", n long): "top", min(n, 5)
    long, and "filler" of `fill`, 5 - min(n, 5) long (a size that shrinks as the count grows),
    what pads it to five."""
    nodes = [H.make_node("Compress", ["x", "keep"], ["kept"]),
             H.make_node("Slice", ["kept", "zero", "five"], ["top"]),
             H.make_node("Shape", ["top"], ["top_len"]), H.make_node("Sub", ["five", "top_len"], ["short"]),
             H.make_node("ConstantOfShape", ["short"], ["filler"],
                         value=numpy_helper.from_array(np.array([fill], np.float32)))]
    return nodes, [numpy_helper.from_array(np.array([v], np.int64), name) for name, v in (("zero", 0), ("five", 5))]


def test_sizes_computed_from_a_count(executor):
    """What post-processing does with a selection: keep at most 5 (x[:5], min(n, 5) long),
    pad that to exactly 5, and take every other one ((n + 1) // 2), against onnxruntime for
    counts from none to all."""
    nodes, consts = first_five_padded(-1.0)
    nodes += [H.make_node("Concat", ["top", "filler"], ["fixed"], axis=0),
              H.make_node("Slice", ["kept", "zero", "far", "zero", "two"], ["every_other"]),
              H.make_node("Relu", ["every_other"], ["halves"])]
    consts += [numpy_helper.from_array(np.array([v], np.int64), name) for name, v in (("far", 1000), ("two", 2))]
    model = _model(nodes, [("x", TensorProto.FLOAT, [20]), ("keep", TensorProto.BOOL, [20])],
                   [("fixed", TensorProto.FLOAT), ("top", TensorProto.FLOAT), ("halves", TensorProto.FLOAT)], consts)
    module = build(model, executor=executor, cache=shared_cache(), progress=False).load()
    assert module.out_shapes({"x": np.zeros(20, np.float32), "keep": np.zeros(20, bool)}) == \
        {"fixed": (5,), "top": (5,), "halves": (10,)}
    rng = np.random.default_rng(6)
    for keep in (0.0, 0.1, 0.3, 1.0):
        _agree(module, model, {"x": rng.standard_normal(20).astype(np.float32), "keep": rng.random(20) < keep})


def test_a_size_that_shrinks_as_the_count_grows_keeps_its_room(executor):
    """A ramp 50 - min(n, 50) long and two tensors n long, all in the arena at once: offsets
    are computed before the count is known, so a buffer whose size falls as the count rises
    is placed for its greatest size (at the count's greatest it would be its least, and
    overrun the next): no offset reads a size the call counts."""
    def const(name, value):
        return numpy_helper.from_array(np.array(value, np.int64), name)
    nodes = [H.make_node("Compress", ["x", "keep"], ["kept"]), H.make_node("Slice", ["kept", "zero", "five"], ["top"]),
             H.make_node("Shape", ["top"], ["top_len"]), H.make_node("Sub", ["five", "top_len"], ["short"]),
             H.make_node("ConstantOfShape", ["short"], ["ones"], value=numpy_helper.from_array(np.ones(1, np.float32))),
             H.make_node("CumSum", ["ones", "axis"], ["ramp"]), H.make_node("CumSum", ["kept", "axis"], ["run"]),
             H.make_node("Concat", ["ramp", "run", "kept"], ["joined"], axis=0)]
    model = _model(nodes, [("x", TensorProto.FLOAT, [200]), ("keep", TensorProto.BOOL, [200])],
                   [("joined", TensorProto.FLOAT)], [const("zero", [0]), const("five", [50]), const("axis", 0)])
    result = build(model, executor=executor, cache=None, progress=False)
    module = result.load()
    entry = result.files["kiln_entry.c"].decode()
    placed = [line for line in entry.splitlines() if line.strip().startswith("at[")]
    assert not any(f"dims[{k}]" in line for line in placed for k in range(len(module.manifest.derived)))
    rng = np.random.default_rng(7)
    for keep in (0.0, 0.05, 0.2, 0.5, 1.0):
        _agree(module, model, {"x": rng.standard_normal(200).astype(np.float32), "keep": rng.random(200) < keep})


def _boxes(rng, shape, center: bool, flipped: bool = False) -> np.ndarray:
    corner, size = rng.random((*shape, 2)) * 10, rng.random((*shape, 2)) * 4
    if center:
        return np.concatenate([corner, size], -1).astype(np.float32)
    box = np.concatenate([corner, corner + size], -1)
    return (box[..., [2, 3, 0, 1]] if flipped else box).astype(np.float32)


@pytest.mark.parametrize("center", [0, 1])
def test_non_max_suppression_against_the_reference(center, executor):
    """Thresholds fed at run time, a run-time count of boxes, ties in the scores: onnxruntime
    and onnx's reference evaluator agree with Kiln row for row."""
    from onnx.reference import ReferenceEvaluator
    most = numpy_helper.from_array(np.array([40], np.int64), "most")
    model = _model([H.make_node("NonMaxSuppression", ["boxes", "scores", "most", "iou", "floor"], ["selected"],
                                center_point_box=center)],
                   [("boxes", TensorProto.FLOAT, [2, "n", 4]), ("scores", TensorProto.FLOAT, [2, 3, "n"]),
                    ("iou", TensorProto.FLOAT, [1]), ("floor", TensorProto.FLOAT, [1])],
                   [("selected", TensorProto.INT64)], [most])
    module = build(model, executor=executor, cache=None, progress=False, dims={"n": (1, 64)}).load()
    assert module.manifest.derived[0]["greatest"] == 2 * 3 * 40
    rng = np.random.default_rng(center)
    # (every box a candidate at floor -1: heaps of 64 and 32 entries, whole powers of two)
    for n, iou, floor, ties in ((64, 0.3, 0.2, False), (10, 0.0, 0.9, True), (1, 0.5, 0.0, False), (40, 0.7, 0.5, True),
                                (64, 0.5, -1.0, False), (32, 0.9, -1.0, True), (33, 0.6, -1.0, False)):
        scores = rng.random((2, 3, n)).astype(np.float32)
        feeds = {"boxes": _boxes(rng, (2, n), center, flipped=ties),
                 "scores": np.round(scores * 4) / 4 if ties else scores,
                 "iou": np.array([iou], np.float32), "floor": np.array([floor], np.float32)}
        got = _agree(module, model, feeds)["selected"]
        np.testing.assert_array_equal(got, ReferenceEvaluator(model).run(None, feeds)[0])


def test_non_max_suppression_without_a_score_threshold(executor):
    most = numpy_helper.from_array(np.array([100], np.int64), "most")
    iou = numpy_helper.from_array(np.array([0.5], np.float32), "iou")
    model = _model([H.make_node("NonMaxSuppression", ["boxes", "scores", "most", "iou"], ["selected"])],
                   [("boxes", TensorProto.FLOAT, [1, 30, 4]), ("scores", TensorProto.FLOAT, [1, 2, 30])],
                   [("selected", TensorProto.INT64)], [most, iou])
    module = build(model, executor=executor, cache=shared_cache(), progress=False).load()
    assert module.manifest.derived[0]["greatest"] == 2 * 30  # (at most every box of every class)
    rng = np.random.default_rng(5)
    _agree(module, model, {"boxes": _boxes(rng, (1, 30), False), "scores": rng.random((1, 2, 30)).astype(np.float32)})


def _numpy_unique(x, axis, in_order: bool):
    """numpy's unique, reordered by first appearance where asked (ONNX's sorted=0)."""
    values, first, inverse, counts = np.unique(x, return_index=True, return_inverse=True, return_counts=True, axis=axis)
    inverse = inverse.reshape(-1)
    if in_order:
        by_first = np.argsort(first, kind="stable")
        rank = np.empty_like(by_first)
        rank[by_first] = np.arange(len(by_first))
        values = np.take(values, by_first, axis=0 if axis is None else axis)
        first, counts, inverse = first[by_first], counts[by_first], rank[inverse]
    return values, first, inverse, counts


@pytest.mark.parametrize("axis,in_order", [(None, False), (None, True), (0, False), (1, True)])
def test_unique_against_numpy(axis, in_order, executor):
    """Token ids with repeats (3000 of them), and rows or columns of a matrix with repeats;
    sorted and in first-appearance order; the values feed arithmetic after."""
    rng = np.random.default_rng(11)
    if axis is None:
        x, onnx_type, shape = rng.integers(0, 400, 3000).astype(np.int64), TensorProto.INT64, [3000]
    else:
        x = rng.integers(0, 3, (12, 9)).astype(np.float32)
        x = np.concatenate([x, np.take(x, [0, 2, 3, 2], axis=axis)], axis=axis)  # (repeated rows or columns)
        onnx_type, shape = TensorProto.FLOAT, list(x.shape)
    attrs = {"sorted": int(not in_order), **({} if axis is None else {"axis": axis})}
    nodes = [H.make_node("Unique", ["x"], ["y", "first", "inverse", "counts"], **attrs),
             H.make_node("Add", ["y", "y"], ["twice"])]
    model = _model(nodes, [("x", onnx_type, shape)], [("twice", onnx_type), ("first", TensorProto.INT64),
                                                     ("inverse", TensorProto.INT64), ("counts", TensorProto.INT64)])
    module = build(model, executor=executor, cache=shared_cache(), progress=False).load()
    got = module.run({"x": x})
    values, first, inverse, counts = _numpy_unique(x, axis, in_order)
    np.testing.assert_array_equal(got["twice"], values + values)
    for name, want in (("first", first), ("inverse", inverse), ("counts", counts)):
        np.testing.assert_array_equal(got[name], want, err_msg=name)


def test_unique_of_floats_with_nan(executor):
    """NaN after every number, all NaNs one value, as numpy's unique has them."""
    model = _model([H.make_node("Unique", ["x"], ["y", "first", "inverse", "counts"])],
                   [("x", TensorProto.FLOAT, [10])], [("y", TensorProto.FLOAT), ("first", TensorProto.INT64),
                                                      ("inverse", TensorProto.INT64), ("counts", TensorProto.INT64)])
    x = np.array([2.0, np.nan, -1.0, 2.0, np.nan, 0.0, -0.0, 5.0, -1.0, np.nan], np.float32)
    got = build(model, executor=executor, cache=shared_cache(), progress=False).load().run({"x": x})
    values, first, inverse, counts = _numpy_unique(x, None, False)
    np.testing.assert_array_equal(got["y"], values)
    for name, want in (("first", first), ("inverse", inverse), ("counts", counts)):
        np.testing.assert_array_equal(got[name], want, err_msg=name)


_AFTER_A_SELECTION = {  # (what a model does with x[x > 0]: a selection n long; ONNX ops after it)
    "range": ([H.make_node("Squeeze", ["n"], ["count"]),
               H.make_node("Range", ["zero_i", "count", "one_i"], ["out"])], TensorProto.INT64),
    "expand": ([H.make_node("Concat", ["n", "four"], ["shape"], axis=0),
                H.make_node("Unsqueeze", ["kept", "one"], ["col"]), H.make_node("Expand", ["col", "shape"], ["out"])],
               TensorProto.FLOAT),
    "constant_of_shape": ([H.make_node("ConstantOfShape", ["n"], ["out"],
                                       value=numpy_helper.from_array(np.array([2.5], np.float32)))], TensorProto.FLOAT),
    "concat_of_two": ([H.make_node("Less", ["x", "zero"], ["below"]), H.make_node("Compress", ["x", "below"], ["rest"]),
                       H.make_node("Concat", ["kept", "rest"], ["both"], axis=0),
                       H.make_node("Neg", ["both"], ["out"])],
                      TensorProto.FLOAT),
    "softmax": ([H.make_node("Softmax", ["kept"], ["out"], axis=0)], TensorProto.FLOAT),
    "cumsum": ([H.make_node("CumSum", ["kept", "zero_i"], ["out"])], TensorProto.FLOAT),
    "matmul": ([H.make_node("Unsqueeze", ["kept", "one"], ["col"]), H.make_node("MatMul", ["col", "w"], ["out"])],
               TensorProto.FLOAT),
}


@pytest.mark.parametrize("name", sorted(_AFTER_A_SELECTION))
def test_what_follows_a_selection(name, executor):
    """Range, Expand, ConstantOfShape, Concat of two selections (n1 + n2 long), Softmax,
    CumSum and MatMul over a selection's run-time length, from none kept to all."""
    nodes, out_type = _AFTER_A_SELECTION[name]
    inits = [numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
             numpy_helper.from_array(np.array(0, np.int64), "zero_i"),
             numpy_helper.from_array(np.array(1, np.int64), "one_i"),
             numpy_helper.from_array(np.array([1], np.int64), "one"),
             numpy_helper.from_array(np.array([4], np.int64), "four"),
             numpy_helper.from_array(np.random.default_rng(0).standard_normal((1, 6)).astype(np.float32), "w")]
    select = [H.make_node("Greater", ["x", "zero"], ["keep"]), H.make_node("Compress", ["x", "keep"], ["kept"]),
              H.make_node("Shape", ["kept"], ["n"])]
    used = {i for node in select + nodes for i in node.input}
    model = _model(select + nodes, [("x", TensorProto.FLOAT, [30])], [("out", out_type)],
                   [i for i in inits if i.name in used])
    module = build(model, executor=executor, cache=shared_cache(), progress=False).load()
    for shift in (-5.0, 0.0, 5.0):
        _agree(module, model, {"x": (np.random.default_rng(1).standard_normal(30) + shift).astype(np.float32)})
