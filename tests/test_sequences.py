"""Sequences built inside the model (torch.jit.script's lists) against onnxruntime and onnx's
reference evaluator: lists of known tensors edited and read, a loop appending to a list,
and the uses Kiln refuses by name."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from modelkiln.ir.errors import KilnError
from modelkiln.orchestrator.api import build
from tests import model_zoo
from tests.test_control_flow import scripted_break_condition

F, I64, B = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL


def _vi(name, t, shape):
    return helper.make_tensor_value_info(name, t, shape)


def _model(nodes, inputs, outputs, inits=()):
    graph = helper.make_graph(nodes, "g", [_vi(*i) for i in inputs], [_vi(o, t, None) for o, t in outputs],
                              [numpy_helper.from_array(np.asarray(v), n) for n, v in inits])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _build(model, **options):
    return build(model, executor="inprocess", cache=None, progress=False, **options)


def _check(model, feeds_list, module=None):
    """Kiln against onnxruntime and onnx's reference evaluator."""
    module = module or _build(model).load()
    for feeds in feeds_list:
        got = module.run(feeds)
        ref = ReferenceEvaluator(model)
        oracles = [model_zoo.onnxruntime_outputs(model, feeds), dict(zip(ref.output_names, ref.run(None, feeds)))]
        for want in oracles:
            for name in want:
                assert got[name].shape == want[name].shape, name
                np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_list_of_known_tensors_edited_and_read():
    """SequenceConstruct, an insert at a position, an erase from the back, SequenceAt, its
    length, and ConcatFromSequence both ways (joined along an axis, stacked along a new one)."""
    nodes = [helper.make_node("Relu", ["a"], ["ra"]),
             helper.make_node("SequenceConstruct", ["ra", "b", "c"], ["s0"]),
             helper.make_node("SequenceInsert", ["s0", "d", "one"], ["s1"]),  # ra d b c
             helper.make_node("SequenceErase", ["s1"], ["s2"]),  # ra d b
             helper.make_node("SequenceAt", ["s2", "minus_two"], ["second"]),  # d
             helper.make_node("SequenceLength", ["s2"], ["length"]),
             helper.make_node("ConcatFromSequence", ["s2"], ["joined"], axis=1),
             helper.make_node("ConcatFromSequence", ["s2"], ["stacked"], axis=-1, new_axis=1)]
    model = _model(nodes, [(n, F, [2, 3]) for n in "abcd"],
                   [("second", F), ("length", I64), ("joined", F), ("stacked", F)],
                   [("one", np.array(1, np.int64)), ("minus_two", np.array(-2, np.int64))])
    rng = np.random.default_rng(0)
    _check(model, [{n: rng.standard_normal((2, 3)).astype(np.float32) for n in "abcd"}])


@pytest.mark.parametrize("split, keepdims", [(None, 1), (None, 0), ([1, 3], 1), (2, 1)])
def test_split_to_sequence_then_joined(split, keepdims):
    """SplitToSequence into given sizes, chunks of one size (the last shorter), or one element
    per index (squeezed without keepdims), then each element scaled and the list stacked."""
    inputs = ["x"] + (["split"] if split is not None else [])
    nodes = [helper.make_node("SplitToSequence", inputs, ["parts"], axis=1, keepdims=keepdims),
             helper.make_node("SequenceAt", ["parts", "zero"], ["first"]),
             helper.make_node("ConcatFromSequence", ["parts"], ["back"], axis=1, new_axis=int(split is None))]
    inits = [("zero", np.array(0, np.int64))] + ([("split", np.array(split, np.int64))] if split is not None else [])
    model = _model(nodes, [("x", F, [2, 4, 3])], [("first", F), ("back", F)], inits)
    _check(model, [{"x": np.random.default_rng(1).standard_normal((2, 4, 3)).astype(np.float32)}])


def scripted_list_decoder(initial_items=0, axis=1, new_axis=1, width=8, batch=2, stop_above=3.0):
    """`outs: List[Tensor] = []; for i in range(max_len): h = tanh(W [x, h]); y = V h;
    outs.append(y); if y.sum() > stop_above: break; torch.stack(outs, 1)` as the TorchScript
    exporter writes it: SequenceEmpty, SequenceInsert in the Loop's body, ConcatFromSequence
    after it (here optionally with `initial_items` copies of x in the list before the loop).
    h and x are [batch, width] (bench/bench_dynamic.py's loops part runs it wider)."""
    rng = np.random.default_rng(2)
    inits = [("cell_w", (rng.standard_normal((width, 2 * width)) * 2 / np.sqrt(width)).astype(np.float32)),
             ("cell_b", (rng.standard_normal(width) * 0.1).astype(np.float32)),
             ("out_w", (rng.standard_normal((width, width)) * np.sqrt(8 / width)).astype(np.float32)),
             ("out_b", (rng.standard_normal(width) * 0.1).astype(np.float32)),
             ("forever", np.array(np.iinfo(np.int64).max, np.int64)), ("zero", np.array(0, np.int64)),
             ("one", np.array(1, np.int64)), ("three", np.array(stop_above, np.float32))]
    body = helper.make_graph(
        [helper.make_node("Concat", ["x", "h_in"], ["xh"], axis=1),
         helper.make_node("Gemm", ["xh", "cell_w", "cell_b"], ["pre"], transB=1),
         helper.make_node("Tanh", ["pre"], ["h_out"]),
         helper.make_node("Gemm", ["h_out", "out_w", "out_b"], ["y"], transB=1),
         helper.make_node("SequenceInsert", ["outs_in", "y"], ["outs_out"]),
         helper.make_node("ReduceSum", ["y"], ["total"], keepdims=0),
         *scripted_break_condition("total", "three")],
        "body", [_vi("iteration", I64, []), _vi("cond_in", B, []), _vi("h_in", F, [batch, width]),
                 _vi("i_in", I64, []), helper.make_tensor_sequence_value_info("outs_in", F, None)],
        [_vi("cond_out", B, []), _vi("h_out", F, [batch, width]), _vi("i_out", I64, []),
         helper.make_tensor_sequence_value_info("outs_out", F, None)])
    first = helper.make_node("SequenceConstruct", ["x"] * initial_items, ["outs0"]) if initial_items else \
        helper.make_node("SequenceEmpty", [], ["outs0"], dtype=F)
    return _model([first, helper.make_node("Greater", ["max_len", "zero"], ["go"]),
                   helper.make_node("Loop", ["forever", "go", "h", "zero", "outs0"], ["h_last", "i_last", "outs"],
                                    body=body),
                   helper.make_node("ConcatFromSequence", ["outs"], ["ys"], axis=axis, new_axis=new_axis),
                   helper.make_node("SequenceLength", ["outs"], ["n"])],
                  [("h", F, [batch, width]), ("x", F, [batch, width]), ("max_len", I64, [])], [("ys", F), ("n", I64)],
                  inits)


