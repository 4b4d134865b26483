"""If, Loop and Scan against onnxruntime: branches taken at run time (both ways), decided at
compile time, loops unrolled with carried values, scan outputs and a run-time condition."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from modelkiln.ir.errors import KilnError
from modelkiln.orchestrator.api import build
from tests import model_zoo

F, I64, B = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL


def _vi(name, t, shape):
    return helper.make_tensor_value_info(name, t, shape)


def _model(nodes, inputs, outputs, inits=()):
    graph = helper.make_graph(nodes, "g", [_vi(*i) for i in inputs], [_vi(o, t, None) for o, t in outputs],
                              [numpy_helper.from_array(v, n) for n, v in inits])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _build(model):
    return build(model, executor="inprocess", cache=None, progress=False)


def _check(model, feeds_list, result=None):
    module = (result or _build(model)).load()
    for feeds in feeds_list:
        got, want = module.run(feeds), model_zoo.onnxruntime_outputs(model, feeds)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)


def sample_rate_model():
    """A speech front end that branches on its sample-rate input: 16 kHz audio goes through
    a strided conv, anything else through a different conv and a sigmoid; both branches
    read tensors from the graph around the If."""
    rng = np.random.default_rng(0)
    w16 = (rng.standard_normal((4, 1, 5)) * 0.3).astype(np.float32)
    w8 = (rng.standard_normal((4, 1, 3)) * 0.3).astype(np.float32)
    then_ = helper.make_graph([helper.make_node("Conv", ["audio", "w16"], ["t"], strides=[2], pads=[2, 2]),
                               helper.make_node("Relu", ["t"], ["t_out"])], "sixteen_khz", [],
                              [_vi("t_out", F, [1, 4, 32])], [numpy_helper.from_array(w16, "w16")])
    else_ = helper.make_graph([helper.make_node("Conv", ["audio", "w8"], ["e"], strides=[2], pads=[1, 1]),
                               helper.make_node("Sigmoid", ["e"], ["e1"]),
                               helper.make_node("Mul", ["e1", "gain"], ["e_out"])], "other_rates", [],
                              [_vi("e_out", F, [1, 4, 32])], [numpy_helper.from_array(w8, "w8")])
    nodes = [helper.make_node("Mul", ["x", "half"], ["audio"]),
             helper.make_node("ReduceMean", ["audio"], ["gain"], keepdims=1),
             helper.make_node("Equal", ["sr", "k16000"], ["is16k"]),
             helper.make_node("If", ["is16k"], ["features"], then_branch=then_, else_branch=else_),
             helper.make_node("Tanh", ["features"], ["y"])]
    return _model(nodes, [("x", F, [1, 1, 64]), ("sr", I64, [])], [("y", F)],
                  [("half", np.float32(0.5)), ("k16000", np.array(16000, np.int64))])


def test_if_on_a_run_time_input_takes_either_branch():
    model = sample_rate_model()
    result = _build(model)
    x = np.random.default_rng(1).standard_normal((1, 1, 64)).astype(np.float32)
    _check(model, [{"x": x, "sr": np.array(16000, np.int64)}, {"x": x, "sr": np.array(8000, np.int64)}], result)
    entry = result.files["kiln_entry.c"].decode()
    assert entry.count("if (") >= 2  # the branches' kernels are called under their guards
    guards = {tuple(v for _, v in c.guard) for c in result.lowered.calls}
    assert guards == {(), (True,), (False,)}


def test_a_branch_that_cannot_run_at_these_sizes_is_named_as_one():
    """Silero VAD's 8 kHz branch at 16 kHz's 512 samples: Kiln compiles both branches of an If
    decided at run time, and a shape error inside one says that it is in such a branch and
    which condition takes it (onnxruntime runs only the branch it takes)."""
    model = sample_rate_model()
    bad = helper.make_graph([helper.make_node("MatMul", ["audio", "w_bad"], ["e_out"])], "other_rates", [],
                            [_vi("e_out", F, None)], [numpy_helper.from_array(np.ones((3, 4), np.float32), "w_bad")])
    if_node = next(n for n in model.graph.node if n.op_type == "If")
    next(a for a in if_node.attribute if a.name == "else_branch").g.CopyFrom(bad)
    with pytest.raises(KilnError, match="MatMul.*the branch of an If taken when 'is16k' is false, decided only at "
                                        "run time: Kiln compiles both branches, and this one cannot run"):
        _build(model)


def test_if_decided_at_compile_time_is_its_branch():
    """The condition folds from the input's shape: only the taken branch is compiled."""
    then_ = helper.make_graph([helper.make_node("Sigmoid", ["x"], ["a"])], "then", [], [_vi("a", F, [2, 3])])
    else_ = helper.make_graph([helper.make_node("Exp", ["x"], ["b"])], "else", [], [_vi("b", F, [2, 3])])
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("ReduceProd", ["s"], ["n"], keepdims=0),
             helper.make_node("Greater", ["n", "five"], ["big"]),
             helper.make_node("If", ["big"], ["y"], then_branch=then_, else_branch=else_)]
    model = _model(nodes, [("x", F, [2, 3])], [("y", F)], [("five", np.array(5, np.int64))])
    result = _build(model)
    ops = [op for c in result.lowered.calls for op in c.ops]
    assert "Sigmoid" in ops and "Exp" not in ops
    _check(model, [{"x": np.random.default_rng(2).standard_normal((2, 3)).astype(np.float32)}], result)


