"""If whose branches give outputs of different sizes, on a condition computed while the model
runs, and sizes counted inside a branch (torchvision's batched NMS: no boxes, an empty result;
else NonMaxSuppression's selection). The module reads the condition once computed and sizes
the output by the branch taken; a count in a branch that did not run is never read. Against
onnxruntime and onnx's reference evaluator."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from modelkiln.ir.errors import KilnError
from modelkiln.orchestrator.api import build
from tests import model_zoo
from tests.conftest import shared_cache

H = helper
F, I64, B = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL


def _model(nodes, inputs, outputs, inits=(), opset=17):
    graph = H.make_graph(nodes, "g", [H.make_tensor_value_info(n, t, s) for n, t, s in inputs],
                         [H.make_tensor_value_info(n, t, None) for n, t in outputs], list(inits))
    return H.make_model(graph, opset_imports=[H.make_opsetid("", opset)], ir_version=9)


def _branch(name, nodes, outputs, inits=()):
    return H.make_graph(nodes, name, [], [H.make_tensor_value_info(n, t, None) for n, t in outputs], list(inits))


def _const(name, value):
    return numpy_helper.from_array(np.asarray(value), name)


def _agree(module, model, feeds: dict) -> dict:
    got, want = module.run(feeds), model_zoo.onnxruntime_outputs(model, feeds)
    for name, w in want.items():
        assert got[name].shape == w.shape and got[name].dtype == w.dtype, (name, got[name].shape, w.shape)
        np.testing.assert_allclose(got[name], w, rtol=1e-6, atol=1e-6, err_msg=name)
    return got


def _batched_nms_model(n: int = 12):
    """torchvision's postprocessing as its TorchScript export spells it: the boxes scoring
    above a threshold (NonZero), at most 5 of them by score (TopK of min(5, count): a
    ReduceMin of a Concat of sizes), then `if boxes.numel() == 0: empty, else nms(...)`
    (an If on a size, NonMaxSuppression in its else branch), the kept boxes gathered."""
    nms = [H.make_node("Unsqueeze", ["top_boxes", "zero"], ["b3"]),
           H.make_node("Unsqueeze", ["top_scores", "zero"], ["s2"]),
           H.make_node("Unsqueeze", ["s2", "zero"], ["s3"]),
           H.make_node("NonMaxSuppression", ["b3", "s3", "most", "iou"], ["sel"]),
           H.make_node("Gather", ["sel", "two"], ["picked"], axis=1)]
    else_branch = _branch("nms", nms, [("picked", I64)])
    then_branch = _branch("none", [H.make_node("Constant", [], ["empty"], value=_const("e", np.zeros(0, np.int64)))],
                          [("empty", I64)])
    nodes = [H.make_node("Greater", ["scores", "threshold"], ["mask"]),
             H.make_node("NonZero", ["mask"], ["nz"]),
             H.make_node("Squeeze", ["nz", "zero"], ["idx"]),
             H.make_node("Gather", ["scores", "idx"], ["kept_scores"]),
             H.make_node("Gather", ["boxes", "idx"], ["kept_boxes"]),
             H.make_node("Shape", ["kept_scores"], ["count"]),
             H.make_node("Concat", ["five", "count"], ["ks"], axis=0),
             H.make_node("ReduceMin", ["ks"], ["k_scalar"], keepdims=0),
             H.make_node("Reshape", ["k_scalar", "one_d"], ["k"]),
             H.make_node("TopK", ["kept_scores", "k"], ["top_scores", "top_idx"]),
             H.make_node("Gather", ["kept_boxes", "top_idx"], ["top_boxes"]),
             H.make_node("Shape", ["top_boxes"], ["box_shape"]),
             H.make_node("ReduceProd", ["box_shape"], ["numel"], keepdims=0),
             H.make_node("Equal", ["numel", "zero_s"], ["none"]),
             H.make_node("If", ["none"], ["keep"], then_branch=then_branch, else_branch=else_branch),
             H.make_node("Gather", ["top_boxes", "keep"], ["out_boxes"]),
             H.make_node("Gather", ["top_scores", "keep"], ["out_scores"])]
    inits = [_const("threshold", np.float32(0.5)), _const("zero", np.array([0], np.int64)),
             _const("five", np.array([5], np.int64)), _const("one_d", np.array([1], np.int64)),
             _const("zero_s", np.int64(0)), _const("most", np.array([3], np.int64)),
             _const("iou", np.array([0.4], np.float32)), _const("two", np.int64(2))]
    return _model(nodes, [("boxes", F, [n, 4]), ("scores", F, [n])], [("out_boxes", F), ("out_scores", F)], inits)


def _boxes(rng, n):
    corner = rng.random((n, 2)).astype(np.float32) * 10
    return np.concatenate([corner, corner + 1 + rng.random((n, 2)).astype(np.float32) * 4], axis=1)


@pytest.mark.parametrize("above", [0, 1, 4, 12])
def test_torchvisions_batched_nms_if(above, executor):
    """No box above the threshold takes the then branch (no NonMaxSuppression runs); any
    takes the else branch, whose count sizes the result."""
    model = _batched_nms_model()
    module = build(model, executor=executor, cache=shared_cache(), progress=False).load()
    rng = np.random.default_rng(above)
    scores = rng.random(12).astype(np.float32) * 0.5
    scores[rng.permutation(12)[:above]] += 0.5001
    got = _agree(module, model, {"boxes": _boxes(rng, 12), "scores": scores})
    assert got["out_boxes"].shape[0] == (0 if above == 0 else got["out_scores"].shape[0]) <= min(above, 3)


def test_a_condition_on_the_data_picks_the_size(executor):
    """A condition computed from the data (not a size), branches of static sizes 2 and 5: the
    output is as long as the branch taken says."""
    then_branch = _branch("head", [H.make_node("Slice", ["x", "zero", "two"], ["head"])], [("head", F)])
    else_branch = _branch("all", [H.make_node("Neg", ["x"], ["neg"])], [("neg", F)])
    model = _model([H.make_node("ReduceSum", ["x"], ["total"], keepdims=0),
                    H.make_node("Greater", ["total", "zero_f"], ["positive"]),
                    H.make_node("If", ["positive"], ["y"], then_branch=then_branch, else_branch=else_branch),
                    H.make_node("Mul", ["y", "y"], ["out"])],
                   [("x", F, [5])], [("out", F)],
                   [_const("zero", np.array([0], np.int64)), _const("two", np.array([2], np.int64)),
                    _const("zero_f", np.float32(0))])
    module = build(model, executor=executor, cache=shared_cache(), progress=False).load()
    for sign, length in ((1, 2), (-1, 5)):
        x = sign * np.arange(1, 6, dtype=np.float32)
        assert _agree(module, model, {"x": x})["out"].shape == (length,)


def test_counts_in_both_branches_on_a_fed_condition(executor):
    """Each branch counts a selection of its own; the one that ran sizes the output (the
    other's count is never read)."""
    then_branch = _branch("pos", [H.make_node("Greater", ["x", "zero_f"], ["p"]),
                                  H.make_node("Compress", ["x", "p"], ["a"])], [("a", F)])
    else_branch = _branch("neg", [H.make_node("Less", ["x", "zero_f"], ["q"]),
                                  H.make_node("Compress", ["x", "q"], ["b"]),
                                  H.make_node("Concat", ["b", "b"], ["bb"], axis=0)], [("bb", F)])
    model = _model([H.make_node("If", ["c"], ["y"], then_branch=then_branch, else_branch=else_branch)],
                   [("c", B, []), ("x", F, [7])], [("y", F)], [_const("zero_f", np.float32(0))])
    module = build(model, executor=executor, cache=shared_cache(), progress=False).load()
    x = np.array([3, -1, 0, 2, -5, 4, -2], np.float32)
    for c in (True, False):
        _agree(module, model, {"c": np.array(c), "x": x})
    assert module.run({"c": np.array(False), "x": np.abs(x)})["y"].shape == (0,)


def test_a_check_in_a_branch_is_made_where_it_ran(executor):
    """Two selections added in the else branch must agree in length: a named error where that
    branch runs and they differ; nothing is checked where the then branch runs (the counts
    would stand at their greatest there, 4 and 3)."""
    else_branch = _branch("sum", [H.make_node("Compress", ["x", "m1"], ["a"]),
                                  H.make_node("Compress", ["z", "m2"], ["b"]),
                                  H.make_node("Add", ["a", "b"], ["ab"])], [("ab", F)])
    then_branch = _branch("plain", [H.make_node("Identity", ["x"], ["same"])], [("same", F)])
    model = _model([H.make_node("If", ["c"], ["y"], then_branch=then_branch, else_branch=else_branch)],
                   [("c", B, []), ("x", F, [4]), ("m1", B, [4]), ("z", F, [3]), ("m2", B, [3])], [("y", F)])
    module = build(model, executor=executor, cache=shared_cache(), progress=False).load()
    x, z = np.arange(4, dtype=np.float32), np.arange(10, 13, dtype=np.float32)
    differ = {"x": x, "z": z, "m1": np.array([1, 1, 0, 0], bool), "m2": np.array([1, 0, 0], bool)}
    _agree(module, model, {"c": np.array(True), **differ})
    _agree(module, model, {"c": np.array(False), "x": x, "z": z, "m1": np.array([1, 0, 1, 0], bool),
                           "m2": np.array([0, 1, 1], bool)})
    with pytest.raises(KilnError, match="differ where the model needs them equal"):
        module.run({"c": np.array(False), **differ})


def test_reduce_min_of_sizes_is_a_size(executor):
    """k = min(5, count) spelled ReduceMin(Concat([5], Shape(selection))), as torchvision's
    `_topk_min` exports it: a size the module computes once counted, not a refusal."""
    model = _model([H.make_node("NonZero", ["x"], ["nz"]),
                    H.make_node("Shape", ["nz"], ["shape"]),
                    H.make_node("Slice", ["shape", "one", "two"], ["count"]),
                    H.make_node("Concat", ["five", "count"], ["ks"], axis=0),
                    H.make_node("ReduceMin", ["ks"], ["k"], keepdims=1),
                    H.make_node("TopK", ["x", "k"], ["values", "indices"])],
                   [("x", F, [9])], [("values", F), ("indices", I64)],
                   [_const("one", np.array([1], np.int64)), _const("two", np.array([2], np.int64)),
                    _const("five", np.array([5], np.int64))])
    module = build(model, executor=executor, cache=shared_cache(), progress=False).load()
    for nonzero in (0, 3, 9):
        x = np.zeros(9, np.float32)
        x[:nonzero] = np.arange(1, nonzero + 1)
        got = module.run({"x": x})
        want = ReferenceEvaluator(model).run(None, {"x": x})
        np.testing.assert_array_equal(got["values"], want[0])
        assert got["values"].shape == (min(5, nonzero),)


def test_a_count_inside_a_loop_is_read_each_iteration(executor):
    """A count in the body of a Loop that runs as a loop (20 iterations): NonZero of x > i,
    each iteration's length read after its kernel, summed into the carried value."""
    body = H.make_graph([H.make_node("Cast", ["i"], ["fi"], to=F), H.make_node("Greater", ["x", "fi"], ["above"]),
                         H.make_node("NonZero", ["above"], ["nz"]), H.make_node("Identity", ["go"], ["go_out"]),
                         H.make_node("ReduceSum", ["nz"], ["s"], keepdims=0),
                         H.make_node("Shape", ["nz"], ["shape"]), H.make_node("ReduceSum", ["shape"], ["n"], keepdims=0),
                         H.make_node("Add", ["acc", "s"], ["a1"]), H.make_node("Mul", ["n", "thousand"], ["n1"]),
                         H.make_node("Add", ["a1", "n1"], ["acc_out"])], "body",
                        [H.make_tensor_value_info("i", I64, []), H.make_tensor_value_info("go", B, []),
                         H.make_tensor_value_info("acc", I64, [])],
                        [H.make_tensor_value_info("go_out", B, []), H.make_tensor_value_info("acc_out", I64, [])])
    model = _model([H.make_node("Loop", ["trips", "", "acc0"], ["acc"], body=body)],
                   [("x", F, [7])], [("acc", I64)], [_const("trips", np.int64(20)), _const("acc0", np.int64(0)),
                                                       _const("thousand", np.int64(1000))])
    module = build(model, executor=executor, cache=shared_cache(), progress=False).load()
    rng = np.random.default_rng(5)
    for x in (rng.uniform(-2, 22, 7).astype(np.float32), np.full(7, -1, np.float32), np.full(7, 30, np.float32)):
        # (onnxruntime: onnx's reference evaluator runs no iteration of a Loop whose condition is omitted)
        np.testing.assert_array_equal(module.run({"x": x})["acc"], model_zoo.onnxruntime_outputs(model, {"x": x})["acc"])


def test_a_count_in_a_branch_inside_a_loop(executor):
    """NonZero in an If's branch taken on even iterations of a 20-iteration loop: read where
    its branch ran, each iteration, against onnxruntime."""
    then_ = H.make_graph([H.make_node("Cast", ["i"], ["fi"], to=F), H.make_node("Greater", ["x", "fi"], ["above"]),
                          H.make_node("NonZero", ["above"], ["nz"]), H.make_node("ReduceSum", ["nz"], ["t"], keepdims=0)],
                         "then", [], [H.make_tensor_value_info("t", I64, [])])
    else_ = H.make_graph([H.make_node("Identity", ["zero"], ["e"])], "else", [], [H.make_tensor_value_info("e", I64, [])])
    body = H.make_graph([H.make_node("Mod", ["i", "two"], ["r"]), H.make_node("Equal", ["r", "zero"], ["even"]),
                         H.make_node("If", ["even"], ["s"], then_branch=then_, else_branch=else_),
                         H.make_node("Identity", ["go"], ["go_out"]), H.make_node("Add", ["acc", "s"], ["acc_out"])],
                        "body", [H.make_tensor_value_info("i", I64, []), H.make_tensor_value_info("go", B, []),
                                 H.make_tensor_value_info("acc", I64, [])],
                        [H.make_tensor_value_info("go_out", B, []), H.make_tensor_value_info("acc_out", I64, [])])
    model = _model([H.make_node("Loop", ["trips", "", "acc0"], ["acc"], body=body)],
                   [("x", F, [7])], [("acc", I64)], [_const("trips", np.int64(20)), _const("acc0", np.int64(0)),
                                                       _const("two", np.int64(2)), _const("zero", np.int64(0))])
    module = build(model, executor=executor, cache=shared_cache(), progress=False).load()
    rng = np.random.default_rng(6)
    for x in (rng.uniform(-2, 22, 7).astype(np.float32), np.full(7, -1, np.float32), np.full(7, 30, np.float32)):
        np.testing.assert_array_equal(module.run({"x": x})["acc"], model_zoo.onnxruntime_outputs(model, {"x": x})["acc"])
