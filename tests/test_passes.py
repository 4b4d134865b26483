"""Each graph pass: the graph it produces, and the model's outputs unchanged (onnxruntime)."""
import numpy as np
import pytest

from modelkiln.ir.frontend_onnx import from_onnx
from modelkiln.ir.graph import Node
from modelkiln.ir.passes import (default_pipeline, eliminate_common_subexpr, eliminate_dead_code, fold_constants, groups_of,
                       infer_types, simplify_inference)
from modelkiln.ir.transform import DumpIR, PassContext, PassTimingInstrument, Sequential, graph_pass
from tests import model_zoo
from tests.conftest import build_and_compare
from tests.model_zoo import GraphMaker


def ops(g):
    return [n.op for n in g.nodes]


def run_passes(model, *passes, ctx=None):
    g = from_onnx(model)
    return Sequential([infer_types, *passes])(g, ctx or PassContext(opt_level=3))


def test_fold_constants_evaluates_constant_subgraphs(executor):
    g = GraphMaker(0)
    c = g.op("Mul", [g.const(np.full(4, 2, np.float32)), g.const(np.full(4, 3, np.float32))])  # weights math
    y = g.op("Add", ["x", g.op("Transpose", [g.const(np.arange(8, dtype=np.float32).reshape(2, 4))], perm=[1, 0])])
    y = g.op("Mul", [g.op("ReduceSum", [y, g.const(np.array([1], np.int64))], keepdims=0), c])
    model = g.model({"x": [4, 2]}, [y])
    out = run_passes(model, fold_constants)
    assert ops(out) == ["Add", "ReduceSum", "Mul"]  # Transpose and the constant Mul are gone
    build_and_compare(model, executor)


def test_infer_types_folds_shape_chains():
    out = run_passes(model_zoo.pytorch_reshape_chain())
    assert ops(out) == ["Conv", "Relu", "Reshape", "Gemm", "Identity"]
    assert out.types[out.nodes[2].outputs[0]].shape == (2, 8 * 16 * 16)


def test_simplify_inference_folds_batchnorm_into_conv(executor):
    model = model_zoo.cnn()
    out = run_passes(model, fold_constants, simplify_inference)
    assert "BatchNormalization" not in ops(out)
    conv = [n for n in out.nodes if n.op == "Conv"]
    assert all(len(n.inputs) == 3 and n.inputs[2] in out.constants for n in conv)
    build_and_compare(model, executor)


def test_batchnorm_without_conv_becomes_scale_and_shift(executor):
    g = GraphMaker(1)
    y = g.bn(g.op("Relu", ["x"]), 3)
    model = g.model({"x": [2, 3, 5, 5]}, [y])
    out = run_passes(model, simplify_inference)
    assert ops(out) == ["Relu", "Mul", "Add"]
    build_and_compare(model, executor)


def test_batchnorm_folds_into_gemm(executor):
    g = GraphMaker(2)
    y = g.op("Gemm", ["x", g.weight((8, 16)), g.const(np.ones(8, np.float32))], transB=1)
    y = g.op("BatchNormalization", [y] + [g.const(v) for v in (np.full(8, 1.5, np.float32), np.full(8, .1, np.float32),
                                                                 np.full(8, .2, np.float32), np.full(8, 2, np.float32))])
    model = g.model({"x": [4, 16]}, [y])
    assert ops(run_passes(model, simplify_inference)) == ["Gemm"]
    build_and_compare(model, executor)


def test_common_subexpressions_merge(executor):
    g = GraphMaker(3)
    a, b = g.op("Relu", ["x"]), g.op("Relu", ["x"])
    y = g.op("Add", [g.op("Mul", [a, g.const(np.float32(2))]), g.op("Mul", [b, g.const(np.float32(2))])])
    model = g.model({"x": [3, 4]}, [y])
    out = run_passes(model, eliminate_common_subexpr, eliminate_dead_code)
    assert ops(out) == ["Relu", "Mul", "Add"]
    assert out.nodes[2].inputs[0] == out.nodes[2].inputs[1]
    build_and_compare(model, executor)


def test_dead_code_is_removed(executor):
    g = GraphMaker(4)
    g.op("Exp", [g.op("Sigmoid", ["x"])])  # computed, never used
    y = g.op("Tanh", ["x"])
    model = g.model({"x": [3, 4]}, [y])
    out = run_passes(model, eliminate_dead_code)
    assert ops(out) == ["Tanh"]
    build_and_compare(model, executor)


def test_fuse_ops_groups_by_pattern_kind(executor):
    model = model_zoo.resnet18()
    g = default_pipeline()(from_onnx(model), PassContext(opt_level=3))
    groups = [[n.op for n in members] for members in groups_of(g)]
    assert ["Conv", "Relu"] in groups and ["Conv", "Add", "Relu"] in groups
    assert ["Flatten"] in groups  # views stay alone: they become aliases
    assert ["GlobalAveragePool"] in groups and ["MaxPool"] in groups