def test_branches_of_different_sizes_give_the_taken_ones():
    """Branches of 2 and 4 elements on a condition fed at run time: the output is as long as
    the branch taken (a size the module reads from the condition); ranks must agree."""
    then_ = helper.make_graph([helper.make_node("Identity", ["x"], ["a"])], "then", [], [_vi("a", F, None)])
    else_ = helper.make_graph([helper.make_node("Concat", ["x", "x"], ["b"], axis=0)], "else", [],
                              [_vi("b", F, None)])
    model = _model([helper.make_node("If", ["c"], ["y"], then_branch=then_, else_branch=else_, name="pick"),
                    helper.make_node("Softmax", ["y"], ["out"], axis=0)],
                   [("x", F, [2]), ("c", B, [])], [("out", F)])
    _check(model, [{"x": np.array([1.0, -2.0], np.float32), "c": np.array(c)} for c in (True, False)])
    flat = helper.make_graph([helper.make_node("Unsqueeze", ["x", "zero"], ["r"])], "else", [], [_vi("r", F, None)])
    ranks = _model([helper.make_node("If", ["c"], ["y"], then_branch=then_, else_branch=flat, name="pick")],
                   [("x", F, [2]), ("c", B, [])], [("y", F)], [("zero", np.array([0], np.int64))])
    with pytest.raises(KilnError, match="pick.*then branch.*else branch.*rank"):
        _build(ranks)


def test_a_loop_body_needing_its_data_at_compile_time_is_refused_at_once():
    """Mask R-CNN's paste loop resizes each mask to a size computed from its box: a body tensor
    needed at compile time. Refused naming the Resize (the build had retried without end)."""
    body = _loop_body([helper.make_node("Identity", ["cond_in"], ["cond_out"]),
                       helper.make_node("Add", ["i", "two"], ["side"]),
                       helper.make_node("Unsqueeze", ["side", "zero"], ["side1"]),
                       helper.make_node("Concat", ["ones", "side1", "side1"], ["sizes"], axis=0),
                       helper.make_node("Resize", ["v0", "", "", "sizes"], ["big"], name="grow"),
                       helper.make_node("ReduceMean", ["big"], ["v0_out"], axes=[2, 3], keepdims=1)], [[1, 1, 1, 1]],
                      inits=[("two", np.int64(2)), ("zero", np.array([0], np.int64)), ("ones", np.ones(2, np.int64))])
    model = _model([helper.make_node("Loop", ["n", "", "v_init"], ["v_final"], body=body, name="steps")],
                   [("v_init", F, [1, 1, 1, 1]), ("n", I64, [])], [("v_final", F)])
    with pytest.raises(KilnError, match="grow.*sizes.*must be known at compile time"):
        _build(model)


def _loop_body(nodes, carried_shapes, scans=(), inits=()):
    inputs = [_vi("i", I64, []), _vi("cond_in", B, [])] + [_vi(f"v{k}", F, s) for k, s in enumerate(carried_shapes)]
    outputs = [_vi("cond_out", B, [])] + [_vi(f"v{k}_out", F, s) for k, s in enumerate(carried_shapes)]
    outputs += [_vi(s, F, None) for s in scans]
    return helper.make_graph(nodes, "body", inputs, outputs, [numpy_helper.from_array(v, n) for n, v in inits])


def test_loop_with_carried_values_and_scan_outputs():
    """v <- v * i + v + x (x from outside the loop), scan out sin(v), and an If inside the body
    on a value the body computes."""
    inner_then = helper.make_graph([helper.make_node("Neg", ["s"], ["p"])], "neg", [], [_vi("p", F, [3])])
    inner_else = helper.make_graph([helper.make_node("Abs", ["s"], ["q"])], "abs", [], [_vi("q", F, [3])])
    body = _loop_body([helper.make_node("Identity", ["cond_in"], ["cond_out"]),
                       helper.make_node("Cast", ["i"], ["fi"], to=F),
                       helper.make_node("Mul", ["v0", "fi"], ["m"]),
                       helper.make_node("Add", ["m", "v0"], ["m2"]),
                       helper.make_node("Add", ["m2", "x"], ["v0_out"]),
                       helper.make_node("Sin", ["v0_out"], ["s"]),
                       helper.make_node("ReduceSum", ["s"], ["total"], keepdims=0),
                       helper.make_node("Greater", ["total", "zero"], ["positive"]),
                       helper.make_node("If", ["positive"], ["scan"], then_branch=inner_then,
                                        else_branch=inner_else)],
                      [[3]], ["scan"], [("zero", np.float32(0))])
    model = _model([helper.make_node("Loop", ["trip", "", "v_init"], ["v_final", "scanned"], body=body)],
                   [("v_init", F, [3]), ("x", F, [3])], [("v_final", F), ("scanned", F)],
                   [("trip", np.array(6, np.int64))])
    rng = np.random.default_rng(3)
    _check(model, [{"v_init": rng.standard_normal(3).astype(np.float32) * 0.1,
                    "x": rng.standard_normal(3).astype(np.float32) * 0.1} for _ in range(3)])


