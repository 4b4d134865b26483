"""Values computed only from constants and static shapes are evaluated at build time, where an
op needs them then, in the main graph and inside branches: the patterns exporters write.

- torch's dynamo exporter writes an LSTM's or GRU's W and R as Concat/Unsqueeze/Slice of the
  initializers (weight_ih_l0, ...);
- a voice-activity model picks its decoder with If(sr == 16000), an LSTM in each branch whose
  weights are an Unsqueeze of an initializer inside the branch (the If stays a run-time branch);
- a YOLO head's anchor grid is a Range over Cast(Gather(Shape(a feature map))).

What derives from weights becomes weights (data, as initializers are: no kernel computes them).
Each model is compared with onnxruntime.
"""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from modelkiln.orchestrator.api import build
from tests import model_zoo

F = TensorProto.FLOAT


def _ints(name, values):
    return numpy_helper.from_array(np.array(values, np.int64), name)


def _compare(model, feeds, executor):
    result = build(model, executor=executor, cache=None, progress=False)
    got = result.load().run(feeds)
    want = model_zoo.onnxruntime_outputs(model, feeds)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5, err_msg=name)
    return result


def _weight_ops(result) -> set:
    """Ops of the kernels that only rearrange weights (none should be left)."""
    return {op for c in result.lowered.calls for op in c.ops} & {"Slice", "Concat", "Unsqueeze"}