def test_elementwise_chains_fuse_into_one_kernel(executor):
    g = GraphMaker(5)
    y = g.op("Sigmoid", [g.op("Mul", [g.op("Add", ["x", g.const(np.ones((1, 4), np.float32))]),
                                      g.const(np.float32(3))])])
    y = g.op("Transpose", [y], perm=[1, 0])
    model = g.model({"x": [3, 4]}, [y])
    result, _ = build_and_compare(model, executor)
    assert [k["ops"] for k in result.report["kernels"]] == [["Add", "Mul", "Sigmoid", "Transpose"]]


def test_softmax_absorbs_its_producer_and_epilogue(executor):
    g = GraphMaker(6)
    y = g.op("Mul", [g.op("Softmax", [g.op("Div", ["x", g.const(np.float32(4))])], axis=-1), g.const(np.float32(2))])
    model = g.model({"x": [2, 3, 16]}, [y])
    result, _ = build_and_compare(model, executor)
    assert [k["ops"] for k in result.report["kernels"]] == [["Div", "Softmax", "Mul"]]


@pytest.mark.parametrize("opt_level", [0, 1, 2, 3])
def test_opt_levels_all_give_the_same_outputs(opt_level, executor):
    result, _ = build_and_compare(model_zoo.cnn(), executor, pass_context=PassContext(opt_level=opt_level))
    kernels = result.report["totals"]["kernel_calls"]
    if opt_level == 0:  # no folding, no fusion: BatchNorm runs as its own kernel
        assert any("BatchNormalization" in k["ops"] for k in result.report["kernels"])
    else:
        assert kernels <= 6


def test_disabled_pass_is_skipped(executor):
    ctx = PassContext(opt_level=3, disabled_pass=["fuse_ops", "simplify_inference"])
    result, _ = build_and_compare(model_zoo.cnn(), executor, pass_context=ctx)
    assert all(len(k["ops"]) == 1 for k in result.report["kernels"])
    assert "fuse_ops" not in [p["name"] for p in result.report["passes"]]


def test_custom_pass_by_decorator(executor):
    seen = []

    @graph_pass(opt_level=1, name="relu_to_clip")
    def relu_to_clip(g, ctx):
        # An ordinary ONNX-style node and a constant: nothing Kiln-internal to fill in.
        zero = g.add_constant(g.fresh_name("zero"), np.array(0.0, np.float32))
        nodes = []
        for n in g.nodes:
            if n.op == "Relu":
                n = Node("Clip", [n.inputs[0], zero], list(n.outputs), {}, f"{n.name}_as_clip")
                seen.append(n.name)
            nodes.append(n)
        g.nodes = nodes
        return g

    result, _ = build_and_compare(model_zoo.cnn(), executor, extra_passes=[relu_to_clip])
    assert seen and "relu_to_clip" in [p["name"] for p in result.report["passes"]]
    assert not any("Relu" in k["ops"] for k in result.report["kernels"])


def test_instruments_time_and_dump(tmp_path):
    timing = PassTimingInstrument()
    ctx = PassContext(opt_level=3, instruments=[timing, DumpIR(str(tmp_path))])
    with ctx:
        default_pipeline()(from_onnx(model_zoo.cnn()))
    names = [n for n, _ in timing.timings]
    assert names[:14] == ["infer_types", "integer_products", "weight_only_blocks", "quantized_moves", "fold_constants",
                          "widen_half_products", "simplify_inference", "trim_conv_windows", "elementwise_before_layout",
                          "eliminate_common_subexpr", "eliminate_dead_code", "infer_types",
                          "bind_kv_caches", "fuse_ops"]
    dumps = sorted(p.name for p in tmp_path.iterdir())
    assert dumps[0] == "00_infer_types.txt" and dumps[-1] == "13_fuse_ops.txt"
    assert "BatchNormalization" in (tmp_path / "04_fold_constants.txt").read_text()
    assert "BatchNormalization" not in (tmp_path / "06_simplify_inference.txt").read_text()


def test_lowering_leaves_the_graph_it_reads_as_it_was():
    """Lowering packs weights and plans kernels into what it returns, never into the graph."""
    from modelkiln.ir.lower import ScheduleConfig, lower
    from modelkiln.orchestrator.api import optimize
    g, _ = optimize(model_zoo.resnet18(size=64))

    def snapshot():
        return (sorted(g.constants), dict(g.types), dict(g.params), [list(grp) for grp in g.groups],
                [(n.op, list(n.inputs), list(n.outputs), repr(sorted(n.attrs.items()))) for n in g.nodes])
    before = snapshot()
    lowered = lower(g, ScheduleConfig())
    assert snapshot() == before
    assert not hasattr(lowered, "graph")
    packed = set(lowered.constants) - set(g.constants)
    assert packed and all(any(c in call.inputs for call in lowered.calls) for c in packed)