def test_loop_with_a_run_time_condition():
    """Stops when the running sum reaches a limit given at run time (or after 10 steps)."""
    body = _loop_body([helper.make_node("Add", ["v0", "one"], ["v0_out"]),
                       helper.make_node("ReduceSum", ["v0_out"], ["s"], keepdims=0),
                       helper.make_node("Less", ["s", "limit"], ["cond_out"])], [[3]], inits=[("one", np.float32(1))])
    model = _model([helper.make_node("Loop", ["trip", "go", "v_init"], ["v_final"], body=body)],
                   [("v_init", F, [3]), ("limit", F, []), ("go", B, [])], [("v_final", F)],
                   [("trip", np.array(10, np.int64))])
    _check(model, [{"v_init": np.zeros(3, np.float32), "limit": np.array(lim, np.float32), "go": np.array(go)}
                   for lim, go in ((5.0, True), (12.0, True), (100.0, True), (-1.0, True), (5.0, False))])


def test_a_long_loop_runs_in_the_entry_function():
    """An RNN-like body (a matmul with a weight from outside, tanh) 40 times: compiled once,
    called in a C loop by the entry function."""
    body = _loop_body([helper.make_node("Identity", ["cond_in"], ["cond_out"]),
                       helper.make_node("MatMul", ["v0", "w"], ["t"]), helper.make_node("Add", ["t", "x"], ["t2"]),
                       helper.make_node("Tanh", ["t2"], ["v0_out"])], [[1, 8]])
    w = (np.random.default_rng(5).standard_normal((8, 8)) * 0.4).astype(np.float32)
    model = _model([helper.make_node("Loop", ["trip", "", "v_init"], ["v_final"], body=body)],
                   [("v_init", F, [1, 8]), ("x", F, [1, 8])], [("v_final", F)],
                   [("trip", np.array(40, np.int64)), ("w", w)])
    result = _build(model)
    assert len(result.lowered.calls) == 1
    assert "for (long long it = 0; it < 40; ++it)" in result.files["kiln_entry.c"].decode()
    _check(model, [{"v_init": np.ones((1, 8), np.float32), "x": np.linspace(-1, 1, 8, dtype=np.float32)[None]}],
           result)


def _accumulating_scan_body():
    """acc <- acc + xi; y = acc * xr (two scan inputs, one state, one scan output of [4])."""
    return helper.make_graph([helper.make_node("Add", ["acc", "xi"], ["acc_out"]),
                              helper.make_node("Mul", ["acc_out", "xr"], ["y"])], "body",
                             [_vi("acc", F, [4]), _vi("xi", F, [4]), _vi("xr", F, [4])],
                             [_vi("acc_out", F, [4]), _vi("y", F, [4])])


def test_scan_with_reverse_input_and_output_axis():
    body = _accumulating_scan_body()
    model = _model([helper.make_node("Scan", ["a0", "xs", "xs2"], ["af", "ys"], body=body, num_scan_inputs=2,
                                     scan_input_directions=[0, 1], scan_output_axes=[1])],
                   [("a0", F, [4]), ("xs", F, [6, 4]), ("xs2", F, [6, 4])], [("af", F), ("ys", F)])
    rng = np.random.default_rng(4)
    _check(model, [{"a0": rng.standard_normal(4).astype(np.float32), "xs": rng.standard_normal((6, 4)).astype(np.float32),
                    "xs2": rng.standard_normal((6, 4)).astype(np.float32)}])


def test_loop_with_a_run_time_trip_count():
    """`for i in range(n)` with n an input (torch.jit.script's export): one body, run by the
    entry function n times, for any n, 0 and negative included (no iterations)."""
    body = _loop_body([helper.make_node("Identity", ["cond_in"], ["cond_out"]),
                       helper.make_node("Cast", ["i"], ["fi"], to=F),
                       helper.make_node("Mul", ["v0", "half"], ["h"]),
                       helper.make_node("Add", ["h", "fi"], ["v0_out"])], [[2]], inits=[("half", np.float32(0.5))])
    model = _model([helper.make_node("Loop", ["n", "", "v_init"], ["v_final"], body=body, name="steps")],
                   [("v_init", F, [2]), ("n", I64, [])], [("v_final", F)])
    result = _build(model)
    assert "it < *(const long long*)" in result.files["kiln_entry.c"].decode()
    _check(model, [{"v_init": np.array([1.0, -3.0], np.float32), "n": np.array(n, np.int64)}
                   for n in (0, 1, 7, 300, -2)], result)