@pytest.mark.parametrize("cell,gates", [("LSTM", 4), ("GRU", 3)])
def test_recurrent_weights_sliced_and_concatenated_from_initializers(cell, gates, executor):
    """As the dynamo exporter writes them: each gate block sliced out of weight_ih_l0 and
    weight_hh_l0, put back in ONNX's gate order by Concat, Unsqueezed to [1, gates*H, ...]."""
    hidden, width = 5, 3
    rng = np.random.default_rng(0)
    w_ih = (rng.standard_normal((gates * hidden, width)) * 0.5).astype(np.float32)
    w_hh = (rng.standard_normal((gates * hidden, hidden)) * 0.5).astype(np.float32)
    bias = (rng.standard_normal(2 * gates * hidden) * 0.1).astype(np.float32)
    nodes, inits = [], [numpy_helper.from_array(w_ih, "weight_ih_l0"), numpy_helper.from_array(w_hh, "weight_hh_l0"),
                        numpy_helper.from_array(bias, "bias"), _ints("axis0", [0])]
    for src, dst in (("weight_ih_l0", "W"), ("weight_hh_l0", "R")):
        blocks = []
        for gate in reversed(range(gates)):  # (torch's gate order is not ONNX's: the exporter reorders)
            inits += [_ints(f"{dst}_s{gate}", [gate * hidden]), _ints(f"{dst}_e{gate}", [(gate + 1) * hidden])]
            nodes.append(helper.make_node("Slice", [src, f"{dst}_s{gate}", f"{dst}_e{gate}", "axis0"],
                                          [f"{dst}_g{gate}"]))
            blocks.append(f"{dst}_g{gate}")
        nodes += [helper.make_node("Concat", blocks, [f"{dst}_cat"], axis=0),
                  helper.make_node("Unsqueeze", [f"{dst}_cat", "axis0"], [dst])]
    nodes += [helper.make_node("Unsqueeze", ["bias", "axis0"], ["B"]),
              helper.make_node(cell, ["x", "W", "R", "B"], ["Y", "Y_h"], hidden_size=hidden)]
    graph = helper.make_graph(nodes, "rnn", [helper.make_tensor_value_info("x", F, [6, 2, width])],
                              [helper.make_tensor_value_info("Y", F, None), helper.make_tensor_value_info("Y_h", F, None)],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    feeds = {"x": rng.standard_normal((6, 2, width)).astype(np.float32)}
    assert not _weight_ops(_compare(model, feeds, executor))


def _branch(name: str, hidden: int, seed: int):
    """A branch computing an LSTM over the outer 'x' with weights Unsqueezed inside it."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array((rng.standard_normal((4 * hidden, 3)) * 0.5).astype(np.float32), f"{name}_w"),
             numpy_helper.from_array((rng.standard_normal((4 * hidden, hidden)) * 0.5).astype(np.float32), f"{name}_r"),
             _ints(f"{name}_axis", [0])]
    nodes = [helper.make_node("Unsqueeze", [f"{name}_w", f"{name}_axis"], [f"{name}_W"]),
             helper.make_node("Unsqueeze", [f"{name}_r", f"{name}_axis"], [f"{name}_R"]),
             helper.make_node("LSTM", ["x", f"{name}_W", f"{name}_R"], [f"{name}_Y", f"{name}_h"], hidden_size=hidden),
             helper.make_node("ReduceMean", [f"{name}_h"], [f"{name}_out"], keepdims=0)]
    return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(f"{name}_out", F, None)], inits)


@pytest.mark.parametrize("rate", [16000, 8000])
def test_lstm_weights_computed_inside_branches_taken_at_run_time(rate, executor):
    """If(sr == 16000) picks one of two LSTM decoders; sr is a run-time input, so the If stays a
    branch, and each branch's Unsqueezed weights are folded in it."""
    nodes = [helper.make_node("Equal", ["sr", "sr16k"], ["is16k"]),
             helper.make_node("If", ["is16k"], ["out"], then_branch=_branch("then", 4, 1),
                              else_branch=_branch("else", 4, 2))]
    graph = helper.make_graph(nodes, "vad", [helper.make_tensor_value_info("x", F, [5, 1, 3]),
                                             helper.make_tensor_value_info("sr", TensorProto.INT64, [])],
                              [helper.make_tensor_value_info("out", F, None)], [_ints("sr16k", 16000)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    feeds = {"x": np.random.default_rng(3).standard_normal((5, 1, 3)).astype(np.float32),
             "sr": np.array(rate, np.int64)}
    assert not _weight_ops(_compare(model, feeds, executor))


def test_range_over_a_cast_of_a_feature_maps_shape(executor):
    """A YOLO-style anchor grid: Range(0, float(width of a conv's output), 1), added to the
    feature map along its last axis. Shape -> Gather -> Cast -> Range are all known once the
    input's shape is."""
    rng = np.random.default_rng(4)
    nodes = [helper.make_node("Conv", ["x", "w"], ["f"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Shape", ["f"], ["shape"]),
             helper.make_node("Gather", ["shape", "three"], ["width"], axis=0),
             helper.make_node("Cast", ["width"], ["width_f"], to=F),
             helper.make_node("Range", ["zero", "width_f", "one"], ["grid"]),
             helper.make_node("Add", ["f", "grid"], ["y"])]
    inits = [numpy_helper.from_array((rng.standard_normal((8, 3, 3, 3)) * 0.3).astype(np.float32), "w"),
             _ints("three", 3), numpy_helper.from_array(np.float32(0), "zero"),
             numpy_helper.from_array(np.float32(1), "one")]
    graph = helper.make_graph(nodes, "yolo", [helper.make_tensor_value_info("x", F, [1, 3, 20, 26])],
                              [helper.make_tensor_value_info("y", F, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    _compare(model, {"x": rng.standard_normal((1, 3, 20, 26)).astype(np.float32)}, executor)


def _lstm_body(kind: str, hidden: int = 4):
    """A Loop or Scan body: an LSTM over the outer 'x' whose weights are Unsqueezed (and, for
    R, Transposed twice) inside the body, its mean added to the carried sum."""
    branch = _branch(f"{kind}_body", hidden, seed=5)
    nodes = list(branch.node)
    name = f"{kind}_body"
    nodes[1] = helper.make_node("Transpose", [f"{name}_r"], [f"{name}_rt"], perm=[1, 0])
    nodes.insert(2, helper.make_node("Transpose", [f"{name}_rt"], [f"{name}_rtt"], perm=[1, 0]))
    nodes.insert(3, helper.make_node("Unsqueeze", [f"{name}_rtt", f"{name}_axis"], [f"{name}_R"]))
    nodes.append(helper.make_node("Add", ["sum_in", f"{name}_out"], ["sum_out"]))
    inputs = [helper.make_tensor_value_info("sum_in", F, [])]
    outputs = [helper.make_tensor_value_info("sum_out", F, [])]
    if kind == "loop":
        nodes.append(helper.make_node("Identity", ["cond_in"], ["cond_out"]))
        inputs = [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                  helper.make_tensor_value_info("cond_in", TensorProto.BOOL, [])] + inputs
        outputs = [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, [])] + outputs
    else:  # a Scan also scans a row of 'rows' and adds it
        nodes.append(helper.make_node("ReduceSum", ["row"], ["row_sum"], keepdims=0))
        nodes[-2] = helper.make_node("Add", ["sum_in", f"{name}_out"], ["partial"])
        nodes.append(helper.make_node("Add", ["partial", "row_sum"], ["sum_out"]))
        inputs.append(helper.make_tensor_value_info("row", F, [3]))
    return helper.make_graph(nodes, name, inputs, outputs, list(branch.initializer))


@pytest.mark.parametrize("kind", ["loop", "scan"])
def test_lstm_weights_computed_inside_loop_and_scan_bodies(kind, executor):
    """The same chains inside a Loop (static trip count) and a Scan body."""
    zero = numpy_helper.from_array(np.float32(0), "zero")
    inputs = [helper.make_tensor_value_info("x", F, [5, 1, 3])]
    if kind == "loop":
        node = helper.make_node("Loop", ["trips", "", "zero"], ["total"], body=_lstm_body("loop"))
        inits = [zero, _ints("trips", 3)]
    else:
        node = helper.make_node("Scan", ["zero", "rows"], ["total"], body=_lstm_body("scan"), num_scan_inputs=1)
        inits = [zero]
        inputs.append(helper.make_tensor_value_info("rows", F, [4, 3]))
    graph = helper.make_graph([node], kind, inputs, [helper.make_tensor_value_info("total", F, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    rng = np.random.default_rng(6)
    feeds = {"x": rng.standard_normal((5, 1, 3)).astype(np.float32)}
    if kind == "scan":
        feeds["rows"] = rng.standard_normal((4, 3)).astype(np.float32)
    assert not _weight_ops(_compare(model, feeds, executor))
