"""The indexing, normalization, math and bitwise ops of the transformer issue, against
onnxruntime, each inside a fused group (an elementwise producer feeds it, an elementwise
consumer follows it) so the ops compose with their neighbours as they do in real models.
onnx's own single-node cases for each op run in the conformance table as well."""
import math

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from modelkiln.orchestrator.api import build
from tests import model_zoo
from tests.conftest import shared_cache

F, I64 = TensorProto.FLOAT, TensorProto.INT64


def _check(nodes, inputs, feeds, outputs, inits=(), opset=21, rtol=1e-5, atol=1e-5, executor="inprocess",
           oracle="onnxruntime"):
    """Build the graph, run it on `feeds`, compare each output with onnxruntime's, or (oracle
    "reference") onnx's reference evaluator's, where onnxruntime lacks an opset or a case."""
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
                              [helper.make_tensor_value_info(n, t, None) for n, t in outputs],
                              [numpy_helper.from_array(v, n) for n, v in inits])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    got = build(model, executor=executor, cache=shared_cache(), progress=False).load().run(feeds)
    if oracle == "reference":
        from onnx.reference import ReferenceEvaluator
        want = dict(zip([n for n, _ in outputs], ReferenceEvaluator(model).run(None, feeds)))
    else:
        want = model_zoo.onnxruntime_outputs(model, feeds)
    for name, _ in outputs:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        if want[name].dtype.kind == "f":
            np.testing.assert_allclose(got[name], want[name], rtol=rtol, atol=atol, err_msg=name)
        else:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def _x(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _around(op_node, x_shape, out_type=F, extra_inputs=(), inits=(), opset=21, feeds=None, **kw):
    """x -> Abs-free scale (Mul by 2) -> op -> (Neg if float) : the op fused between neighbours."""
    nodes = [helper.make_node("Mul", ["x", "two"], ["x2"]), op_node]
    outs = [("y", out_type)]
    if out_type == F:
        nodes.append(helper.make_node("Neg", [op_node.output[0]], ["y"]))
    else:
        nodes[-1].output[0] = "y"
    feeds = {"x": _x(x_shape), **(feeds or {})}
    _check(nodes, [("x", F, list(x_shape))] + list(extra_inputs), feeds, outs,
           [("two", np.array(2, np.float32))] + list(inits), opset, **kw)


def test_gather_elements_and_gather_nd(executor):
    ind = np.random.default_rng(1).integers(-3, 3, (2, 3, 4)).astype(np.int64)
    _around(helper.make_node("GatherElements", ["x2", "ind"], ["g"], axis=1), (2, 3, 4),
            extra_inputs=[("ind", I64, [2, 3, 4])], feeds={"ind": ind}, executor=executor)
    nd = np.array([[[0, 1], [2, 0]], [[1, 2], [0, 3]]], np.int64)  # batch_dims=1 over [2, 3, 4, 5]
    _around(helper.make_node("GatherND", ["x2", "nd"], ["g"], batch_dims=1), (2, 3, 4, 5),
            extra_inputs=[("nd", I64, [2, 2, 2])], feeds={"nd": nd}, executor=executor)


@pytest.mark.parametrize("op,reduction", [("ScatterND", "none"), ("ScatterND", "add"), ("ScatterElements", "none"),
                                          ("ScatterElements", "max"), ("ScatterElements", "mul")])
def test_scatter(op, reduction, executor):
    if op == "ScatterND":
        ind = np.array([[1], [3], [1]] if reduction != "none" else [[1], [3]], np.int64)
        upd = _x((len(ind), 5), 2)
    else:
        ind = np.array([[1, 0, 2, 1, 0], [2, 2, 0, 1, 1]], np.int64) if reduction != "none" else \
            np.array([[1, 0, 2, 3, 0], [2, 3, 0, 1, 1]], np.int64)
        upd = _x((2, 5), 2)
    attrs = {"reduction": reduction} | ({"axis": 0} if op == "ScatterElements" else {})
    _around(helper.make_node(op, ["x2", "ind", "upd"], ["s"], **attrs), (4, 5), inits=[("ind", ind)],
            extra_inputs=[("upd", F, list(upd.shape))], feeds={"upd": upd}, opset=18, executor=executor)


def test_one_hot_trilu_tile(executor):
    _around(helper.make_node("Tile", ["x2", "reps"], ["t"]), (2, 3), inits=[("reps", np.array([2, 3], np.int64))],
            executor=executor)
    for upper, k in ((1, 0), (0, -1), (1, 2)):
        _around(helper.make_node("Trilu", ["x2", "k"], ["t"], upper=upper), (2, 4, 5),
                inits=[("k", np.array(k, np.int64))], executor=executor)
    ind = np.array([[0, 3, -1], [2, 9, 1]], np.int64)  # -1 is depth-1; 9 is out of range: all off
    _check([helper.make_node("OneHot", ["ind", "depth", "vals"], ["y"], axis=1)], [("ind", I64, [2, 3])],
           {"ind": ind}, [("y", F)], [("depth", np.array(5, np.int64)), ("vals", np.array([-1.0, 2.0], np.float32))])


@pytest.mark.parametrize("size,beta", [(5, 0.75), (3, 1.3), (1, 0.5)])
def test_lrn_between_neighbours(size, beta, executor):
    """LRN across channels, its edge channels' windows cut short; beta 0.75 as square roots,
    others as pow."""
    _around(helper.make_node("LRN", ["x2"], ["l"], size=size, alpha=0.3, beta=beta, bias=1.5), (2, 7, 3, 5),
            rtol=1e-4, executor=executor)


def _lrn_as_specified(x, size, alpha, beta, bias):
    """ONNX's LRN formula, channel by channel."""
    out = np.empty_like(x)
    for c in range(x.shape[1]):
        lo, hi = max(0, c - math.floor((size - 1) / 2)), min(x.shape[1] - 1, c + math.ceil((size - 1) / 2))
        out[:, c] = x[:, c] / (bias + alpha / size * (x[:, lo:hi + 1] ** 2).sum(axis=1)) ** beta
    return out


def test_lrn_of_an_even_size_reaches_one_more_channel_above(executor):
    """onnxruntime refuses even sizes, and onnx's reference evaluator (1.23) sums over the
    wrong axis (its loop runs over the batch): the formula itself is the oracle."""
    node = helper.make_node("LRN", ["x"], ["y"], size=4, alpha=0.3, beta=0.75, bias=1.5)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", F, [2, 7, 3, 5])],
                              [helper.make_tensor_value_info("y", F, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    x = _x((2, 7, 3, 5))
    got = build(model, executor=executor, cache=shared_cache(), progress=False).load().run({"x": x})["y"]
    np.testing.assert_allclose(got, _lrn_as_specified(x, 4, 0.3, 0.75, 1.5), rtol=1e-5, atol=1e-6)


def test_lrn_in_an_alexnet_block_and_folded(executor):
    """Conv -> Relu -> LRN -> MaxPool as AlexNet and GoogLeNet have it, and an LRN of a
    constant folded at build time."""
    from tests.conftest import build_and_compare
    g = model_zoo.GraphMaker(3)
    h = g.op("Relu", [g.conv("x", 3, 16, 3)])
    h = g.op("MaxPool", [g.op("LRN", [h], size=5, alpha=1e-2, beta=0.75, bias=2.0)], kernel_shape=[3, 3],
             strides=[2, 2])
    folded = g.op("LRN", [g.weight([1, 6, 2, 2], scale=3.0)], size=3, alpha=0.5, beta=0.75)
    build_and_compare(g.model({"x": [1, 3, 17, 17]}, [h, folded], name="alexnet_block"), executor)


def test_eye_like(executor):
    """EyeLike above, on and below the diagonal of a non-square matrix, of the input's type and
    of another, in a kernel (its input a graph input) and folded (a constant's)."""
    I32 = TensorProto.INT32
    nodes = [helper.make_node("EyeLike", ["x"], ["above"], k=2),
             helper.make_node("EyeLike", ["x"], ["below"], k=-1, dtype=I32),
             helper.make_node("EyeLike", ["k"], ["folded"])]
    _check(nodes, [("x", F, [4, 6])], {"x": _x((4, 6))}, [("above", F), ("below", I32), ("folded", F)],
           [("k", _x((5, 3)))], opset=22, executor=executor)


@pytest.mark.parametrize("p,attrs", [(2, {"kernel_shape": [3, 3], "pads": [1, 0, 1, 2]}),
                                     (3, {"kernel_shape": [2, 3], "strides": [2, 1], "dilations": [1, 2]}),
                                     (1, {"kernel_shape": [3, 2], "auto_pad": "SAME_UPPER", "strides": [2, 2]})])
def test_lp_pool(p, attrs, executor):
    """LpPool's p-norm over each window (taps in the padding count as zeros)."""
    _around(helper.make_node("LpPool", ["x2"], ["l"], p=p, **attrs), (2, 3, 7, 9), opset=18, rtol=1e-4,
            executor=executor)


def test_depth_space_round_trip(executor):
    for mode in ("DCR", "CRD"):
        _around(helper.make_node("DepthToSpace", ["x2"], ["d"], blocksize=2, mode=mode), (1, 8, 3, 4),
                executor=executor)
    _around(helper.make_node("SpaceToDepth", ["x2"], ["d"], blocksize=2), (2, 3, 4, 6), executor=executor)


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_space_to_depth_modes_of_opset_28(mode, executor):
    """SpaceToDepth's `mode` (opset 28), computed in a kernel (fused between neighbours) and
    folded on a constant, against onnx's reference evaluator (onnxruntime may lack opset 28)."""
    nodes = [helper.make_node("Mul", ["x", "two"], ["x2"]),
             helper.make_node("SpaceToDepth", ["x2"], ["d"], blocksize=2, mode=mode),
             helper.make_node("Neg", ["d"], ["y"]),
             helper.make_node("SpaceToDepth", ["k"], ["folded"], blocksize=3, mode=mode)]
    _check(nodes, [("x", F, [2, 3, 4, 6])], {"x": _x((2, 3, 4, 6))}, [("y", F), ("folded", F)],
           [("two", np.array(2, np.float32)), ("k", _x((1, 2, 3, 6), seed=1))], opset=28, executor=executor,
           oracle="reference")


@pytest.mark.parametrize("pads", [[0, 0, 1, 2, 0, 0, 2, 1],     # within the sizes
                                  [0, 1, 7, 3, 0, 0, 5, 9],     # past them: wrapping more than once
                                  [0, 0, -1, 2, 0, 0, 1, -2]])  # cropping on one side, wrapping on the other
def test_pad_wrap(pads, executor):
    """Pad's wrap mode (opset 19), fused between neighbours, against onnxruntime; onnx's
    reference evaluator (np.pad's wrap) agrees where it takes the pads (not negative ones)."""
    for oracle in ("onnxruntime", "reference") if min(pads) >= 0 else ("onnxruntime",):
        _around(helper.make_node("Pad", ["x2", "pads"], ["p"], mode="wrap"), (1, 2, 3, 4),
                inits=[("pads", np.array(pads, np.int64))], opset=19, executor=executor, oracle=oracle)


def test_pad_wrap_refuses_to_wrap_around_nothing():
    """An axis cropped to nothing and padded: onnxruntime refuses it too."""
    from modelkiln.ir.errors import KilnError
    with pytest.raises(KilnError, match=r"'cut'.*crops axis 3.*nothing to wrap around"):
        _around(helper.make_node("Pad", ["x2", "pads"], ["p"], mode="wrap", name="cut"), (1, 2, 3, 4),
                inits=[("pads", np.array([0, 0, 0, -4, 0, 0, 0, 2], np.int64))], opset=19)


@pytest.mark.parametrize("exclusive,reverse", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_cumsum(exclusive, reverse, executor):
    _around(helper.make_node("CumSum", ["x2", "axis"], ["c"], exclusive=exclusive, reverse=reverse), (3, 7),
            inits=[("axis", np.array(1, np.int64))], executor=executor)


@pytest.mark.parametrize("exclusive,reverse", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_cumprod(exclusive, reverse, executor):
    """CumProd (opset 26), in a kernel and folded on a constant, against onnx's reference
    evaluator (onnxruntime lacks opset 26); an exclusive product starts at 1."""
    nodes = [helper.make_node("Mul", ["x", "two"], ["x2"]),
             helper.make_node("CumProd", ["x2", "axis"], ["c"], exclusive=exclusive, reverse=reverse),
             helper.make_node("Neg", ["c"], ["y"]),
             helper.make_node("CumProd", ["k", "axis0"], ["folded"], exclusive=exclusive, reverse=reverse)]
    _check(nodes, [("x", F, [3, 7])], {"x": _x((3, 7))}, [("y", F), ("folded", F)],
           [("two", np.array(0.7, np.float32)), ("axis", np.array(1, np.int64)),
            ("axis0", np.array(0, np.int64)), ("k", _x((4, 3), seed=2))], opset=26, rtol=1e-5,
           executor=executor, oracle="reference")


@pytest.mark.parametrize("op,last,keep", [("ArgMax", 0, 1), ("ArgMin", 1, 0), ("ArgMax", 1, 0)])
def test_arg_reductions(op, last, keep, executor):
    x = np.round(_x((3, 8), 4))  # rounded: ties, where select_last_index matters
    _check([helper.make_node(op, ["x"], ["y"], axis=1, keepdims=keep, select_last_index=last)], [("x", F, [3, 8])],
           {"x": x}, [("y", I64)])


@pytest.mark.parametrize("largest,axis", [(1, -1), (0, -1), (1, 0)])
def test_topk(largest, axis, executor):
    x = np.round(_x((6, 9), 5) * 2)  # ties: equal values keep index order
    _check([helper.make_node("TopK", ["x", "k"], ["v", "i"], axis=axis, largest=largest)], [("x", F, [6, 9])],
           {"x": x}, [("v", F), ("i", I64)], [("k", np.array([4], np.int64))])


@pytest.mark.parametrize("op,attrs,extra", [
    ("InstanceNormalization", {"epsilon": 1e-4}, "cc"),
    ("GroupNormalization", {"num_groups": 2}, "cc"),
    ("LpNormalization", {"axis": 1, "p": 2}, ""), ("LpNormalization", {"axis": -1, "p": 1}, ""),
    ("MeanVarianceNormalization", {}, ""), ("LogSoftmax", {"axis": 1}, ""), ("Hardmax", {"axis": -1}, ""),
])
def test_normalizations(op, attrs, extra, executor):
    ins = ["x2"] + (["scale", "bias"] if extra else [])
    rng = np.random.default_rng(6)
    inits = [("scale", rng.random(4).astype(np.float32) + 0.5), ("bias", rng.standard_normal(4).astype(np.float32))]
    _around(helper.make_node(op, ins, ["n"], **attrs), (2, 4, 3, 5), inits=inits if extra else [], rtol=1e-4,
            atol=1e-5, executor=executor)


@pytest.mark.parametrize("op", ["Sin", "Cos", "Tan", "Atan", "Sinh", "Asinh", "Cosh"])
def test_trigonometry(op, executor):
    _around(helper.make_node(op, ["x2"], ["t"]), (4, 9), executor=executor)


@pytest.mark.parametrize("op", ["Asin", "Acos", "Atanh"])
def test_inverse_trigonometry_in_domain(op, executor):
    x = np.clip(_x((4, 9)), -0.45, 0.45)  # times two stays inside (-1, 1)
    _check([helper.make_node("Mul", ["x", "two"], ["x2"]), helper.make_node(op, ["x2"], ["y"])], [("x", F, [4, 9])],
           {"x": x}, [("y", F)], [("two", np.array(2, np.float32))])


@pytest.mark.parametrize("op", ["ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceLogSumExp",
                                "ReduceSumSquare", "ReduceLogSum"])
def test_reductions(op, executor):
    x = np.abs(_x((3, 4, 5), 7)) + 0.1 if op == "ReduceLogSum" else _x((3, 4, 5), 7)
    _check([helper.make_node(op, ["x", "axes"], ["r"], keepdims=0), helper.make_node("Neg", ["r"], ["y"])],
           [("x", F, [3, 4, 5])], {"x": x}, [("y", F)], [("axes", np.array([0, 2], np.int64))], opset=18,
           rtol=1e-5)


def test_sum_mean_swish_dropout_size(executor):
    a, b, c = _x((3, 4), 1), _x((1, 4), 2), _x((3, 1), 3)
    nodes = [helper.make_node("Sum", ["a", "b", "c"], ["s"]), helper.make_node("Mean", ["a", "b", "c"], ["m"]),
             helper.make_node("Dropout", ["s"], ["d", "mask"]), helper.make_node("Size", ["a"], ["n"]),
             helper.make_node("Cast", ["n"], ["nf"], to=F), helper.make_node("Add", ["d", "nf"], ["y"])]
    _check(nodes, [("a", F, [3, 4]), ("b", F, [1, 4]), ("c", F, [3, 1])], {"a": a, "b": b, "c": c},
           [("y", F), ("m", F), ("mask", TensorProto.BOOL)])


def test_swish_against_its_formula(executor):
    """Swish is opset 24, newer than onnxruntime here: numpy computes x * sigmoid(alpha x)."""
    x = _x((3, 11), 9) * 4
    graph = helper.make_graph([helper.make_node("Swish", ["x"], ["y"], alpha=0.7)], "g",
                              [helper.make_tensor_value_info("x", F, [3, 11])], [helper.make_tensor_value_info("y", F, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)], ir_version=11)
    got = build(model, executor=executor, cache=shared_cache(), progress=False).load().run({"x": x})["y"]
    np.testing.assert_allclose(got, x / (1 + np.exp(-0.7 * x)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [TensorProto.UINT8, TensorProto.UINT32, TensorProto.INT16, TensorProto.INT64])
def test_bitwise(dtype, executor):
    npt = helper.tensor_dtype_to_np_dtype(dtype)
    rng = np.random.default_rng(8)
    info = np.iinfo(npt)
    a = rng.integers(info.min, info.max, (2, 9), dtype=npt, endpoint=True)
    b = rng.integers(info.min, info.max, (2, 9), dtype=npt, endpoint=True)
    nodes = [helper.make_node("BitwiseAnd", ["a", "b"], ["t"]), helper.make_node("BitwiseXor", ["t", "a"], ["u"]),
             helper.make_node("BitwiseOr", ["u", "b"], ["v"]), helper.make_node("BitwiseNot", ["v"], ["y"])]
    _check(nodes, [("a", dtype, [2, 9]), ("b", dtype, [2, 9])], {"a": a, "b": b}, [("y", dtype)], opset=18)
    if dtype in (TensorProto.UINT8, TensorProto.UINT32):
        shift = rng.integers(0, 8 * npt.itemsize, (2, 9), dtype=npt)
        for direction in ("LEFT", "RIGHT"):
            _check([helper.make_node("BitShift", ["a", "s"], ["y"], direction=direction)],
                   [("a", dtype, [2, 9]), ("s", dtype, [2, 9])], {"a": a, "s": shift}, [("y", dtype)], opset=18)


@pytest.mark.parametrize("equation,shapes", [
    ("bhqd,bhkd->bhqk", [(1, 2, 5, 4), (1, 2, 6, 4)]),  # attention scores as T5 exports them
    ("...ij,...jk->...ik", [(2, 3, 4), (2, 4, 5)]),  # ellipsis batch dims
    ("ij,j", [(3, 4), (4,)]),  # implicit output
    ("ii->i", [(5, 5)]), ("ii", [(5, 5)]), ("bij->bji", [(2, 3, 4)]),
])
def test_einsum(equation, shapes, executor):
    names = [f"x{i}" for i in range(len(shapes))]
    feeds = {n: _x(s, i) for i, (n, s) in enumerate(zip(names, shapes))}
    _check([helper.make_node("Einsum", names, ["e"], equation=equation), helper.make_node("Neg", ["e"], ["y"])],
           [(n, F, list(s)) for n, s in zip(names, shapes)], feeds, [("y", F)], executor=executor)


def test_einsum_broadcasts_unit_dims(executor):
    """A batch dim of 1 against 3 broadcasts (numpy.einsum is the oracle: onnxruntime refuses)."""
    a, b = _x((2, 1, 3, 4), 1), _x((3, 4, 5), 2)
    graph = helper.make_graph([helper.make_node("Einsum", ["a", "b"], ["y"], equation="...ij,...jk->...ik")], "g",
                              [helper.make_tensor_value_info("a", F, [2, 1, 3, 4]),
                               helper.make_tensor_value_info("b", F, [3, 4, 5])],
                              [helper.make_tensor_value_info("y", F, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    got = build(model, executor=executor, cache=shared_cache(), progress=False).load().run({"a": a, "b": b})["y"]
    np.testing.assert_allclose(got, np.einsum("...ij,...jk->...ik", a, b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("causal", [0, 1])
def test_attention_from_its_function_body(causal, executor):
    """Attention (opset 23) is built from the body onnx defines for it; onnxruntime's own
    kernel is the oracle. Grouped heads (8 query heads over 2 key/value heads), a float mask."""
    q, k, v = _x((1, 8, 6, 16), 1), _x((1, 2, 7, 16), 2), _x((1, 2, 7, 16), 3)
    mask = (np.random.default_rng(4).random((6, 7)) < 0.2).astype(np.float32) * -1e4
    _check([helper.make_node("Attention", ["q", "k", "v", "mask"], ["y"], is_causal=causal)],
           [("q", F, [1, 8, 6, 16]), ("k", F, [1, 2, 7, 16]), ("v", F, [1, 2, 7, 16]), ("mask", F, [6, 7])],
           {"q": q, "k": k, "v": v, "mask": mask}, [("y", F)], opset=23, executor=executor)


def test_rotary_embedding_from_its_function_body(executor):
    x = _x((1, 4, 5, 8), 5)
    angles = np.arange(16)[:, None] * 10000.0 ** (-np.arange(4) / 4)
    pos = np.array([[3, 0, 7, 1, 2]], np.int64)
    _check([helper.make_node("RotaryEmbedding", ["x", "cos", "sin", "pos"], ["y"])], [("x", F, [1, 4, 5, 8])],
           {"x": x}, [("y", F)], [("cos", np.cos(angles).astype(np.float32)), ("sin", np.sin(angles).astype(np.float32)),
                                  ("pos", pos)], opset=23, executor=executor)


@pytest.mark.parametrize("reduction", [None, "sum", "none"])
def test_losses_from_their_function_bodies(reduction, executor):
    """SoftmaxCrossEntropyLoss (with its log-probabilities) and NegativeLogLikelihoodLoss with
    weights and an ignored index, against onnxruntime. Their bodies refer to the node's
    `reduction`: absent, it is the op's default (mean)."""
    I64 = TensorProto.INT64
    attrs = {"ignore_index": 2, **({"reduction": reduction} if reduction else {})}
    labels = np.array([[0, 2, 4], [1, 3, 2]], np.int64)
    nodes = [helper.make_node("SoftmaxCrossEntropyLoss", ["x", "labels", "w"], ["sce", "log_prob"], **attrs),
             helper.make_node("NegativeLogLikelihoodLoss", ["log_prob", "labels", "w"], ["nll"], **attrs)]
    _check(nodes, [("x", F, [2, 5, 3]), ("labels", I64, [2, 3])], {"x": _x((2, 5, 3), 6), "labels": labels},
           [("sce", F), ("log_prob", F), ("nll", F)], [("w", np.linspace(0.5, 1.5, 5).astype(np.float32))],
           opset=22, executor=executor)


def test_center_crop_pad_and_windows_from_their_function_bodies(executor):
    nodes = [helper.make_node("CenterCropPad", ["x", "shape"], ["y"], axes=[1, 2]),
             helper.make_node("HannWindow", ["n"], ["hann"], periodic=0),
             helper.make_node("HammingWindow", ["n"], ["hamming"]),
             helper.make_node("BlackmanWindow", ["n"], ["blackman"])]
    _check(nodes, [("x", F, [2, 5, 6])], {"x": _x((2, 5, 6), 7)},
           [("y", F), ("hann", F), ("hamming", F), ("blackman", F)],
           [("shape", np.array([3, 9], np.int64)), ("n", np.array(10, np.int64))], opset=18, executor=executor)


@pytest.mark.parametrize("attrs,roi", [
    ({"mode": "cubic"}, None), ({"mode": "cubic", "exclude_outside": 1, "cubic_coeff_a": -0.5}, None),
    ({"mode": "linear", "coordinate_transformation_mode": "tf_crop_and_resize", "extrapolation_value": 3.0},
     [0, 0, 0.2, -0.3, 1, 1, 0.9, 1.2]),
    ({"mode": "cubic", "coordinate_transformation_mode": "align_corners"}, None),
    ({"mode": "linear", "antialias": 1}, None), ({"mode": "cubic", "antialias": 1}, None),
])
def test_resize_cubic_and_crop(attrs, roi, executor):
    # Scales whose output lengths are whole (9 and 8): where scale * length is not, onnxruntime
    # uses the rounded length in align_corners and tf_crop_and_resize and the spec (and Kiln,
    # as onnx's own cases check) the unrounded one.
    inits = [("roi", np.array(roi or [], np.float32)), ("scales", np.array([1, 1, 1.5, 0.8], np.float32))]
    _around(helper.make_node("Resize", ["x2", "roi", "scales"], ["r"], **attrs), (1, 2, 6, 10), inits=inits,
            rtol=1e-4, atol=1e-5, executor=executor)


@pytest.mark.parametrize("attrs,scales", [
    ({"mode": "linear"}, [1, 1, 4, 4]),  # UNet's side path
    ({"mode": "linear", "coordinate_transformation_mode": "pytorch_half_pixel"}, [1, 1, 2, 3]),
    ({"mode": "linear", "coordinate_transformation_mode": "asymmetric"}, [1, 1, 1, 2]),
    ({"mode": "nearest"}, [1, 1, 2, 2]),
    ({"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}, [1, 1, 3, 3]),
    ({"mode": "linear", "coordinate_transformation_mode": "align_corners"}, [1, 1, 2, 2]),  # not periodic
])
def test_resize_alone_runs_each_phase_without_tables(attrs, scales, executor):
    """A Resize alone in its group that enlarges its last axis a whole number of times runs
    one contiguous run per phase of that axis (resize_by_phases); values as onnxruntime's."""
    from modelkiln.ir.loop import For, Store
    x = _x((1, 3, 9, 11), 7)
    graph = helper.make_graph([helper.make_node("Resize", ["x", "", "scales"], ["y"], **attrs)], "g",
                              [helper.make_tensor_value_info("x", F, list(x.shape))],
                              [helper.make_tensor_value_info("y", F, None)],
                              [numpy_helper.from_array(np.array(scales, np.float32), "scales")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=10)
    result = build(model, executor=executor, cache=None, progress=False)
    np.testing.assert_allclose(result.load().run({"x": x})["y"], model_zoo.onnxruntime_outputs(model, {"x": x})["y"],
                               rtol=1e-5, atol=1e-6)
    stack, phased = list(result.lowered.calls[0].kernel.body), False
    while stack:
        s = stack.pop()
        if isinstance(s, For):
            phased |= sum(isinstance(t, Store) for t in s.body) == scales[-1]
            stack.extend(s.body)
    assert phased == (attrs.get("coordinate_transformation_mode") != "align_corners")