def test_while_loop_runs_until_its_condition_fails():
    """A Loop without a trip count (torch's while_loop): it runs while the body's condition
    holds, or not at all when the initial condition is false; with a trip count as well it
    stops at whichever comes first."""
    body = _loop_body([helper.make_node("Mul", ["v0", "two"], ["v0_out"]),
                       helper.make_node("ReduceSum", ["v0_out"], ["s"], keepdims=0),
                       helper.make_node("Less", ["s", "limit"], ["cond_out"])], [[3]], inits=[("two", np.float32(2))])
    while_model = _model([helper.make_node("Loop", ["", "go", "v_init"], ["v_final"], body=body)],
                         [("v_init", F, [3]), ("limit", F, []), ("go", B, [])], [("v_final", F)])
    both = _model([helper.make_node("Loop", ["n", "go", "v_init"], ["v_final"], body=body)],
                  [("v_init", F, [3]), ("limit", F, []), ("go", B, []), ("n", I64, [])], [("v_final", F)])
    feeds = [{"v_init": np.array([0.5, 1, 0.25], np.float32), "limit": np.array(lim, np.float32), "go": np.array(go)}
             for lim, go in ((5.0, True), (1000.0, True), (1.0, True), (1e30, True), (50.0, False))]
    _check(while_model, feeds)
    _check(both, [{**f, "n": np.array(n, np.int64)} for f in feeds for n in (0, 3, 50)])


def test_scan_outputs_over_a_run_time_trip_count_need_its_bounds():
    """`for i in range(n)` stacking a row per iteration: the rows are n long, so the build
    asks for n's bounds, and with them the module plans at the greatest and returns n rows."""
    body = _loop_body([helper.make_node("Identity", ["cond_in"], ["cond_out"]),
                       helper.make_node("Neg", ["v0"], ["v0_out"]), helper.make_node("Abs", ["v0"], ["y"])], [[2]],
                      scans=["y"])
    model = _model([helper.make_node("Loop", ["n", "", "v_init"], ["v_final", "ys"], body=body, name="steps")],
                   [("v_init", F, [2]), ("n", I64, [])], [("v_final", F), ("ys", F)])
    with pytest.raises(KilnError, match=r"steps.*scan outputs are as long as the iterations it runs.*trip count 'n'.*"
                                        r"--dim n=LEAST\.\.GREATEST"):
        _build(model)
    module = build(model, executor="inprocess", cache=None, progress=False, dims={"n": (0, 16)}).load()
    feeds = [{"v_init": np.array([1.5, -2.0], np.float32), "n": np.array(n, np.int64)} for n in (0, 1, 7, 16)]
    for f in feeds:
        got, want = module.run(f), model_zoo.onnxruntime_outputs(model, f)
        assert got["ys"].shape == want["ys"].shape == (int(f["n"]), 2)
        np.testing.assert_array_equal(got["ys"], want["ys"])
        np.testing.assert_array_equal(got["v_final"], want["v_final"])
    with pytest.raises(KilnError, match=r"\bn\b.*17"):
        module.run({"v_init": np.zeros(2, np.float32), "n": np.array(17, np.int64)})


def _doubling_body_with_scan_output():
    """v <- 2v; go on while sum(v) < limit; scan out v + i (the iteration number)."""
    return _loop_body([helper.make_node("Mul", ["v0", "two"], ["v0_out"]),
                       helper.make_node("ReduceSum", ["v0_out"], ["s"], keepdims=0),
                       helper.make_node("Less", ["s", "limit"], ["cond_out"]),
                       helper.make_node("Cast", ["i"], ["fi"], to=F),
                       helper.make_node("Add", ["v0_out", "fi"], ["y"])], [[3]], scans=["y"],
                      inits=[("two", np.float32(2))])


@pytest.mark.parametrize("trip, first_condition", [("twelve", "go"), ("twelve", ""), ("n", "go"), ("n", "")])
def test_scan_outputs_of_a_loop_stopping_on_its_condition(trip, first_condition):
    """A while loop with a trip count (tf.while_loop writing a TensorArray, torch.jit.script's
    `while` appending rows): it stops on a condition the body computes, so its scan outputs
    are as long as the iterations it ran, which the module counts and reads after the loop;
    a ReduceSum and a Shape read them at that length. Without a first condition the first
    iteration is unrolled (its condition folds) and the rest, counting their iteration
    numbers from 1, run in the entry function."""
    body = _doubling_body_with_scan_output()
    inputs = [("v_init", F, [3]), ("limit", F, [])] + [("go", B, [])] * bool(first_condition) + \
        [("n", I64, [])] * (trip == "n")
    model = _model([helper.make_node("Loop", [trip, first_condition, "v_init"], ["v_final", "ys"], body=body),
                    helper.make_node("ReduceSum", ["ys"], ["total"], keepdims=0),
                    helper.make_node("Shape", ["ys"], ["ys_shape"])],
                   inputs, [("v_final", F), ("ys", F), ("total", F), ("ys_shape", I64)],
                   [("twelve", np.array(12, np.int64))])
    result = build(model, executor="inprocess", cache=None, progress=False,
                   dims={"n": (0, 12)} if trip == "n" else None)
    assert "kiln_iterations" in result.files["kiln_entry.c"].decode()
    module = result.load()
    for limit, go, n in ((5.0, True, 3), (1000.0, True, 12), (1000.0, True, 9), (1.0, True, 5), (1e30, True, 0),
                         (50.0, False, 4)):
        feeds = {"v_init": np.array([0.5, 1, 0.25], np.float32), "limit": np.array(limit, np.float32)}
        feeds.update({"go": np.array(go)} if first_condition else {})
        feeds.update({"n": np.array(n, np.int64)} if trip == "n" else {})
        got, want = module.run(feeds), model_zoo.onnxruntime_outputs(model, feeds)
        for name in want:
            assert got[name].shape == want[name].shape, (name, feeds)
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{name} {feeds}")