@pytest.mark.parametrize("initial_items, axis, new_axis", [(0, 1, 1), (0, 0, 1), (2, 1, 0), (1, -1, 0)])
def test_a_loop_appending_to_a_list(initial_items, axis, new_axis):
    """The appended tensors are a scan output of the loop, counted as it runs (within max_len's
    bounds); the list is the items before the loop then those rows, stacked or joined along
    any axis, and its length counts both. The loop runs to max_len or breaks early."""
    model = scripted_list_decoder(initial_items, axis, new_axis)
    module = _build(model, dims={"max_len": (0, 24)}).load()
    rng, lengths = np.random.default_rng(3), set()
    feeds = []
    for max_len in (1, 2, 7, 24):
        for _ in range(3):
            feeds.append({"h": rng.standard_normal((2, 8)).astype(np.float32),
                          "x": rng.standard_normal((2, 8)).astype(np.float32), "max_len": np.array(max_len, np.int64)})
            lengths.add((int(module.run(feeds[-1])["n"]) - initial_items, max_len))
    _check(model, feeds, module)
    assert any(n < m for n, m in lengths) and any(n == m > 1 for n, m in lengths)  # (both ways ran)


def test_uses_of_sequences_kiln_refuses_by_name():
    """A sequence as a model output, a carried sequence the body reads, a position computed at
    run time."""
    split = _model([helper.make_node("SplitToSequence", ["x"], ["parts"], axis=0)], [("x", F, [3, 2])],
                   [("parts", F)])
    split.graph.output[0].CopyFrom(helper.make_tensor_sequence_value_info("parts", F, None))
    with pytest.raises(KilnError, match=r"SplitToSequence.*'parts' is a sequence and an output of the model"):
        _build(split)
    body = helper.make_graph(
        [helper.make_node("SequenceLength", ["seq_in"], ["n"]), helper.make_node("Cast", ["n"], ["fn"], to=F),
         helper.make_node("Mul", ["x", "fn"], ["y"]), helper.make_node("SequenceInsert", ["seq_in", "y"], ["seq_out"]),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "body", [_vi("iteration", I64, []), _vi("cond_in", B, []),
                 helper.make_tensor_sequence_value_info("seq_in", F, None)],
        [_vi("cond_out", B, []), helper.make_tensor_sequence_value_info("seq_out", F, None)])
    reads = _model([helper.make_node("SequenceEmpty", [], ["s0"], dtype=F),
                    helper.make_node("Loop", ["three", "", "s0"], ["s"], body=body, name="grow"),
                    helper.make_node("ConcatFromSequence", ["s"], ["y"], axis=0)],
                   [("x", F, [2])], [("y", F)], [("three", np.array(3, np.int64))])
    with pytest.raises(KilnError, match=r"grow.*carried value 0 is a sequence that the body does more with"):
        _build(reads)
    at = _model([helper.make_node("SequenceConstruct", ["x", "x"], ["s"]),
                 helper.make_node("SequenceAt", ["s", "k"], ["y"])], [("x", F, [2]), ("k", I64, [])], [("y", F)])
    with pytest.raises(KilnError, match=r"SequenceAt.*position 'k' is computed at run time"):
        _build(at)


def test_a_sequence_passed_through_an_identity_and_one_given_to_a_tensor_op():
    """The exporters put Identities where a list leaves a branch or a loop: the sequence goes
    on. A tensor op given a sequence is refused naming it."""
    passed = _model([helper.make_node("SequenceConstruct", ["a", "b"], ["s"]),
                     helper.make_node("Identity", ["s"], ["t"]),
                     helper.make_node("ConcatFromSequence", ["t"], ["y"], axis=0, new_axis=1)],
                    [("a", F, [3]), ("b", F, [3])], [("y", F)])
    rng = np.random.default_rng(4)
    _check(passed, [{"a": rng.standard_normal(3).astype(np.float32), "b": rng.standard_normal(3).astype(np.float32)}])
    misused = _model([helper.make_node("SequenceConstruct", ["a", "b"], ["s"]),
                      helper.make_node("Relu", ["s"], ["y"])], [("a", F, [3]), ("b", F, [3])], [("y", F)])
    with pytest.raises(KilnError, match=r"Relu.*input 's' is a sequence; Relu takes tensors"):
        _build(misused)
