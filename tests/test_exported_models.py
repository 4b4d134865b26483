"""Graphs that real exporters wrote and the zoo lacked: each case is the smallest model with
the pattern of an architecture (timm, torchvision, transformers, exported by torch.onnx)
that Kiln refused, got wrong or ran far slower than onnxruntime. onnxruntime, numpy or
onnx's reference evaluator is the oracle."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from modelkiln.ir.passes import infer_types, trim_conv_windows
from modelkiln.orchestrator.api import build
from tests.conftest import build_and_compare, shared_cache
from tests.model_zoo import GraphMaker
from tests.test_passes import ops, run_passes

F = TensorProto.FLOAT


def test_residual_batchnorm_read_in_the_conv_epilogue(executor):
    """RepVGG / FastViT: relu(conv3x3(x) + conv1x1(x) + bn(x)). The identity branch's
    BatchNorm has no conv to fold into; it is computed inside the 3x3 conv's kernel, at the
    epilogue's (batch, channel, pixel) points (the build had failed with an IndexError)."""
    g = GraphMaker(11)
    three, one = g.conv("x", 16, 16, 3), g.conv("x", 16, 16, 1)
    y = g.op("Relu", [g.op("Add", [g.op("Add", [three, one]), g.bn("x", 16)])])
    build_and_compare(g.model({"x": [1, 16, 14, 14]}, [y]), executor)


def test_channel_slice_of_a_concat_read_in_the_conv_epilogue(executor):
    """GhostNet: a ghost module's output (Concat of a conv and a depthwise conv of it, sliced
    to the block's channels) added to the shortcut conv. The Concat and Slice are inlined into
    the shortcut conv's epilogue; they used to index its collapsed (channel, pixel) points as
    (channel, row, column) and read the wrong elements, silently (2.9e-3 off on GhostNet)."""
    g = GraphMaker(12)
    primary = g.conv("x", 8, 6, 1)
    cheap = g.conv(primary, 6, 6, 3, group=6)
    ghost = g.op("Slice", [g.op("Concat", [primary, cheap], axis=1), g.const(np.array([0], np.int64)),
                           g.const(np.array([10], np.int64)), g.const(np.array([1], np.int64))])
    shortcut = g.conv("x", 8, 10, 1)
    y = g.op("Add", [ghost, shortcut])
    build_and_compare(g.model({"x": [1, 8, 12, 12]}, [y]), executor)


def _batchnorm_training_model(shape, outputs: int, momentum=0.9):
    rng = np.random.default_rng(5)
    c = shape[1]
    inits = [numpy_helper.from_array(v.astype(np.float32), n) for v, n in (
        (rng.random(c) + 0.5, "scale"), (rng.standard_normal(c), "bias"),
        (rng.standard_normal(c), "mean"), (rng.random(c) + 0.5, "var"))]
    names = ["y", "running_mean", "running_var"][:outputs]
    node = helper.make_node("BatchNormalization", ["x", "scale", "bias", "mean", "var"], names,
                            training_mode=1, epsilon=1e-3, momentum=momentum)
    graph = helper.make_graph([node], "bn_training", [helper.make_tensor_value_info("x", F, shape)],
                              [helper.make_tensor_value_info(n, F, None) for n in names], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)], ir_version=8)


@pytest.mark.parametrize("shape,outputs", [([4, 3, 5, 5], 3), ([2, 6, 7], 1), ([8, 5], 3)])
def test_batchnorm_in_training_mode(shape, outputs, executor):
    """training_mode=1 normalizes with the batch's own statistics and outputs the running ones
    updated; onnx's reference evaluator is the oracle."""
    model = _batchnorm_training_model(shape, outputs)
    x = (np.random.default_rng(6).standard_normal(shape) * 3 + 1).astype(np.float32)
    got = build(model, executor=executor, cache=shared_cache(), progress=False).load().run({"x": x})
    want = ReferenceEvaluator(model).run(None, {"x": x})
    for name, w in zip(["y", "running_mean", "running_var"], want):
        np.testing.assert_allclose(got[name], w, rtol=1e-4, atol=1e-5, err_msg=name)