def test_a_loop_stopping_on_its_condition_inside_a_branch():
    """The loop's count is read only where its branch ran; the other branch's output is
    another length."""
    body = _doubling_body_with_scan_output()
    then_ = helper.make_graph([helper.make_node("Loop", ["twelve", "", "v_init"], ["vf", "ys_loop"], body=body)],
                              "looped", [], [_vi("ys_loop", F, None)])
    else_ = helper.make_graph([helper.make_node("Unsqueeze", ["v_init", "zero_axis"], ["ys_once"])], "once", [],
                              [_vi("ys_once", F, None)])
    model = _model([helper.make_node("If", ["go"], ["ys"], then_branch=then_, else_branch=else_),
                    helper.make_node("ReduceSum", ["ys"], ["total"], keepdims=0, noop_with_empty_axes=0)],
                   [("v_init", F, [3]), ("limit", F, []), ("go", B, [])], [("ys", F), ("total", F)],
                   [("twelve", np.array(12, np.int64)), ("zero_axis", np.array([0], np.int64))])
    _check(model, [{"v_init": np.array([0.5, 1, 0.25], np.float32), "limit": np.array(limit, np.float32),
                    "go": np.array(go)} for limit, go in ((5.0, True), (1000.0, True), (5.0, False))])


def scripted_break_condition(value: str, threshold: str) -> list:
    """The condition a loop body hands back where torch.jit.script exports `for i in
    range(max_len): ...; if value > threshold: break`: `i + 1 < max_len and not (value >
    threshold)`, the counter carried in as i_in and out as i_out (`one` a constant 1)."""
    return [helper.make_node("Greater", [value, threshold], ["stop"]),
            helper.make_node("Not", ["stop"], ["go_on"]),
            helper.make_node("Add", ["i_in", "one"], ["i_out"]),
            helper.make_node("Less", ["i_out", "max_len"], ["in_range"]),
            helper.make_node("And", ["in_range", "go_on"], ["cond_out"])]


def scripted_greedy_decoder():
    """A greedy decoding loop as torch.jit.script exports `for i in range(max_len): ...;
    out = torch.cat([out, tok[None]]); if (tok == 10).any(): break`: a trip count of the
    largest int64, the counter i carried and compared with max_len in the body's condition,
    the tokens appended to a carried tensor (made a scan output)."""
    rng = np.random.default_rng(7)
    weights = {"emb": rng.standard_normal((16, 8)), "cell_w": rng.standard_normal((8, 16)) * 0.4,
               "cell_b": rng.standard_normal(8) * 0.1, "out_w": rng.standard_normal((16, 8)),
               "out_b": rng.standard_normal(16) * 0.1}
    inits = [(k, v.astype(np.float32)) for k, v in weights.items()]
    inits += [("forever", np.array(np.iinfo(np.int64).max, np.int64)), ("zero", np.array(0, np.int64)),
              ("one", np.array(1, np.int64)), ("stop_token", np.array(10, np.int64)),
              ("axis0", np.array([0], np.int64)), ("first_out", np.ones((1, 2), np.int64)),
              ("first_tok", np.ones(2, np.int64))]
    body = helper.make_graph(
        [helper.make_node("Gather", ["emb", "tok"], ["e"]),
         helper.make_node("Concat", ["e", "h_in"], ["eh"], axis=1),
         helper.make_node("Gemm", ["eh", "cell_w", "cell_b"], ["pre"], transB=1),
         helper.make_node("Tanh", ["pre"], ["h_out"]),
         helper.make_node("Gemm", ["h_out", "out_w", "out_b"], ["logits"], transB=1),
         helper.make_node("ArgMax", ["logits"], ["tok_out"], axis=-1, keepdims=0),
         helper.make_node("Unsqueeze", ["tok_out", "axis0"], ["row"]),
         helper.make_node("Concat", ["out_in", "row"], ["out_out"], axis=0),
         helper.make_node("Equal", ["tok_out", "stop_token"], ["hit"]),
         helper.make_node("Cast", ["hit"], ["hits"], to=I64),
         helper.make_node("ReduceSum", ["hits"], ["n_hits"], keepdims=0),
         *scripted_break_condition("n_hits", "zero")],
        "body", [_vi("iteration", I64, []), _vi("cond_in", B, []), _vi("out_in", I64, None), _vi("h_in", F, [2, 8]),
                 _vi("tok", I64, [2]), _vi("i_in", I64, [])],
        [_vi("cond_out", B, []), _vi("out_out", I64, None), _vi("h_out", F, [2, 8]), _vi("tok_out", I64, [2]),
         _vi("i_out", I64, [])])
    return _model([helper.make_node("Greater", ["max_len", "zero"], ["go"]),
                   helper.make_node("Loop", ["forever", "go", "first_out", "h", "first_tok", "zero"],
                                    ["tokens", "h_last", "tok_last", "i_last"], body=body)],
                  [("h", F, [2, 8]), ("max_len", I64, [])], [("tokens", I64)], inits)


def test_a_scripted_decoding_loop_stops_within_its_counter_limit():
    """The counter's limit bounds the loop (max_len's --dim bounds: `_counter_bound`), so the
    appended tokens are a scan output planned at 33 rows, returned at the length the loop ran:
    to max_len, or fewer where it breaks early. Without max_len's bounds the build names it."""
    model = scripted_greedy_decoder()
    with pytest.raises(KilnError, match=r"counter reaches 'max_len'.*--dim max_len=LEAST\.\.GREATEST"):
        _build(model)
    module = build(model, executor="inprocess", cache=None, progress=False, dims={"max_len": (0, 32)}).load()
    rng, lengths = np.random.default_rng(8), []
    for max_len in (0, 1, 5, 10, 32):
        for _ in range(4):
            feeds = {"h": (rng.standard_normal((2, 8)) * 2).astype(np.float32), "max_len": np.array(max_len, np.int64)}
            got, want = module.run(feeds)["tokens"], model_zoo.onnxruntime_outputs(model, feeds)["tokens"]
            np.testing.assert_array_equal(got, want)
            lengths.append((len(got), max_len + 1))
    assert any(n < full for n, full in lengths) and any(n == full > 2 for n, full in lengths)  # (both ways ran)


def test_a_while_loop_too_long_to_unroll():
    """torch.jit.script exports `while` as a Loop whose trip count is the largest int64: it
    runs in the entry function until its condition fails. Its scan outputs would need memory
    for that many rows: refused by name, as is a while loop with scan outputs and no trip
    count at all."""
    body = _loop_body([helper.make_node("Mul", ["v0", "two"], ["v0_out"]),
                       helper.make_node("ReduceSum", ["v0_out"], ["s"], keepdims=0),
                       helper.make_node("Less", ["s", "limit"], ["cond_out"])], [[3]], inits=[("two", np.float32(2))])
    forever = [("forever", np.array(np.iinfo(np.int64).max, np.int64))]
    model = _model([helper.make_node("Loop", ["forever", "", "v_init"], ["v_final"], body=body)],
                   [("v_init", F, [3]), ("limit", F, [])], [("v_final", F)], forever)
    _check(model, [{"v_init": np.array([0.5, 1, 0.25], np.float32), "limit": np.array(limit, np.float32)}
                   for limit in (5.0, 1000.0, 1.0)])
    scans = _doubling_body_with_scan_output()
    with pytest.raises(KilnError, match=r"scan outputs are as long as .* may run, 922337203685477580[67], more than"):
        _build(_model([helper.make_node("Loop", ["forever", "", "v_init"], ["v_final", "ys"], body=scans)],
                      [("v_init", F, [3]), ("limit", F, [])], [("v_final", F), ("ys", F)], forever))
    with pytest.raises(KilnError, match=r"no trip count \(a while loop\) and it has scan outputs"):
        _build(_model([helper.make_node("Loop", ["", "go", "v_init"], ["v_final", "ys"], body=scans)],
                      [("v_init", F, [3]), ("limit", F, []), ("go", B, [])], [("v_final", F), ("ys", F)]))


def test_short_loops_unroll_and_share_their_kernels():
    body = _loop_body([helper.make_node("Identity", ["cond_in"], ["cond_out"]),
                       helper.make_node("MatMul", ["v0", "w"], ["t"]), helper.make_node("Tanh", ["t"], ["v0_out"])],
                      [[1, 8]])
    w = (np.random.default_rng(6).standard_normal((8, 8)) * 0.4).astype(np.float32)
    model = _model([helper.make_node("Loop", ["trip", "", "v_init"], ["v_final"], body=body)],
                   [("v_init", F, [1, 8])], [("v_final", F)], [("trip", np.array(6, np.int64)), ("w", w)])
    result = _build(model)
    assert len(result.lowered.calls) == 6 and len({c.kernel.symbol for c in result.lowered.calls}) == 1
    _check(model, [{"v_init": np.ones((1, 8), np.float32)}], result)


def test_entry_loop_with_scan_outputs_swaps_and_a_branch_in_its_body():
    """50 iterations: two carried values that trade places each step (a Fibonacci-like
    recurrence), a run-time tensor and a constant from outside, the iteration number, an If
    on a value the body computes, and two scan outputs."""
    then_ = helper.make_graph([helper.make_node("Mul", ["s", "half"], ["p"])], "shrink", [], [_vi("p", F, [4])])
    else_ = helper.make_graph([helper.make_node("Neg", ["s"], ["q"])], "flip", [], [_vi("q", F, [4])])
    body = _loop_body([helper.make_node("Identity", ["cond_in"], ["cond_out"]),
                       helper.make_node("Cast", ["i"], ["fi"], to=F),
                       helper.make_node("Mul", ["fi", "tiny"], ["step"]),
                       helper.make_node("Add", ["v0", "v1"], ["s0"]),
                       helper.make_node("Add", ["s0", "step"], ["s1"]),
                       helper.make_node("Mul", ["s1", "x"], ["s"]),
                       helper.make_node("ReduceSum", ["s"], ["total"], keepdims=0),
                       helper.make_node("Less", ["total", "limit"], ["small"]),
                       helper.make_node("If", ["small"], ["v1_out"], then_branch=then_, else_branch=else_),
                       helper.make_node("Identity", ["v1"], ["v0_out"]),
                       helper.make_node("Sin", ["s"], ["trace"])],
                      [[4], [4]], ["trace", "v0_out"], [("half", np.float32(0.5))])
    model = _model([helper.make_node("Loop", ["trip", "", "a", "b"], ["fa", "fb", "traces", "firsts"], body=body)],
                   [("a", F, [4]), ("b", F, [4]), ("x", F, [4])], [("fa", F), ("fb", F), ("traces", F), ("firsts", F)],
                   [("trip", np.array(50, np.int64)), ("tiny", np.float32(0.01)), ("limit", np.float32(2.0))])
    result = _build(model)
    assert "for (long long it = 0; it < 50; ++it)" in result.files["kiln_entry.c"].decode()
    rng = np.random.default_rng(7)
    _check(model, [{"a": rng.standard_normal(4).astype(np.float32), "b": rng.standard_normal(4).astype(np.float32),
                    "x": rng.uniform(0.5, 1.0, 4).astype(np.float32)} for _ in range(3)], result)