def test_weight_standardized_conv(executor):
    """timm's NFNets standardize each conv's weights with a BatchNormalization in training
    mode over the weights themselves (as exported): a constant, folded at build time."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal((12, 6, 3, 3)).astype(np.float32)
    gain = (rng.random(12) + 0.5).astype(np.float32)
    inits = [numpy_helper.from_array(w.reshape(1, 12, -1), "w_rows"), numpy_helper.from_array(gain, "gain"),
             numpy_helper.from_array(np.zeros(12, np.float32), "zeros"),
             numpy_helper.from_array(np.ones(12, np.float32), "ones"),
             numpy_helper.from_array(np.array(w.shape, np.int64), "w_shape")]
    nodes = [helper.make_node("BatchNormalization", ["w_rows", "gain", "zeros", "zeros", "ones"], ["w_std"],
                              training_mode=1, epsilon=1e-5, momentum=0.0),
             helper.make_node("Reshape", ["w_std", "w_shape"], ["w"]),
             helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])]
    graph = helper.make_graph(nodes, "ws_conv", [helper.make_tensor_value_info("x", F, [1, 6, 10, 10])],
                              [helper.make_tensor_value_info("y", F, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)], ir_version=8)
    assert "BatchNormalization" not in ops(run_passes(model))  # (folded: its input is a constant)
    x = np.random.default_rng(8).standard_normal((1, 6, 10, 10)).astype(np.float32)
    got = build(model, executor=executor, cache=shared_cache(), progress=False).load().run({"x": x})["y"]
    np.testing.assert_allclose(got, ReferenceEvaluator(model).run(None, {"x": x})[0], rtol=1e-4, atol=1e-4)


def _einsum_model(equation, shapes, constant_b: bool):
    rng = np.random.default_rng(9)
    b = rng.standard_normal(shapes[1]).astype(np.float32)
    inputs = [helper.make_tensor_value_info("a", F, shapes[0])]
    inits = [numpy_helper.from_array(b, "b")] if constant_b else []
    if not constant_b:
        inputs.append(helper.make_tensor_value_info("b", F, shapes[1]))
    graph = helper.make_graph([helper.make_node("Einsum", ["a", "b"], ["y"], equation=equation)], "einsum", inputs,
                              [helper.make_tensor_value_info("y", F, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), b


@pytest.mark.parametrize("equation,shapes,constant_b", [
    ("ibh,hnd->ibnd", [(64, 1, 32), (32, 4, 8)], True),  # XLNet's projections
    ("ibnd,jbnd->bnij", [(9, 1, 4, 8), (11, 1, 4, 8)], False),  # its attention scores
    ("bnij,jbnd->ibnd", [(1, 4, 9, 11), (11, 1, 4, 8)], False),  # and their product with the values
    ("ibnd,hnd->ibh", [(9, 2, 4, 8), (32, 4, 8)], True),  # its output projection
    ("bij,bjk->bik", [(3, 5, 6), (1, 6, 7)], False),  # a batch dim of 1 broadcast
    ("abc,cd->d", [(2, 3, 5), (5, 4)], True),  # letters only A has, summed out first
    ("i,j->ij", [(6,), (7,)], False),  # an outer product: K = 1
])
def test_einsum_products_run_as_matmul(equation, shapes, constant_b, executor):
    """A product of two operands is a batched MatMul between transposes and reshapes (the
    loop nest it was took 2.6 ms for XLNet's projections, the MatMul 0.03)."""
    model, b = _einsum_model(equation, shapes, constant_b)
    graph_ops = ops(run_passes(model))
    assert "Einsum" not in graph_ops and "MatMul" in graph_ops, graph_ops
    a = np.random.default_rng(10).standard_normal(shapes[0]).astype(np.float32)
    feeds = {"a": a} if constant_b else {"a": a, "b": b}
    got = build(model, executor=executor, cache=shared_cache(), progress=False).load().run(feeds)["y"]
    np.testing.assert_allclose(got, np.einsum(equation, a, b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("a_shape,extra", [
    ([64, 1, 48], None),  # XLNet's [seq, batch, d]: 64 rows, not 64 products of a row
    ([2, 3, 5, 48], [3, 1, 40]),  # an epilogue tensor the leading dims cannot merge over
    ([4, 7, 48], [7, 40]),
])
@pytest.mark.parametrize("constant_b", [True, False])
def test_matmul_of_leading_dims_by_a_matrix(a_shape, extra, constant_b, executor):
    """[..., K] x [K, N] is one GEMM over the product of the leading dims, the rows; its
    epilogue (a bias, GELU, a residual of another shape) at each row's (leading dims, column)."""
    g = GraphMaker(13)
    w = g.weight((48, 40)) if constant_b else "w"
    y = g.op("Add", [g.op("MatMul", ["x", w]), g.const(np.linspace(-1, 1, 40, dtype=np.float32))])
    y = g.op("Mul", [y, g.op("Sigmoid", [g.op("Mul", [y, g.const(np.array(1.702, np.float32))])])])
    if extra is not None:
        y = g.op("Add", [y, g.weight(tuple(extra), scale=1.0)])
    inputs = {"x": a_shape, **({} if constant_b else {"w": [48, 40]})}
    build_and_compare(g.model(inputs, [y]), executor)


NINE_BLOCKS = sorted([h, w] for h in (2, 1, 2) for w in (2, 1, 2))  # (taps read by the top, middle, bottom rows)


@pytest.mark.parametrize("dilation,stride,pads,map_size,kernels_after", [
    (24, 1, [24] * 4, [16, 16], [[1, 1]]), (36, 1, [36] * 4, [16, 16], [[1, 1]]),  # DeepLabV3's, on a 16x16 map
    (12, 1, [12] * 4, [16, 16], NINE_BLOCKS),  # its third: 9 blocks of outputs, a quarter of the work
    (6, 2, [6] * 4, [9, 9], NINE_BLOCKS),  # the same at stride 2
    (6, 1, [6] * 4, [4, 24], [[1, 3]]),  # rows trimmed; the columns' windows differ, too little to split
    (5, 1, [5, 0, 0, 5], [6, 9], [[2, 2]]),  # one side of each window, pads unequal
])
def test_conv_taps_that_read_only_padding_are_dropped(dilation, stride, pads, map_size, kernels_after, executor):
    """DeepLabV3's atrous convs: a 3x3 window dilated past the map reads only zeros with its
    outer taps; the conv keeps the taps that read the input (its pads shrink with it), or,
    where different stretches of outputs read with different taps and keeping them all would
    double the work, becomes one unpadded conv per block of outputs over the input slice it
    reads, concatenated. Its outputs stay onnxruntime's."""
    g = GraphMaker(14)
    w = g.weight((12, 10, 3, 3))
    y = g.op("Relu", [g.op("Conv", ["x", w, g.const(np.linspace(-1, 1, 12, dtype=np.float32))],
                           kernel_shape=[3, 3], dilations=[dilation, dilation], strides=[stride, stride], pads=pads)])
    model = g.model({"x": [1, 10] + map_size}, [y])
    convs = [n for n in run_passes(model, trim_conv_windows, infer_types).nodes if n.op == "Conv"]
    assert sorted(list(n.attrs["kernel_shape"]) for n in convs) == kernels_after
    build_and_compare(model, executor)


def test_conv_split_along_one_axis_joins_only_that_axis(executor):
    """A 1x3 window dilated along W alone splits into 3 blocks along W, joined by one Concat
    (the single run along H adds no Concat of one input)."""
    g = GraphMaker(15)
    y = g.op("Conv", ["x", g.weight((6, 4, 1, 3)), g.const(np.linspace(-1, 1, 6, dtype=np.float32))],
             kernel_shape=[1, 3], dilations=[1, 12], pads=[0, 12, 0, 12])
    model = g.model({"x": [1, 4, 5, 16]}, [y])
    graph = run_passes(model, trim_conv_windows, infer_types)
    assert sorted(list(n.attrs["kernel_shape"]) for n in graph.nodes if n.op == "Conv") == [[1, 1], [1, 2], [1, 2]]
    assert ops(graph).count("Concat") == 1
    build_and_compare(model, executor)


def _mix_ffn(tail: str = "gelu", conv_also_read: bool = False):
    """SegFormer's Mix-FFN around its depthwise conv: Conv -> Reshape -> Transpose to tokens,
    then GELU as torch.onnx writes it (x * 0.5 * (1 + erf(x / sqrt 2))), then a linear. With
    `tail` "mul_tensor" a Mul by another token-major tensor instead of the GELU;
    `conv_also_read`: the conv's output is a graph output too."""
    g = GraphMaker(16)
    conv = g.conv("x", 32, 32, 3, group=32)
    tokens = g.op("Transpose", [g.op("Reshape", [conv, g.const(np.array([1, 32, 96]))])], perm=[0, 2, 1])
    if tail == "gelu":
        erf = g.op("Erf", [g.op("Div", [tokens, g.const(np.float32(np.sqrt(2)))])])
        act = g.op("Mul", [g.op("Mul", [tokens, g.op("Add", [erf, g.const(np.float32(1))])]),
                           g.const(np.float32(0.5))])
    else:
        act = g.op("Mul", [tokens, "other"])
    y = g.op("MatMul", [act, g.weight((32, 16))])
    inputs = {"x": [1, 32, 8, 12], **({"other": [1, 96, 32]} if tail != "gelu" else {})}
    return g.model(inputs, [y] + ([conv] if conv_also_read else []))


@pytest.mark.parametrize("tail,conv_also_read,moved", [("gelu", False, True), ("gelu", True, False),
                                                        ("mul_tensor", False, False)])
def test_elementwise_math_after_a_transpose_runs_in_the_conv_epilogue(tail, conv_also_read, moved, executor):
    """SegFormer's GELU read its input through the transpose from the conv's channel planes to
    tokens, a gather per element: elementwise math with scalar operands now runs before the
    Reshape and Transpose, in the conv's epilogue, and the layout change follows as a copy of
    its own. Not where the conv's output is read elsewhere (the math would not fuse there) or
    where the math reads another tensor laid out as tokens. Matches onnxruntime."""
    model = _mix_ffn(tail, conv_also_read)
    result, _ = build_and_compare(model, executor)
    conv_group = next(c.ops for c in result.lowered.calls if "Conv" in c.ops)
    assert ("Erf" in conv_group or "Mul" in conv_group) == moved
    if moved:
        assert ["Reshape", "Transpose"] in [c.ops for c in result.lowered.calls]


@pytest.mark.parametrize("reader", ["LayerNormalization", "Add"])
@pytest.mark.parametrize("tokens", [96, 8])
def test_a_transpose_of_whole_blocks_runs_alone(reader, tokens, executor):
    """A Transpose across the last axis by at least a 16 x 16 block each way (SegFormer's and
    EdgeNeXt's channel planes to tokens) is a kernel of its own, transposed by blocks, and what
    reads it reads a contiguous buffer: fused, a LayerNorm over the transposed tokens read each
    element a plane apart (0.73 ms for SegFormer's first). A smaller one (8 tokens) stays
    fused. Matches onnxruntime."""
    g = GraphMaker(17)
    conv = g.conv("x", 32, 32, 3)
    t = g.op("Transpose", [g.op("Reshape", [conv, g.const(np.array([1, 32, tokens]))])], perm=[0, 2, 1])
    if reader == "LayerNormalization":
        y = g.op(reader, [t, g.const(np.linspace(0.5, 1.5, 32, dtype=np.float32)), g.const(np.zeros(32, np.float32))],
                 axis=-1)
    else:  # (a residual: elementwise math with a scalar would move before the transpose)
        y = g.op(reader, [t, "other"])
    model = g.model({"x": [1, 32, tokens // 8 if tokens > 8 else 2, 8 if tokens > 8 else 4],
                     **({"other": [1, tokens, 32]} if reader == "Add" else {})}, [y])
    result, _ = build_and_compare(model, executor)
    groups = [c.ops for c in result.lowered.calls]
    alone = ["Reshape", "Transpose"] in groups
    assert alone == (tokens >= 16), groups


def test_math_moved_before_a_layout_change_keeps_its_rank(executor):
    """A constant of higher rank than the chain's input (a [1, 1, 1] scale after an Unsqueeze
    of a MatMul's [96, 32]) would broadcast that input up a rank where the math moved to, and
    the Transpose after it would meet a rank it does not permute: such math stays where it is.
    Matches onnxruntime."""
    g = GraphMaker(18)
    t = g.op("Transpose", [g.op("Unsqueeze", [g.op("MatMul", ["x", g.weight((32, 32))]), g.const(np.array([0]))])],
             perm=[0, 2, 1])
    y = g.op("Mul", [t, g.const(np.full((1, 1, 1), 0.5, np.float32))])
    result, _ = build_and_compare(g.model({"x": [96, 32]}, [y]), executor)
    assert not any("MatMul" in c.ops and "Mul" in c.ops for c in result.lowered.calls)