def test_nested_entry_loops():
    inner = helper.make_graph([helper.make_node("Identity", ["c_in"], ["c_out"]),
                               helper.make_node("Mul", ["u", "decay"], ["u_out"])], "inner",
                              [_vi("j", I64, []), _vi("c_in", B, []), _vi("u", F, [3])],
                              [_vi("c_out", B, []), _vi("u_out", F, [3])])
    outer = _loop_body([helper.make_node("Identity", ["cond_in"], ["cond_out"]),
                        helper.make_node("Loop", ["inner_trip", "", "v0"], ["inner_out"], body=inner),
                        helper.make_node("Add", ["inner_out", "x"], ["v0_out"])], [[3]])
    model = _model([helper.make_node("Loop", ["trip", "", "v"], ["out"], body=outer)],
                   [("v", F, [3]), ("x", F, [3])], [("out", F)],
                   [("trip", np.array(20, np.int64)), ("inner_trip", np.array(30, np.int64)),
                    ("decay", np.float32(0.97))])
    result = _build(model)
    run = result.files["kiln_entry.c"].decode().split("int kiln_run_profiled")[0]
    assert run.count("for (long long it") == 2  # the inner loop inside the outer one
    _check(model, [{"v": np.array([1.0, -2.0, 0.5], np.float32), "x": np.array([0.1, 0.2, 0.3], np.float32)}], result)


@pytest.mark.parametrize("in_dirs,out_dirs", [([0, 1], [0, 1]), ([1, 0], [1, 0])])
def test_long_scan_runs_in_the_entry_function(in_dirs, out_dirs):
    """60 steps over axis 0: each iteration the entry copies a row of each scan input in and a
    row of each scan output out (from the end where reversed)."""
    body = helper.make_graph([helper.make_node("Add", ["acc", "xi"], ["acc_out"]),
                              helper.make_node("Mul", ["acc_out", "xr"], ["y"]), helper.make_node("Tanh", ["y"], ["t"]),
                              helper.make_node("Neg", ["t"], ["n"])], "body",
                             [_vi("acc", F, [4]), _vi("xi", F, [4]), _vi("xr", F, [4])],
                             [_vi("acc_out", F, [4]), _vi("t", F, [4]), _vi("n", F, [4])])
    model = _model([helper.make_node("Scan", ["a0", "xs", "xs2"], ["af", "ts", "ns"], body=body, num_scan_inputs=2,
                                     scan_input_directions=in_dirs, scan_output_directions=out_dirs)],
                   [("a0", F, [4]), ("xs", F, [60, 4]), ("xs2", F, [60, 4])], [("af", F), ("ts", F), ("ns", F)])
    result = _build(model)
    assert "for (long long it = 0; it < 60; ++it)" in result.files["kiln_entry.c"].decode()
    rng = np.random.default_rng(8)
    _check(model, [{"a0": rng.standard_normal(4).astype(np.float32) * 0.1,
                    "xs": rng.standard_normal((60, 4)).astype(np.float32) * 0.1,
                    "xs2": rng.standard_normal((60, 4)).astype(np.float32)}], result)


def test_scan_and_loop_over_a_symbolic_length():
    """A Scan along a length known at run time (a sequence of any length), forward and
    reversed, and `for i in range(x.shape[0])` with a scan output: one build, trip count and
    stacked outputs as long as the input."""
    body = _accumulating_scan_body()
    scan = _model([helper.make_node("Scan", ["a0", "xs", "xs2"], ["af", "ys"], body=body, num_scan_inputs=2,
                                    scan_input_directions=[0, 1], scan_output_directions=[1])],
                  [("a0", F, [4]), ("xs", F, ["steps", 4]), ("xs2", F, ["steps", 4])], [("af", F), ("ys", F)])
    loop_body = _loop_body([helper.make_node("Identity", ["cond_in"], ["cond_out"]),
                            helper.make_node("Gather", ["xs", "i"], ["row"], axis=0),
                            helper.make_node("Add", ["v0", "row"], ["v0_out"]),
                            helper.make_node("Tanh", ["v0_out"], ["y"])], [[4]], scans=["y"])
    loop = _model([helper.make_node("Shape", ["xs"], ["shape"]),
                   helper.make_node("Gather", ["shape", "zero"], ["n"], axis=0),
                   helper.make_node("Loop", ["n", "", "a0"], ["af", "ys"], body=loop_body)],
                  [("a0", F, [4]), ("xs", F, ["steps", 4])], [("af", F), ("ys", F)], [("zero", np.array(0, np.int64))])
    rng = np.random.default_rng(8)
    for model in (scan, loop):
        result = build(model, dims={"steps": (1, 40)}, executor="inprocess", cache=None, progress=False)
        feeds = [{"a0": rng.standard_normal(4).astype(np.float32),
                  **{x: rng.standard_normal((steps, 4)).astype(np.float32) for x in ("xs", "xs2")
                     if x in [i.name for i in model.graph.input]}} for steps in (1, 5, 17, 40)]
        _check(model, feeds, result)


def _appending_body(axis, part_shape):
    """torch.jit.script's `acc = torch.cat((acc, part))`: the carried `acc` grows by one part
    each iteration; a second carried value is an ordinary running sum."""
    return helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("Gather", ["xs", "i"], ["row"], axis=0),
         helper.make_node("Add", ["total", "row"], ["total_out"]),
         helper.make_node("Reshape", ["row", "part_shape"], ["shaped"]),
         helper.make_node("Tanh", ["shaped"], ["part"]),
         helper.make_node("Concat", ["acc", "part"], ["acc_out"], axis=axis)],
        "body", [_vi("i", I64, []), _vi("cond_in", B, []), _vi("total", F, None), _vi("acc", F, None)],
        [_vi("cond_out", B, []), _vi("total_out", F, None), _vi("acc_out", F, None)],
        [numpy_helper.from_array(np.array(part_shape, np.int64), "part_shape")])


@pytest.mark.parametrize("steps, axis, initial", [(3, 0, (0, 2, 3)), (20, 0, (0, 2, 3)), ("n", 0, (0, 2, 3)),
                                                  ("n", 1, (2, 1, 3)), (5, -1, (2, 3, 0))])
def test_a_carried_value_appended_to_each_iteration(steps, axis, initial):
    """The appended parts become a scan output joined along the Concat's axis after the
    initial value (a constant, as torch's `torch.zeros(0, ...)` is): unrolled (3 steps), in
    the entry function (20), over a length known at run time only (a symbolic `n`, zero
    included), along a middle and the last axis."""
    part = [1, 2, 3] if axis == 0 else [2, 1, 3] if axis == 1 else [2, 3, 1]
    rng = np.random.default_rng(11)
    rows = ["n" if steps == "n" else steps, 6]
    model = _model([helper.make_node("Shape", ["xs"], ["shape"]),
                    helper.make_node("Gather", ["shape", "zero"], ["trip"], axis=0),
                    helper.make_node("Loop", ["trip", "", "total0", "acc0"], ["total", "acc"],
                                     body=_appending_body(axis, part))],
                   [("xs", F, rows), ("total0", F, [6])], [("total", F), ("acc", F)],
                   [("zero", np.array(0, np.int64)), ("acc0", rng.standard_normal(initial).astype(np.float32))])
    dims = {"n": (0, 40)} if steps == "n" else None
    result = build(model, dims=dims, executor="inprocess", cache=None, progress=False)
    lengths = (0, 1, 7, 40) if steps == "n" else (steps,)
    _check(model, [{"xs": rng.standard_normal((n, 6)).astype(np.float32),
                    "total0": rng.standard_normal(6).astype(np.float32)} for n in lengths], result)


def test_random_inputs_take_a_bounded_value_from_dims():
    """Module.random_inputs gives an integer input read as a value (max_len) the value `dims`
    names, by the input or its element's symbol, else its least (bench/compare_commits.py's
    `--at max_len=64`)."""
    module = build(scripted_greedy_decoder(), executor="inprocess", cache=None, progress=False,
                   dims={"max_len": (2, 32)}).load()
    assert int(module.random_inputs()["max_len"]) == 2
    assert int(module.random_inputs(dims={"max_len": 9})["max_len"]) == 9
    assert int(module.random_inputs(dims={"max_len[0]": 7})["max_len"]) == 7
    assert module.run(module.random_inputs(dims={"max_len": 9}))["tokens"].shape[0] <= 10


def test_a_loop_whose_condition_is_false_from_the_start_is_skipped_however_long():
    """A constant false first condition runs no iteration, whatever the trip count: even one
    of the largest int64, too long to unroll, gives the initial values back."""
    body = _loop_body([helper.make_node("Identity", ["cond_in"], ["cond_out"]),
                       helper.make_node("Neg", ["v0"], ["v0_out"])], [[2]])
    model = _model([helper.make_node("Loop", ["forever", "never", "v_init"], ["v_final"], body=body)],
                   [("v_init", F, [2])], [("v_final", F)],
                   [("forever", np.array(np.iinfo(np.int64).max, np.int64)), ("never", np.array(False))])
    _check(model, [{"v_init": np.array([1.5, -2.0], np.float32)}])
