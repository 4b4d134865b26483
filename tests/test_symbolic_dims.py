"""Symbolic dims (issue 23): one build serves every size within the bounds the user gives.

Each model is built once with symbols and run at many shapes (odd sizes, the bounds, zero
where the bound allows it) against onnxruntime on the same inputs. Bad calls (a size out of
bounds, two inputs disagreeing on a symbol, a wrong rank or fixed dim) are refused by name
before anything runs; ops not yet taught symbols are refused by name at build time.
"""
import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from modelkiln.artifacts.errors import KilnError
from modelkiln.ir.graph import UnsupportedError
from modelkiln.orchestrator.api import build
from tests import dynamic_zoo, model_zoo
from tests.conftest import copies_rows_as_it_goes, kernel_statements, shared_cache
from tests.int8_reference import reference_outputs
from tests.isa import X86_TARGETS, run_or_inspect

F = TensorProto.FLOAT


def _weights(rng, *shape, scale=0.1):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def feed_forward_block(hidden=64, inner=96, seed=0, mask=False) -> onnx.ModelProto:
    """A transformer block's second half over x [batch, seq, hidden]: MatMul, bias, Relu,
    MatMul, bias, the residual, LayerNorm, then Softmax over the hidden units; with `mask`,
    a second input [batch, seq, 1] multiplies the result (the two share both symbols)."""
    rng = np.random.default_rng(seed)
    inits = {"w1": _weights(rng, hidden, inner), "b1": _weights(rng, inner), "w2": _weights(rng, inner, hidden),
             "b2": _weights(rng, hidden), "gamma": 1 + _weights(rng, hidden), "beta": _weights(rng, hidden)}
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Add", ["h", "b1"], ["hb"]),
             helper.make_node("Relu", ["hb"], ["r"]), helper.make_node("MatMul", ["r", "w2"], ["o"]),
             helper.make_node("Add", ["o", "b2"], ["ob"]), helper.make_node("Add", ["ob", "x"], ["res"]),
             helper.make_node("LayerNormalization", ["res", "gamma", "beta"], ["ln"], axis=-1, epsilon=1e-5),
             helper.make_node("Softmax", ["ln"], ["y" if not mask else "sm"], axis=-1)]
    inputs = [helper.make_tensor_value_info("x", F, ["batch", "seq", hidden])]
    if mask:
        nodes.append(helper.make_node("Mul", ["sm", "m"], ["y"]))
        inputs.append(helper.make_tensor_value_info("m", F, ["batch", "seq", 1]))
    graph = helper.make_graph(nodes, "block", inputs, [helper.make_tensor_value_info("y", F, ["batch", "seq", hidden])],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


BOUNDS = {"batch": (1, 4), "seq": (0, 80)}


@pytest.fixture(scope="module")
def block_build(executor):
    model = feed_forward_block(mask=True)
    return model, build(model, dims=BOUNDS, executor=executor, cache=None, progress=False)


@pytest.mark.parametrize("batch,seq", [(1, 1), (1, 17), (2, 16), (3, 33), (4, 80), (1, 79), (2, 0)])
def test_one_build_runs_every_shape_in_its_bounds(block_build, batch, seq):
    model, result = block_build
    rng = np.random.default_rng(batch * 100 + seq)
    feeds = {"x": rng.standard_normal((batch, seq, 64)).astype(np.float32),
             "m": (rng.random((batch, seq, 1)) > 0.3).astype(np.float32)}
    got = result.load().run(feeds)["y"]
    want = model_zoo.onnxruntime_outputs(model, feeds)["y"]
    assert got.shape == want.shape == (batch, seq, 64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fmt, ops", [("dynamic", {"DynamicQuantizeLinear", "MatMulInteger"}),
                                       ("qdq", {"QuantizeLinear", "DequantizeLinear"}),
                                       ("qoperator", {"QLinearMatMul", "QLinearAdd", "QLinearSoftmax"})])
def test_a_quantized_block_over_run_time_sizes(fmt, ops, executor):
    """The block quantized by onnxruntime's tool in each of its formats, built once for every
    batch and sequence length: its int8 GEMMs over run-time rows, against onnx's reference
    evaluator (exact integers; onnxruntime's are not on every CPU: tests/int8_reference.py)."""
    model = model_zoo.quantized(feed_forward_block(), fmt, symbols={"batch": 2, "seq": 9})
    assert ops <= {n.op_type for n in model.graph.node}
    module = build(model, dims=BOUNDS, executor=executor, cache=shared_cache(), progress=False).load()
    for batch, seq in [(1, 1), (2, 7), (3, 33), (4, 80)]:
        x = np.random.default_rng(seq).standard_normal((batch, seq, 64)).astype(np.float32)
        got, want = module.run({"x": x})["y"], reference_outputs(model, {"x": x})["y"]
        assert got.shape == want.shape == (batch, seq, 64)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5, err_msg=f"batch {batch}, seq {seq}")


def _quantized_cnn(fmt: str, symbols: dict) -> onnx.ModelProto:
    """model_zoo's residual CNN with the dims of its input named by `symbols` (index -> name),
    quantized by onnxruntime's tool in format `fmt`, calibrated at 1 x 3 x 32 x 32."""
    float_model = model_zoo.residual_cnn()
    dims = float_model.graph.input[0].type.tensor_type.shape.dim
    for i, name in symbols.items():
        dims[i].dim_param = name
    return model_zoo.quantized(float_model, fmt, symbols={"n": 1, "h": 32, "w": 32})


@pytest.mark.parametrize("fmt", ["dynamic", "qdq", "qoperator"])
def test_a_quantized_cnn_over_a_run_time_batch(fmt, executor):
    """Int8 convs (3x3 channels-last, 1x1, strided) and the classifier over a run-time batch,
    against onnx's reference evaluator: within float32 rounding where the output is float,
    one step of the output's scale where it is requantized (the reference requantizes in
    float64: a value within float32's error of a half step rounds either way)."""
    from tests.test_quantized import _output_step
    model = _quantized_cnn(fmt, {0: "n"})
    step = 1e-5 if fmt == "dynamic" else _output_step(model) * 1.001
    module = build(model, dims={"n": (1, 4)}, executor=executor, cache=shared_cache(), progress=False).load()
    for n in (1, 3, 4):
        x = np.random.default_rng(n).standard_normal((n, 3, 32, 32)).astype(np.float32)
        got, want = module.run({"x": x})["logits"], reference_outputs(model, {"x": x})["logits"]
        assert got.shape == want.shape == (n, 10)
        np.testing.assert_allclose(got, want, rtol=0, atol=step, err_msg=f"batch {n}")


@pytest.mark.parametrize("fmt", ["qdq", "qoperator"])
def test_a_quantized_cnn_over_a_run_time_height_and_width(fmt, executor):
    """The int8 convs over a run-time plane: the channels-last copy element by element and its
    table of quad offsets computed at run time from the padded width; exact against the
    reference, within one step of the output's scale as above, at square, odd and extreme
    sizes of one build."""
    from tests.test_quantized import _output_step
    model = _quantized_cnn(fmt, {2: "h", 3: "w"})
    module = build(model, dims={"h": (16, 48), "w": (16, 48)}, executor=executor, cache=None,
                   progress=False).load()
    for h, w in ((16, 16), (23, 37), (48, 48)):
        x = np.random.default_rng(h * w).standard_normal((1, 3, h, w)).astype(np.float32)
        got, want = module.run({"x": x})["logits"], reference_outputs(model, {"x": x})["logits"]
        np.testing.assert_allclose(got, want, rtol=0, atol=_output_step(model) * 1.001, err_msg=f"{h} x {w}")


def _quantized_depthwise_net(fmt: str) -> onnx.ModelProto:
    """A stem, a 3x3 depthwise conv, a 1x1 conv and a strided 3x3, over a run-time height and
    width, quantized in format `fmt` (calibrated at 32 x 32)."""
    g = model_zoo.GraphMaker(3)
    h = g.op("Relu", [g.conv("x", 3, 16, 3)])
    h = g.op("Relu", [g.conv(h, 16, 16, 3, group=16)])
    h = g.op("Relu", [g.conv(h, 16, 24, 1, pad=0)])
    h = g.op("Relu", [g.conv(h, 24, 32, 3, stride=2)])
    y = g.linear(g.op("Flatten", [g.op("GlobalAveragePool", [h])], axis=1), 32, 10)
    model = g.model({"x": [1, 3, "h", "w"]}, [model_zoo._rename_output(g, y, "logits")])
    return model_zoo.quantized(model, fmt, symbols={"h": 32, "w": 32})


@pytest.mark.parametrize("target", X86_TARGETS)
@pytest.mark.parametrize("fmt", ["dynamic", "qdq", "qoperator"])
def test_int8_depthwise_and_pointwise_convs_over_a_run_time_plane(fmt, target, executor):
    """Over a run-time plane the int8 depthwise conv takes the float32 kernel (exact: its sums
    stay below 2^24) and the 1x1 conv the channels-last GEMM, whose pixel panels are not
    known when it builds; against the reference on both x86 targets where the host runs
    them, else by their assembly."""
    from tests.test_quantized import _output_step
    model = _quantized_depthwise_net(fmt)
    result = build(model, target=target, dims={"h": (8, 48), "w": (8, 48)}, executor=executor, cache=None,
                   progress=False)
    step = 1e-5 if fmt == "dynamic" else _output_step(model) * 1.001

    def run():
        module = result.load()
        for h, w in ((8, 8), (23, 37), (48, 48), (9, 40)):
            x = np.random.default_rng(h * w).standard_normal((1, 3, h, w)).astype(np.float32)
            got, want = module.run({"x": x})["logits"], reference_outputs(model, {"x": x})["logits"]
            np.testing.assert_allclose(got, want, rtol=0, atol=step, err_msg=f"{h} x {w}")
    run_or_inspect(result, run)


@pytest.mark.parametrize("target", X86_TARGETS)
def test_symbolic_kernels_for_each_x86_target(target, executor):
    """The run-time loops and the run-time-rows GEMM for AVX2 and for AVX-512: run where this
    host can, else their assembly checked for the target's vectors (tests/isa.py)."""
    model = feed_forward_block(mask=True)
    result = build(model, target=target, dims=BOUNDS, executor=executor, cache=None, progress=False)

    def run():
        module = result.load()
        for batch, seq in ((1, 1), (2, 37)):
            rng = np.random.default_rng(seq)
            feeds = {"x": rng.standard_normal((batch, seq, 64)).astype(np.float32),
                     "m": np.ones((batch, seq, 1), np.float32)}
            np.testing.assert_allclose(module.run(feeds)["y"], model_zoo.onnxruntime_outputs(model, feeds)["y"],
                                       rtol=1e-5, atol=1e-6)
    run_or_inspect(result, run)


def test_calls_that_repeat_their_shapes_each_run_at_their_own(block_build):
    """One module called with shapes in turn, each twice and more (a bound call's symbols are
    remembered by its shapes: artifacts/symbols.py): every call runs at its own sizes and
    returns its own shape, and a call outside the bounds is still refused by name."""
    model, result = block_build
    module = result.load()
    for step, (batch, seq) in enumerate([(1, 5), (3, 40), (1, 5), (3, 40), (2, 0), (1, 5)]):
        rng = np.random.default_rng(step)
        feeds = {"x": rng.standard_normal((batch, seq, 64)).astype(np.float32),
                 "m": (rng.random((batch, seq, 1)) > 0.3).astype(np.float32)}
        got, want = module.run(feeds)["y"], model_zoo.onnxruntime_outputs(model, feeds)["y"]
        assert got.shape == want.shape == (batch, seq, 64)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        with pytest.raises(KilnError, match="outside the bounds"):
            module.run({"x": np.zeros((5, seq, 64), np.float32), "m": np.zeros((5, seq, 1), np.float32)})


def test_threads_change_no_byte(block_build):
    _, result = block_build
    feeds = {"x": np.random.default_rng(1).standard_normal((3, 77, 64)).astype(np.float32),
             "m": np.ones((3, 77, 1), np.float32)}
    one, two = result.load(threads=1).run(feeds)["y"], result.load(threads=2).run(feeds)["y"]
    np.testing.assert_array_equal(one, two)


def test_the_kernels_read_the_sizes_once_built(block_build):
    """No kernel is specialised to a size: the same bundle, the same kernels for every call."""
    _, result = block_build
    assert all(any(b.name == "s" for b in c.kernel.buffers) for c in result.lowered.calls)


def test_each_size_is_loaded_once_at_the_kernels_entry(block_build):
    """A kernel loads each symbol it reads in its entry block, before any branch: loaded where
    used, in a conditional block, a size (and all computed from it) stayed inside the loops."""
    from modelkiln.codegen_worker.llvm_emit import kernel_to_llvm_ir
    _, result = block_build
    t = result.target
    for call in result.lowered.calls:
        text = kernel_to_llvm_ir(call.kernel, "k", t.triple, t.cpu, t.features)
        symbols = f"%b{[b.name for b in call.kernel.buffers].index('s')}"
        body = text[text.index("define void @k("):].split("\n")[2:]
        entry = body[:next(i for i, line in enumerate(body) if line.lstrip().startswith(("br ", "switch ", "ret ")))]
        uses = [line for line in body if f"ptr {symbols}," in line or f"ptr {symbols} " in line]
        assert uses and all(line in entry for line in uses), call.kernel.symbol


@pytest.mark.parametrize("feeds,message", [
    ({"x": (5, 3, 64), "m": (5, 3, 1)},
     "dim 0 is batch = 5, outside the bounds the bundle was built for (batch = 1..4)"),
    ({"x": (1, 81, 64), "m": (1, 81, 1)}, "dim 1 is seq = 81, outside the bounds"),
    ({"x": (2, 3, 64), "m": (2, 4, 1)}, "input 'm': dim 1 is seq = 4, but input 'x' has seq = 3: the two must agree"),
    ({"x": (2, 3, 32), "m": (2, 3, 1)}, "input 'x': dim 2 must be 64, got 32"),
    ({"x": (2, 64), "m": (2, 3, 1)}, "input 'x': expected rank 3 [batch, seq, 64], got shape (2, 64)"),
])
def test_bad_sizes_are_refused_before_anything_runs(block_build, feeds, message):
    _, result = block_build
    module = result.load()
    out = {"y": np.full((2, 3, 64), 7.0, np.float32)}
    with pytest.raises(KilnError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):
        module.run({k: np.zeros(v, np.float32) for k, v in feeds.items()}, out=out)
    assert (out["y"] == 7.0).all()


def test_out_arrays_take_the_actual_shape(block_build):
    _, result = block_build
    module = result.load()
    feeds = {"x": np.ones((2, 5, 64), np.float32), "m": np.ones((2, 5, 1), np.float32)}
    with pytest.raises(KilnError, match=r"out\['y'\]: expected a writable C-contiguous float32 array of shape "
                                        r"\(2, 5, 64\)"):
        module.run(feeds, out={"y": np.empty((4, 80, 64), np.float32)})
    out = {"y": np.empty((2, 5, 64), np.float32)}
    assert module.run(feeds, out=out) is out


def test_the_manifest_and_header_name_the_symbols(block_build, tmp_path):
    _, result = block_build
    result.export(str(tmp_path / "b"))
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert manifest["symbols"] == [{"name": "batch", "least": 1, "greatest": 4},
                                   {"name": "seq", "least": 0, "greatest": 80}]
    header = (tmp_path / "b" / "kiln_model.h").read_text()
    assert "#define KILN_NUM_SYMBOLS 2" in header and "int kiln_run_dims(" in header
    # Input x: batch, seq, 64; bytes at the bounds: 4 * 80 * 64 * 4.
    assert "static const long long kiln_input_shapes[2][3] = {{-1, -2, 64}, {-1, -2, 1}};" in header
    assert f"kiln_input_bytes[2] = {{{4 * 80 * 64 * 4}, {4 * 80 * 4}}}" in header


def test_a_symbol_without_bounds_is_named_with_its_inputs(executor):
    model = feed_forward_block(mask=True)
    with pytest.raises(KilnError, match=r"symbolic dims without bounds: 'seq' \(in x, m\)\. Bound each with --dim"):
        build(model, dims={"batch": (1, 2)}, executor=executor, cache=None, progress=False)
    with pytest.raises(KilnError, match="--dim names sequence, which no input's shape has"):
        build(model, dims={**BOUNDS, "sequence": (1, 2)}, executor=executor, cache=None, progress=False)
    with pytest.raises(KilnError, match="--dim batch=5..2: bounds must satisfy 0 <= least <= greatest"):
        build(model, dims={"batch": (5, 2), "seq": (1, 2)}, executor=executor, cache=None, progress=False)


def test_a_fixed_dim_builds_static_and_a_named_one_symbolic(executor):
    """--shape still fixes a dim (a static build, as before symbols); a name in --shape makes
    a dim of an unnamed model symbolic."""
    model = feed_forward_block()
    static = build(model, shapes={"x": [2, 9, 64]}, executor=executor, cache=None, progress=False)
    assert not static.lowered.symbols and not any(b.name == "s" for c in static.lowered.calls for b in c.kernel.buffers)
    named = build(model, shapes={"x": ["n", 9, 64]}, dims={"n": (1, 3)}, executor=executor, cache=None, progress=False)
    feeds = {"x": np.random.default_rng(2).standard_normal((3, 9, 64)).astype(np.float32)}
    np.testing.assert_allclose(named.load().run(feeds)["y"], model_zoo.onnxruntime_outputs(model, feeds)["y"],
                               rtol=1e-5, atol=1e-6)


def test_an_op_not_taught_symbols_is_refused_by_name(executor):
    """A Resize by a third of a run-time height has no exact size (float32's 1/3 times h is
    not h // 3): refused, and the error says which node, which shapes and why."""
    resize = helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="linear", name="resize")
    graph = helper.make_graph([resize], "g", [helper.make_tensor_value_info("x", F, [1, 3, "h", 8])],
                              [helper.make_tensor_value_info("y", F, None)],
                              [numpy_helper.from_array(np.array([1, 1, 1 / 3, 2], np.float32), "scales")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    with pytest.raises(UnsupportedError, match=r"node 'resize' \(Resize\): Resize with symbolic dimensions is not "
                                               r"supported yet \(x: float32\[1 x 3 x h x 8\].*Resize by 0.333.* of a "
                                               r"run-time size \(whole scales, or fractions of a power of two\)\). "
                                               r"Fix those dims with --shape"):
        build(model, dims={"h": (1, 16)}, executor=executor, cache=None, progress=False)


def test_shape_chains_and_ranges_over_sizes(executor):
    """A Shape into a Reshape is shape arithmetic, done at build time; a Range up to a size
    and a ConstantOfShape of sizes compute their values at run time."""
    reshape = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Reshape", ["x", "s"], ["y"])]
    graph = helper.make_graph(reshape, "g", [helper.make_tensor_value_info("x", F, ["n", 4])],
                              [helper.make_tensor_value_info("y", F, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    got = build(model, dims={"n": (1, 8)}, executor=executor, cache=shared_cache(), progress=False).load().run({"x": x})
    np.testing.assert_array_equal(got["y"], x)
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
             helper.make_node("Range", ["two", "n", "one"], ["r"], name="positions"),
             helper.make_node("Cast", ["r"], ["y"], to=F),
             helper.make_node("ConstantOfShape", ["s"], ["fill"],
                              value=numpy_helper.from_array(np.array([3], np.int64))),
             helper.make_node("ConstantOfShape", ["s"], ["half"],
                              value=numpy_helper.from_array(np.array([0.5], np.float32))),
             helper.make_node("Add", ["x", "half"], ["z"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, ["n", 4])],
                              [helper.make_tensor_value_info(o, t, None)
                               for o, t in (("y", F), ("fill", TensorProto.INT64), ("z", F))],
                              [numpy_helper.from_array(np.array(v, np.int64), k)
                               for k, v in {"zero": 0, "one": 1, "two": 2}.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    module = build(model, dims={"n": (2, 8)}, executor=executor, cache=shared_cache(), progress=False).load()
    for n in (2, 3, 8):
        feeds = {"x": np.random.default_rng(n).standard_normal((n, 4)).astype(np.float32)}
        got, want = module.run(feeds), model_zoo.onnxruntime_outputs(model, feeds)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_elements_of_a_range_over_sizes_bound_the_next_range(executor):
    """Funnel's relative positions: the first and last elements of arange(n), and of its
    pooled positions (Concat([-1], arange(n)[1:-1][::2])), start and end two more Ranges.
    Those elements are sizes (ir/ops/size_elements.py): the Ranges' lengths are n + 4 and
    (n - 1) // 2 + 1 at every n; against onnxruntime."""
    g = model_zoo.GraphMaker(0)
    n = g.op("Gather", [g.op("Shape", ["x"]), g.const(np.array(1, np.int64))], axis=0)
    pos = g.op("Cast", [g.op("Range", [g.const(np.array(0, np.int64)), n, g.const(np.array(1, np.int64))])], to=F)
    inner = g.op("Slice", [pos, g.const(np.array([1])), g.const(np.array([-1])), g.const(np.array([0]))])
    every_other = g.op("Slice", [inner, g.const(np.array([0])), g.const(np.array([2 ** 62])), g.const(np.array([0])),
                                 g.const(np.array([2]))])
    pooled = g.op("Concat", [g.const(np.array([-1.0], np.float32)), every_other], axis=0)
    first, last, pooled_first, pooled_last = (g.op("Gather", [t, g.const(np.array(i, np.int64))], axis=0)
                                              for t, i in ((pos, 0), (pos, -1), (pooled, 0), (pooled, -1)))
    as_int = lambda t, plus: g.op("Cast", [g.op("Add", [t, g.const(np.array(plus, np.float32))])],  # noqa: E731
                                  to=TensorProto.INT64)
    wide = g.op("Range", [as_int(first, -3.0), as_int(last, 2.0), g.const(np.array(1, np.int64))])
    down = g.op("Range", [as_int(pooled_last, 0.0), as_int(pooled_first, -1.0), g.const(np.array(-1, np.int64))])
    wide_f = g.op("Cast", [wide], to=F)
    inside = g.op("Slice", [wide_f, g.const(np.array([3])), g.const(np.array([-1])), g.const(np.array([0]))])
    scaled = g.op("Mul", ["x", g.op("Unsqueeze", [inside, g.const(np.array([0, 2]))])])  # (n long: x's length)
    outputs = [wide_f, g.op("Cast", [down], to=F), scaled]
    model = g.model({"x": [1, "n", 1]}, outputs)
    module = build(model, dims={"n": (3, 40)}, executor=executor, cache=shared_cache(), progress=False).load()
    for size in (3, 4, 9, 40):
        _assert_like_onnxruntime(module, model, {"x": np.random.default_rng(size).standard_normal((1, size, 1))
                                                 .astype(np.float32)})


def test_an_einsum_over_run_time_sizes_is_a_batched_matmul(executor):
    """Attention as Funnel writes it, over a run-time length: scores "bind,bjnd->bnij" of two
    projections, the weighted sum "bnij,bjnd->bind", and a projection by a constant
    "bind,ndh->bih". Each a MatMul (over run-time sizes its reshapes read symbolic shapes),
    against onnxruntime at each length."""
    g = model_zoo.GraphMaker(0)
    heads = [g.op("Reshape", [g.op("MatMul", ["x", g.weight((16, 16))]), g.const(np.array([0, 0, 2, 8]))])
             for _ in range(3)]
    scores = g.op("Softmax", [g.op("Einsum", heads[:2], equation="bind,bjnd->bnij")], axis=-1)
    mixed = g.op("Einsum", [scores, heads[2]], equation="bnij,bjnd->bind")
    out = g.op("Einsum", [mixed, g.weight((2, 8, 16))], equation="bind,ndh->bih")
    model = g.model({"x": ["b", "n", 16]}, [out])
    result = build(model, dims={"b": (1, 3), "n": (1, 33)}, executor=executor, cache=None, progress=False)
    assert "Einsum" not in {n.op for n in result.graph.nodes}
    module = result.load()
    for b, n in ((1, 1), (2, 7), (3, 33)):
        _assert_like_onnxruntime(module, model, {"x": np.random.default_rng(n).standard_normal((b, n, 16))
                                                 .astype(np.float32)})


def test_cli_builds_runs_and_explains_with_dims(tmp_path):
    path = str(tmp_path / "block.onnx")
    onnx.save(feed_forward_block(), path)
    kiln = [sys.executable, "-m", "modelkiln.orchestrator.cli"]
    env = {**os.environ, "KILN_CACHE_DIR": str(tmp_path / "cache")}
    subprocess.run(kiln + ["build", path, "-o", str(tmp_path / "out"), "--dim", "batch=1..2", "--dim", "seq=1..40"],
                   check=True, env=env, capture_output=True)
    ran = subprocess.run(kiln + ["run", str(tmp_path / "out"), "--dim", "seq=7"], check=True, env=env,
                         capture_output=True, text=True).stdout
    assert "symbols batch=2, seq=7" in ran and "y: float32[2, 7, 64]" in ran
    explained = subprocess.run(kiln + ["explain", path, "--dim", "batch=1..2", "--dim", "seq=1..40"], check=True,
                               env=env, capture_output=True, text=True).stdout
    assert "batch = 1..2, seq = 1..40" in explained and "input  x: float32[batch x seq x 64]" in explained
    bad = subprocess.run(kiln + ["build", path, "-o", str(tmp_path / "bad"), "--dim", "seq=1-40"], env=env,
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "--dim 'seq=1-40': expected NAME=LEAST..GREATEST" in bad.stderr


# ---- a BERT exported with dynamic axes ----------------------------------------------------------

@pytest.fixture(scope="module", params=["torchscript", "dynamo"])
def bert_build(executor, request):
    model, feeds = dynamic_zoo.bert_encoder_dynamic(exporter=request.param)
    return model, feeds, build(model, dims={"batch": (1, 4), "seq": (1, 64)}, executor=executor, cache=None,
                               progress=False)


@pytest.mark.parametrize("batch,seq", [(1, 1), (1, 7), (2, 16), (3, 33), (4, 64), (2, 63)])
def test_a_bert_with_dynamic_axes_runs_every_shape_from_one_build(bert_build, batch, seq):
    """Heads split and merged by Reshapes to shapes computed from Shape, position ids sliced
    to seq, token types expanded to [batch, seq], a padding mask per row, in the spellings of
    both torch exporters."""
    model, feeds, result = bert_build
    f = feeds(batch, seq, seed=batch * 100 + seq)
    got = result.load().run(f)
    want = model_zoo.onnxruntime_outputs(model, f)
    for name in want:
        assert got[name].shape == want[name].shape
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=2e-5, err_msg=name)


def test_the_shape_arithmetic_left_no_kernel(bert_build):
    """Shape -> Gather -> Unsqueeze -> Concat chains are sizes known to type inference: no
    kernel computes or copies them (the Reshapes they feed are views)."""
    _, _, result = bert_build
    ops = {op for c in result.lowered.calls for op in c.ops}
    assert not ops & {"Shape", "Concat", "kiln.SymbolicValue"}, ops


def test_sizes_read_at_run_time_are_computed_then(executor):
    """A Shape used as data (here scaled and added to the input's rows) is written by a kernel
    from the symbols' values at each call."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Cast", ["s"], ["sf"], to=F),
             helper.make_node("Mul", ["sf", "half"], ["scaled"]),
             helper.make_node("Add", ["x", "scaled"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, ["n", 2])],
                              [helper.make_tensor_value_info("y", F, None),
                               helper.make_tensor_value_info("s", TensorProto.INT64, None)],
                              [numpy_helper.from_array(np.float32(0.5), "half")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    module = build(model, dims={"n": (0, 9)}, executor=executor, cache=shared_cache(), progress=False).load()
    for n in (0, 1, 5, 9):
        x = np.random.default_rng(n).standard_normal((n, 2)).astype(np.float32)
        got, want = module.run({"x": x}), model_zoo.onnxruntime_outputs(model, {"x": x})
        np.testing.assert_array_equal(got["s"], want["s"])
        np.testing.assert_allclose(got["y"], want["y"], rtol=1e-6)


# ---- GPT-2 decoding with a KV cache ---------------------------------------------------------------

@pytest.mark.parametrize("positions", ["input", "range"])
def test_gpt2_decodes_onnxruntime_tokens_from_one_build_starting_from_an_empty_cache(executor, positions):
    """One build with past = 0..100: the prompt with an empty cache (past 0), then 32 greedy
    steps of one token, each feeding the previous step's present keys and values back; the
    presents' length past + seq is a polynomial of two symbols. Position ids are an input, or
    a Range(past, past + seq) over sizes, computed at run time."""
    model, info = dynamic_zoo.gpt2_decoder_dynamic(positions=positions)
    result = build(model, dims={"batch": (1, 1), "seq": (1, 16), "past": (0, 100)}, executor=executor, cache=None,
                   progress=False)
    manifest = json.loads(result.files["manifest.json"])
    manifest_presents = [o["shape"] for o in manifest["outputs"] if o["name"].startswith("present")]
    assert all(s[2] == [[["past"], 1], [["seq"], 1]] for s in manifest_presents), manifest_presents
    prompt = [5, 17, 3, 40, 11]
    want_tokens, want_logits = dynamic_zoo.greedy_tokens(lambda f: model_zoo.onnxruntime_outputs(model, f), info,
                                                         prompt, 32)
    got_tokens, got_logits = dynamic_zoo.greedy_tokens(result.load().run, info, prompt, 32)
    assert got_tokens == want_tokens
    for step, (got, want) in enumerate(zip(got_logits, want_logits)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"step {step}")


def test_an_optimum_merged_decoder_generates_onnxruntime_tokens(executor):
    """HF optimum's merged decoder: an If on `use_cache_branch` between the decoder with past
    and the prefill-only one, whose presents are seq long where the other's are past + seq.
    One build: the prefill (past 0, use_cache_branch false) and 32 greedy steps give
    onnxruntime's tokens. The prefill branch with a non-empty past, where the two presents
    could not share a shape, is refused by name and nothing runs."""
    model, info = dynamic_zoo.gpt2_merged_decoder()
    result = build(model, dims={"batch": (1, 1), "seq": (1, 16), "past": (0, 100)}, executor=executor, cache=None,
                   progress=False)
    prompt = [5, 17, 3, 40, 11]
    want_tokens, want_logits = dynamic_zoo.greedy_tokens(lambda f: model_zoo.onnxruntime_outputs(model, f), info,
                                                         prompt, 32)
    module = result.load()
    got_tokens, got_logits = dynamic_zoo.greedy_tokens(module.run, info, prompt, 32)
    assert got_tokens == want_tokens
    for step, (got, want) in enumerate(zip(got_logits, want_logits)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"step {step}")
    feeds = {"input_ids": np.array([[4]], np.int64), "position_ids": np.array([[3]], np.int64),
             "use_cache_branch": np.array([False]),
             **{f"past_{kind}_{i}": np.zeros((1, info["heads"], 3, info["dh"]), np.float32)
                for i in range(info["layers"]) for kind in ("key", "value")}}
    with pytest.raises(KilnError, match=r"'optimum::if' \(If\): output \d+ when 'use_cache_branch' is false: "
                                        r"past \+ seq = 4 and seq = 1 must be equal"):
        module.run(feeds)


# ---- CNNs with a symbolic batch -------------------------------------------------------------------

@pytest.mark.parametrize("name", ["residual_cnn", "mobilenet_v2", "unet", "convnext_stage"])
def test_a_cnn_with_a_symbolic_batch(name, executor):
    """Convolutions (implicit GEMM, 1x1, depthwise, transposed), pools, upsampling, the
    classifier's Gemm and ConvNeXt's channels-last MLP over a batch known at run time, each
    image as in a static build: ConvNeXt's transposes to and from channels-last run alone as
    blocks, and UNet's 2x Resize by phases along its rows, as they do over a static batch."""
    from modelkiln.ir.loop import For, Store, TransposeBlock
    from tests import vision_zoo
    from tests.conftest import kernel_statements
    model = {**model_zoo.ALL, **vision_zoo.ALL}.get(name, getattr(model_zoo, name, None))()
    x = model.graph.input[0]
    x.type.tensor_type.shape.dim[0].dim_param = "n"
    image = [d.dim_value for d in x.type.tensor_type.shape.dim][1:]
    result = build(model, dims={"n": (1, 4)}, executor=executor, cache=None, progress=False)
    blocks = [c for c in result.lowered.calls
              if any(isinstance(s, TransposeBlock) for s in kernel_statements(c.kernel.body))]
    assert len(blocks) == {"convnext_stage": 6}.get(name, 0), [c.name for c in blocks]
    if name == "unet":  # (by phases: a loop along the row storing each of the 4 phases)
        [resize] = [c for c in result.lowered.calls if c.ops == ["Resize"]]
        assert any(isinstance(s, For) and sum(isinstance(t, Store) for t in s.body) == 4
                   for s in kernel_statements(resize.kernel.body))
    module = result.load()
    for n in (1, 3):
        feeds = {x.name: np.random.default_rng(n).standard_normal([n] + image).astype(np.float32)}
        got, want = module.run(feeds), model_zoo.onnxruntime_outputs(model, feeds)
        for k in want:
            assert got[k].shape == want[k].shape
            np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-5 * float(np.abs(want[k]).max()), err_msg=k)


# ---- CNNs with a dynamic height and width ---------------------------------------------------------

def _assert_like_onnxruntime(module, model, feeds):
    got, want = module.run(feeds), model_zoo.onnxruntime_outputs(model, feeds)
    for k in want:
        assert got[k].shape == want[k].shape, k
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-5 * float(np.abs(want[k]).max()), err_msg=k)


def test_a_cnn_with_dynamic_batch_height_and_width(executor):
    """One build for every image size in the bounds, odd ones too: a stride-2 conv's output
    height ceil(h / 2) is a symbol derived from h (the manifest says how; the module computes
    it), the depthwise conv, pools, upsample, crop and global average run at run-time sizes."""
    model = dynamic_zoo.cnn_dynamic_image()
    result = build(model, dims={"batch": (1, 3), "height": (6, 48), "width": (6, 48)}, executor=executor,
                   cache=None, progress=False)
    derived = json.loads(result.files["manifest.json"])["derived"]
    assert derived[0] == {"name": "(height + 1)//2", "numerator": [[[], 1], [["height"], 1]], "divisor": 2,
                          "least": 3, "greatest": 24}
    module = result.load()
    for shape in [(1, 3, 6, 6), (2, 3, 17, 33), (3, 3, 48, 48), (1, 3, 9, 47), (1, 3, 31, 7)]:
        _assert_like_onnxruntime(module, model, {"images": np.random.default_rng(shape[2]).standard_normal(shape)
                                                 .astype(np.float32)})
    one_image = build(model, shapes={"images": [1, 3, "height", "width"]}, dims={"height": (6, 48), "width": (6, 48)},
                      executor=executor, cache=shared_cache(), progress=False).load(threads=2)  # (its phases divide)
    for shape in [(1, 3, 6, 6), (1, 3, 47, 19)]:
        _assert_like_onnxruntime(one_image, model, {"images": np.random.default_rng(shape[3]).standard_normal(shape)
                                                    .astype(np.float32)})


def test_a_unet_pads_its_upsampled_maps_to_their_skips_sizes(executor):
    """milesial's UNet over run-time sizes: each 2x ConvTranspose is padded by the difference
    of its skip's Shape and its own (Div, Sub, Concat into a Pad). Every size has one
    spelling (two pools give (height)//4, not a quotient of a quotient), so the padded map
    is the skip's size exactly: its Concat needs no run-time check, and the output is
    [batch, 3, height, width]. Against onnxruntime at odd sizes too."""
    model = dynamic_zoo.unet_dynamic()
    result = build(model, dims={"batch": (1, 2), "height": (8, 64), "width": (8, 64)}, executor=executor,
                   cache=None, progress=False)
    assert [d["name"] for d in json.loads(result.files["manifest.json"])["derived"]] == \
        ["(height)//2", "(width)//2", "(height)//4", "(width)//4"]
    assert [str(d) for d in result.graph.types["masks"].shape] == ["batch", "3", "height", "width"]
    assert not result.graph.checks
    module = result.load()
    for shape in [(1, 3, 8, 8), (2, 3, 17, 33), (1, 3, 64, 64), (1, 3, 31, 9), (1, 3, 13, 14)]:
        _assert_like_onnxruntime(module, model, {"images": np.random.default_rng(shape[2]).standard_normal(shape)
                                                 .astype(np.float32)})


@pytest.mark.parametrize("mode", ["constant", "edge", "reflect", "wrap"])
def test_a_pad_of_run_time_sizes(mode, executor):
    """Pad (constant pads) of a run-time height and width: the kernel's bounds checks, edge
    clamps, reflections and wraps read the sizes it is given."""
    pads = numpy_helper.from_array(np.array([0, 0, 2, 1, 0, 0, 1, 3], np.int64), "pads")
    graph = helper.make_graph([helper.make_node("Pad", ["x", "pads"], ["y"], mode=mode)], "g",
                              [helper.make_tensor_value_info("x", F, [1, 2, "h", "w"])],
                              [helper.make_tensor_value_info("y", F, None)], [pads])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=8)
    module = build(model, dims={"h": (4, 20), "w": (4, 20)}, executor=executor, cache=shared_cache(), progress=False).load()
    for shape in [(1, 2, 4, 4), (1, 2, 9, 17), (1, 2, 20, 5)]:
        _assert_like_onnxruntime(module, model, {"x": np.random.default_rng(shape[3]).standard_normal(shape)
                                                 .astype(np.float32)})


@pytest.mark.parametrize("name,dims,shapes", [
    # FCN- and UNet-style: a 2x2 ConvTranspose, bilinear Resizes by scales and to the image's
    # own size (sizes from its Shape), a bicubic align-corners one, over run-time sizes
    ("segmentation_dynamic", {"batch": (1, 2), "height": (8, 64), "width": (8, 64)},
     [(1, 3, 8, 8), (2, 3, 17, 33), (1, 3, 64, 64), (1, 3, 31, 9)]),
    # ceil_mode pools whose last window the bounds show to start inside the input
    ("squeezenet_dynamic", {"batch": (1, 2), "height": (24, 80), "width": (24, 80)},
     [(1, 3, 24, 24), (2, 3, 37, 51), (1, 3, 80, 80)]),
    # expand(batch, -1, -1) through Where(Equal(shape, -1)); allowzero Reshapes whose -1 is a
    # whole multiple of (height//4)*(width//4) + 1 tokens
    ("vit_dynamic", {"batch": (1, 3), "height": (8, 40), "width": (8, 40)},
     [(1, 3, 8, 8), (3, 3, 21, 37), (2, 3, 40, 40)]),
    # GroupNorm as Reshape, InstanceNormalization over a run-time length, Reshape back
    ("audio_dynamic", {"batch": (1, 2), "samples": (400, 4000)}, [(1, 400), (2, 1601), (1, 4000)]),
    # padding to a multiple of the window by (w - h % w) % w (Mod of sizes), step-2 Slices
    ("swin_dynamic", {"batch": (1, 2), "height": (8, 96), "width": (8, 96)},
     [(1, 3, 8, 8), (2, 3, 40, 56), (1, 3, 96, 96), (1, 3, 24, 88)]),
])
def test_nets_in_the_spellings_torch_exports_with_dynamic_axes(name, dims, shapes, executor):
    """What torch 2.14's exporters wrote for an FCN head, SqueezeNet, a ViT, wav2vec2's
    feature encoder and HF's Swin exported with dynamic axes (each of these failed to build
    before), built once and run at several sizes against onnxruntime."""
    model = getattr(dynamic_zoo, name)()
    module = build(model, dims=dims, executor=executor, cache=shared_cache(), progress=False).load()
    feed = model.graph.input[0].name
    for shape in shapes:
        _assert_like_onnxruntime(module, model, {feed: np.random.default_rng(shape[-1]).standard_normal(shape)
                                                 .astype(np.float32)})


@pytest.mark.parametrize("cell,attrs,state", [
    ("LSTM", {"direction": "bidirectional"}, True),
    ("GRU", {"direction": "bidirectional", "linear_before_reset": 1}, False),
    ("GRU", {}, True),
    ("RNN", {"direction": "reverse"}, False),
])
def test_a_recurrent_net_over_a_run_time_batch_and_length(cell, attrs, state, executor):
    """LSTM, GRU and RNN with both the batch and the sequence length symbolic: the input
    projection is one GEMM over their product's rows, the time loop runs the run-time steps
    over the run-time rows, its state planned at the batch's bound."""
    gates, hidden, width = {"LSTM": 4, "GRU": 3, "RNN": 1}[cell], 8, 5
    dirs = 2 if attrs.get("direction") == "bidirectional" else 1
    rng = np.random.default_rng(7)
    weights = [numpy_helper.from_array((rng.standard_normal(s) * 0.3).astype(np.float32), n) for n, s in
               (("W", (dirs, gates * hidden, width)), ("R", (dirs, gates * hidden, hidden)), ("B", (dirs, 2 * gates * hidden)))]
    inputs = [helper.make_tensor_value_info("x", F, ["seq", "batch", width])]
    names = ["x", "W", "R", "B", "", ""]
    if state:
        inputs.append(helper.make_tensor_value_info("h0", F, [dirs, "batch", hidden]))
        names[5] = "h0"
    node = helper.make_node(cell, names, ["y", "y_h"], hidden_size=hidden, **attrs)
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info(o, F, None) for o in ("y", "y_h")],
                              weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)], ir_version=8)
    module = build(model, dims={"batch": (1, 4), "seq": (1, 40)}, executor=executor, cache=None,
                   progress=False).load()
    for seq, batch in [(1, 1), (7, 2), (40, 4), (13, 3)]:
        feeds = {"x": rng.standard_normal([seq, batch, width]).astype(np.float32)}
        if state:
            feeds["h0"] = rng.standard_normal([dirs, batch, hidden]).astype(np.float32)
        _assert_like_onnxruntime(module, model, feeds)


def test_a_reshape_whose_sizes_agree_at_some_sizes_only_is_checked_at_run_time(executor):
    """A Swin traced at a size its windows divide has no crop back from its padding: its
    Reshape of the padded map to height * width tokens holds only where no padding was
    needed. The module runs there and names the Reshape elsewhere, as onnxruntime fails."""
    pads = helper.make_node("Pad", ["x", "pads"], ["p"])
    pad_to_4 = [helper.make_node("Shape", ["x"], ["s"], start=1), helper.make_node("Mod", ["s", "four"], ["r"]),
                helper.make_node("Sub", ["four", "r"], ["d"]), helper.make_node("Mod", ["d", "four"], ["e"]),
                helper.make_node("Concat", ["zeros", "e"], ["pads"], axis=0)]
    flat = helper.make_node("Reshape", ["p", "flat_shape"], ["y"])
    flat_shape = [helper.make_node("Shape", ["x"], ["xs"]), helper.make_node("ReduceProd", ["xs"], ["n"], keepdims=1)]
    graph = helper.make_graph(pad_to_4 + [pads] + flat_shape + [helper.make_node("Identity", ["n"], ["flat_shape"]),
                                                                 flat], "g",
                              [helper.make_tensor_value_info("x", F, [2, "w"])],
                              [helper.make_tensor_value_info("y", F, None)],
                              [numpy_helper.from_array(np.array([4], np.int64), "four"),
                               numpy_helper.from_array(np.array([0, 0, 0], np.int64), "zeros")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    module = build(model, dims={"w": (1, 40)}, executor=executor, cache=shared_cache(), progress=False).load()
    _assert_like_onnxruntime(module, model, {"x": np.arange(16, dtype=np.float32).reshape(2, 8)})
    odd = {"x": np.ones((2, 5), np.float32)}
    with pytest.raises(Exception):
        model_zoo.onnxruntime_outputs(model, odd)
    with pytest.raises(KilnError, match=r"node 'Reshape_\d+' \(Reshape\): the elements of float32\[2 x .*\] and of "
                                        r"shape \[.*\]: .* = 16 and .* = 10 must be equal"):
        module.run(odd)


RUN_TIME_RESIZES = [  # (mode, coordinate_transformation_mode, scales of h and w, more attributes)
    ("linear", "half_pixel", (2, 2), {}), ("linear", "align_corners", (2, 2), {}),
    ("linear", "asymmetric", (1.5, 0.25), {}), ("linear", "half_pixel", (0.5, 0.5), {"antialias": 1}),
    ("cubic", "pytorch_half_pixel", (2, 2), {}), ("cubic", "half_pixel_symmetric", (2, 0.5), {"exclude_outside": 1}),
    ("cubic", "half_pixel", (0.5, 0.5), {"antialias": 1, "cubic_coeff_a": -0.5}),
    ("nearest", "half_pixel", (1.5, 1.5), {"nearest_mode": "round_prefer_ceil"}),
    ("nearest", "align_corners", (2, 2), {}), ("nearest", "asymmetric", (1.5, 2.5), {"nearest_mode": "ceil"}),
]


@pytest.mark.parametrize("mode,coords,scales,attrs", RUN_TIME_RESIZES)
def test_a_resize_of_run_time_sizes_in_each_mode(mode, coords, scales, attrs, executor):
    """Resize by constant scales of a run-time height and width: the output's sizes are
    floor(size * scale), exact for whole scales and fractions of a power of two."""
    resize = helper.make_node("Resize", ["x", "", "scales"], ["y"], mode=mode, coordinate_transformation_mode=coords,
                              **attrs)
    graph = helper.make_graph([resize], "g", [helper.make_tensor_value_info("x", F, [1, 3, "h", "w"])],
                              [helper.make_tensor_value_info("y", F, None)],
                              [numpy_helper.from_array(np.array([1, 1, *scales], np.float32), "scales")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)
    module = build(model, dims={"h": (1, 40), "w": (4, 40)}, executor=executor, cache=shared_cache(), progress=False).load()
    for shape in [(1, 3, 4, 8), (1, 3, 2, 5), (1, 3, 40, 33), (1, 3, 7, 4)]:
        _assert_like_onnxruntime(module, model, {"x": np.random.default_rng(shape[3]).standard_normal(shape)
                                                 .astype(np.float32)})


@pytest.mark.parametrize("wshape,attrs", [
    ((8, 4, 2, 2), {"strides": [2, 2]}),
    ((8, 3, 3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1]}),
    ((8, 2, 3, 3), {"strides": [2, 1], "dilations": [1, 2], "pads": [0, 1, 2, 0], "group": 2}),
])
def test_a_conv_transpose_over_run_time_sizes(wshape, attrs, executor):
    """ConvTranspose of a run-time batch, height and width: the GEMM over the input's pixels
    into columns as large as the bounds, then each output point gathers its columns."""
    rng = np.random.default_rng(5)
    weights = [numpy_helper.from_array(rng.standard_normal(wshape).astype(np.float32), "w"),
               numpy_helper.from_array(rng.standard_normal(wshape[1] * attrs.get("group", 1)).astype(np.float32), "b")]
    graph = helper.make_graph([helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], **attrs)], "g",
                              [helper.make_tensor_value_info("x", F, ["n", 8, "h", "w"])],
                              [helper.make_tensor_value_info("y", F, None)], weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    module = build(model, dims={"n": (1, 2), "h": (1, 40), "w": (1, 40)}, executor=executor, cache=None,
                   progress=False).load()
    for shape in [(1, 8, 5, 7), (2, 8, 1, 1), (1, 8, 40, 33), (2, 8, 13, 2)]:
        _assert_like_onnxruntime(module, model, {"x": rng.standard_normal(shape).astype(np.float32)})


def _conv_branches(channels: int = 16) -> onnx.ModelProto:
    """Convs over x [n, 16, h, w] as dynamic image sizes meet them, each branch an output:
    depthwise (3x3 stride 2; 7x7, whose window runs in passes; 3x3 stride 2 with dilation and
    uneven pads), a 3x3 conv with a residual Add and SiLU (AVX-512 runs that tile as a
    function of its own), an unpadded stride-2 conv (its input read in place), a grouped conv,
    1x1 convs of few input channels (pointwise: a run-time count of pixel columns; one with
    SiLU) and one of 300 (the implicit GEMM)."""
    rng = np.random.default_rng(11)
    weights, nodes, outputs = [], [], []

    def conv(name, wshape, x="x", **attrs):
        weights.append(numpy_helper.from_array((rng.standard_normal(wshape) * 0.2).astype(np.float32), f"{name}_w"))
        weights.append(numpy_helper.from_array(rng.standard_normal(wshape[0]).astype(np.float32), f"{name}_b"))
        nodes.append(helper.make_node("Conv", [x, f"{name}_w", f"{name}_b"], [name], **attrs))
        return name

    def output(name):
        outputs.append(helper.make_tensor_value_info(name, F, None))
    c = channels
    output(conv("dw_s2", (c, 1, 3, 3), group=c, strides=[2, 2], pads=[1, 1, 1, 1]))
    output(conv("dw_7x7", (c, 1, 7, 7), group=c, pads=[3, 3, 3, 3]))
    output(conv("dw_dilated", (c, 1, 3, 3), group=c, strides=[2, 2], dilations=[2, 2], pads=[0, 1, 2, 0]))
    conv("c3", (c, c, 3, 3), pads=[1, 1, 1, 1])
    nodes += [helper.make_node("Add", ["c3", "x"], ["res"]), helper.make_node("Sigmoid", ["res"], ["gate"]),
              helper.make_node("Mul", ["res", "gate"], ["silu"])]
    output("silu")
    output(conv("s2_unpadded", (8, c, 3, 3), strides=[2, 2]))
    output(conv("grouped", (c, c // 2, 3, 3), group=2, pads=[0, 1, 1, 2]))
    output(conv("pointwise", (40, c, 1, 1)))
    conv("pw", (24, c, 1, 1))
    nodes += [helper.make_node("Sigmoid", ["pw"], ["pw_gate"]), helper.make_node("Mul", ["pw", "pw_gate"], ["pw_silu"])]
    output("pw_silu")
    output(conv("wide_1x1", (8, 300, 1, 1), x=conv("to_300", (300, c, 1, 1))))
    graph = helper.make_graph(nodes, "convs", [helper.make_tensor_value_info("x", F, ["n", c, "h", "w"])], outputs,
                              weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("target", X86_TARGETS)
def test_convs_over_run_time_image_sizes_on_each_x86_target(target, executor):
    """The implicit GEMM over run-time sizes (AVX2's tiles over the whole plane, AVX-512's
    within output rows, rows narrower than a tile too) and the direct depthwise conv, whose
    bordered copies and rows have run-time lengths: against onnxruntime where this host runs
    the target, else their assembly checked for the target's vectors."""
    model = _conv_branches()
    result = build(model, target=target, dims={"n": (1, 2), "h": (3, 48), "w": (4, 48)}, executor=executor,
                   cache=None, progress=False)

    def run():
        module = result.load(threads=2)
        for shape in [(1, 16, 3, 4), (2, 16, 7, 13), (1, 16, 48, 48), (1, 16, 17, 4), (1, 16, 5, 31),
                      (2, 16, 24, 15)]:
            _assert_like_onnxruntime(module, model, {"x": np.random.default_rng(shape[3]).standard_normal(shape)
                                                     .astype(np.float32)})
    run_or_inspect(result, run)


@pytest.mark.parametrize("bound, prefetches", [(64, True), (16, False)])
def test_a_pointwise_conv_over_run_time_sizes_prefetches_as_its_bound_would(bound, prefetches, executor):
    """A 1x1 projection over run-time sizes reads its input planes in place as static sizes
    do, and prefetches them where B at its bound (Gemm.n_bound) passes L2, as a build for the
    bound would: at every size, small ones (fewer panels than the prefetch runs ahead) too."""
    from modelkiln.codegen_worker.gemm_emit import PREFETCH_B_BYTES
    from modelkiln.codegen_worker.llvm_emit import kernel_to_llvm_ir
    from modelkiln.ir.loop import Gemm
    from modelkiln.orchestrator.target import parse_target
    rng = np.random.default_rng(5)
    w = numpy_helper.from_array((rng.standard_normal((24, 96, 1, 1)) * 0.1).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("Relu", ["c"], ["y"])],
                              "g", [helper.make_tensor_value_info("x", F, [1, 96, "h", "w"])],
                              [helper.make_tensor_value_info("y", F, None)], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    result = build(model, dims={"h": (1, bound), "w": (1, bound)}, executor=executor, cache=None, progress=False)
    [call] = result.lowered.calls
    [gemm] = [s for s in kernel_statements(call.kernel.body) if isinstance(s, Gemm)]
    assert gemm.b_sk and gemm.n_bound == bound * bound and (96 * bound * bound * 4 > PREFETCH_B_BYTES) == prefetches
    t = parse_target("llvm")
    assert ("@llvm.prefetch" in kernel_to_llvm_ir(call.kernel, "k", t.triple, t.cpu, t.features)) == prefetches
    module = result.load(threads=2)
    for h, w_ in [(bound, bound), (bound - 1, bound // 2 + 1), (5, 3), (1, 1)]:
        _assert_like_onnxruntime(module, model, {"x": rng.standard_normal((1, 96, h, w_)).astype(np.float32)})


@pytest.mark.parametrize("attrs", [
    {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
    {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1},
    {"kernel_shape": [3, 2], "strides": [2, 3], "dilations": [2, 1], "pads": [0, 1, 2, 0]},
])
def test_a_strided_max_pool_over_run_time_sizes(attrs, executor):
    """A strided max pool over run-time sizes copies its planes with a border split by
    column phase, as over static sizes (the copy's rows and slots expressions of the sizes,
    a ceil_mode window's last taps included), into a ring of rows where a call's plane is past
    L1 (the kernel holds both): exactly onnxruntime's maxima."""
    graph = helper.make_graph([helper.make_node("MaxPool", ["x"], ["y"], **attrs)], "g",
                              [helper.make_tensor_value_info("x", F, [1, 8, "h", "w"])],
                              [helper.make_tensor_value_info("y", F, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    result = build(model, dims={"h": (5, 200), "w": (5, 200)}, executor=executor, cache=None, progress=False)
    assert copies_rows_as_it_goes(result.lowered.calls[0].kernel)
    module = result.load()
    for h, w in ((5, 5), (7, 9), (100, 100), (6, 99), (33, 8), (200, 187), (151, 200)):
        feeds = {"x": np.random.default_rng(h * w).standard_normal((1, 8, h, w)).astype(np.float32)}
        want = model_zoo.onnxruntime_outputs(model, feeds)["y"]
        got = module.run(feeds)["y"]
        assert got.shape == want.shape
        np.testing.assert_array_equal(got, want)


def _strided_windows() -> onnx.ModelProto:
    """Strided window ops over x [1, 8, h, w], each an output: depthwise convs of stride 2
    (pads 1, and none), 3 (a 5-wide window, left pad 2) and 2 dilated, and a max pool of
    stride 2 (its border is -inf, not zero)."""
    rng = np.random.default_rng(5)
    weights, nodes, outputs = [], [], []
    for name, (kh, kw), attrs in [("dw_s2", (3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1]}),
                                  ("dw_s2_unpadded", (3, 3), {"strides": [2, 2]}),
                                  ("dw_s3", (5, 5), {"strides": [3, 3], "pads": [2, 2, 1, 0]}),
                                  ("dw_dilated", (3, 3), {"strides": [2, 2], "dilations": [2, 2], "pads": [1, 2, 2, 1]})]:
        weights += [numpy_helper.from_array(rng.standard_normal((8, 1, kh, kw)).astype(np.float32), f"{name}_w")]
        nodes.append(helper.make_node("Conv", ["x", f"{name}_w"], [name], group=8, **attrs))
        outputs.append(helper.make_tensor_value_info(name, F, None))
    nodes.append(helper.make_node("MaxPool", ["x"], ["pool"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]))
    outputs.append(helper.make_tensor_value_info("pool", F, None))
    graph = helper.make_graph(nodes, "windows", [helper.make_tensor_value_info("x", F, [1, 8, "h", "w"])], outputs,
                              weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("target", X86_TARGETS)
def test_strided_windows_over_every_run_time_width(target, executor):
    """A strided depthwise conv's or max pool's bordered copy over a run-time width copies
    each input row with one Deinterleave that reads the row only to its end, the slots past
    it (the right border) filled from the same vectors; output rows of fewer than 4 vectors
    run predicated, longer ones as whole vectors and a masked tail. Every width from 3 to 40,
    and some whose output rows pass 64, against onnxruntime."""
    model = _strided_windows()
    result = build(model, target=target, dims={"h": (3, 9), "w": (3, 300)}, executor=executor, cache=None,
                   progress=False)
    from modelkiln.ir.loop import Deinterleave
    to_the_end = [s for call in result.lowered.calls for s in kernel_statements(call.kernel.body)
                  if isinstance(s, Deinterleave) and s.src_count is not None]
    assert len(to_the_end) == 5

    def run():
        import onnxruntime as ort
        module = result.load(threads=2)
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        for h, w in [(5, w) for w in range(3, 41)] + [(3, 129), (9, 130), (4, 255), (3, 300)]:
            feeds = {"x": np.random.default_rng(w).standard_normal((1, 8, h, w)).astype(np.float32)}
            got = module.run(feeds)
            for name, want in zip([o.name for o in session.get_outputs()], session.run(None, feeds)):
                assert got[name].shape == want.shape, (name, w)
                np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-5, err_msg=f"{name} at width {w}")
    run_or_inspect(result, run)


def _depthwise_branches(channels: int = 3) -> onnx.ModelProto:
    """Depthwise convs over x [1, channels, h, w], each an output: 3x3 stride 1, 3x3 stride 2,
    5x5 stride 3 with uneven pads, 3x3 stride 2 dilated, 7x7 stride 2 (its window in passes)
    and 1x1 stride 2 (a stride past the window)."""
    rng = np.random.default_rng(9)
    weights, nodes, outputs = [], [], []
    for name, k, attrs in [("s1", 3, {"pads": [1, 1, 1, 1]}),
                           ("s2", 3, {"strides": [2, 2], "pads": [1, 1, 1, 1]}),
                           ("s3", 5, {"strides": [3, 3], "pads": [2, 1, 0, 2]}),
                           ("dilated", 3, {"strides": [2, 2], "dilations": [2, 2], "pads": [2, 2, 2, 2]}),
                           ("passes", 7, {"strides": [2, 2], "pads": [3, 3, 3, 3]}),
                           ("one_tap", 1, {"strides": [2, 2]})]:
        weights.append(numpy_helper.from_array(rng.standard_normal((channels, 1, k, k)).astype(np.float32), f"{name}_w"))
        nodes.append(helper.make_node("Conv", ["x", f"{name}_w"], [name], group=channels, **attrs))
        outputs.append(helper.make_tensor_value_info(name, F, None))
    graph = helper.make_graph(nodes, "dw", [helper.make_tensor_value_info("x", F, [1, channels, "h", "w"])], outputs,
                              weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("dims", [None, {"h": (8, 200), "w": (8, 200)}])
def test_a_depthwise_conv_past_l1_copies_a_ring_of_rows(dims, executor):
    """A depthwise conv whose bordered copy of a plane passes 48 KB copies into a ring
    of its last few padded rows, each output row's new rows just before it; a smaller one
    copies whole planes. Static sizes decide when building, run-time sizes at each call (the
    kernel holds both). Against onnxruntime: at 120 x 130 (a ring), 20 x 33 (whole planes) and,
    over run-time sizes, odd sizes either side of the choice."""
    model = _depthwise_branches()
    if dims is None:  # (a build per size, each deciding for its own)
        builds = []
        for h, w in [(120, 130), (20, 33)]:
            static = onnx.ModelProto.FromString(model.SerializeToString())
            for axis, n in ((2, h), (3, w)):
                static.graph.input[0].type.tensor_type.shape.dim[axis].dim_value = n
            builds.append((build(static, executor=executor, cache=None, progress=False), [(h, w)], h > 100))
    else:
        builds = [(build(model, dims=dims, executor=executor, cache=None, progress=False),
                   [(120, 130), (20, 33), (97, 101), (8, 8), (200, 199)], True)]
    for result, sizes, ring in builds:
        assert any(copies_rows_as_it_goes(c.kernel) for c in result.lowered.calls) == ring
        module = result.load(threads=2)
        for h, w in sizes:
            feeds = {"x": np.random.default_rng(h + w).standard_normal((1, 3, h, w)).astype(np.float32)}
            _assert_like_onnxruntime(module, model, feeds)


@pytest.mark.parametrize("xshape,wshape,attrs,sizes", [
    (["n", 6, "t"], (8, 6, 5), {"pads": [2, 2], "strides": [2]}, [(1, 6, 1), (2, 6, 37), (1, 6, 64)]),
    (["n", 4, "d", "h", "w"], (6, 4, 3, 3, 3), {"pads": [1, 1, 1, 1, 1, 1]}, [(1, 4, 2, 5, 9), (2, 4, 6, 6, 6)]),
])
def test_one_and_three_dimensional_convs_over_run_time_sizes(xshape, wshape, attrs, sizes, executor):
    rng = np.random.default_rng(3)
    weights = [numpy_helper.from_array(rng.standard_normal(wshape).astype(np.float32), "w")]
    graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], **attrs)], "g",
                              [helper.make_tensor_value_info("x", F, xshape)],
                              [helper.make_tensor_value_info("y", F, None)], weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    module = build(model, dims={d: (1, 64) for d in xshape if isinstance(d, str)}, executor=executor, cache=None,
                   progress=False).load()
    for shape in sizes:
        _assert_like_onnxruntime(module, model, {"x": rng.standard_normal(shape).astype(np.float32)})


def test_a_yolo_style_detector_builds_with_dynamic_axes(executor):
    """YOLOv8's export with dynamic axes: anchors computed from the feature maps' shapes
    (Shape -> Gather -> Cast -> Range), SPPF, an upsample joined to the stride-8 map. One
    build serves every size whose maps line up (multiples of 16 here); where they do not,
    the module names the Concat and runs nothing (onnxruntime fails there too)."""
    model = dynamic_zoo.yolo_style_dynamic()
    module = build(model, dims={"batch": (1, 2), "height": (32, 96), "width": (32, 96)}, executor=executor,
                   cache=shared_cache(), progress=False).load()
    for shape in [(1, 3, 32, 32), (2, 3, 64, 96), (1, 3, 48, 80), (1, 3, 96, 32)]:
        _assert_like_onnxruntime(module, model, {"images": np.random.default_rng(shape[3]).standard_normal(shape)
                                                 .astype(np.float32)})
    odd = {"images": np.zeros((1, 3, 33, 47), np.float32)}
    with pytest.raises(KilnError, match=r"node 'Concat_\d+' \(Concat\): dim 2 of its inputs: .* = 6 and .* = 5 must "
                                        r"be equal"):
        module.run(odd)
    with pytest.raises(Exception):
        model_zoo.onnxruntime_outputs(model, odd)


# ---- sizes that must agree at run time ------------------------------------------------------------

def test_sizes_that_must_agree_are_checked_before_running(executor, tmp_path):
    """x [n, m] + y [n, k] needs m = k, and x [n, m] @ w [k, 3] needs them equal too: the
    module runs where they are and refuses by name where they are not, from Python and from C
    (kiln_run_dims returns 3 without running)."""
    nodes = [helper.make_node("Add", ["x", "y"], ["s"], name="sum"), helper.make_node("MatMul", ["s", "w"], ["z"],
                                                                                    name="product")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, ["n", "m"]),
                                           helper.make_tensor_value_info("y", F, ["n", "k"]),
                                           helper.make_tensor_value_info("w", F, ["k", 3])],
                              [helper.make_tensor_value_info("z", F, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    result = build(model, dims={"n": (1, 5), "m": (1, 6), "k": (1, 6)}, executor=executor, cache=None, progress=False)
    module = result.load()
    rng = np.random.default_rng(3)
    feeds = {"x": rng.standard_normal((2, 4)).astype(np.float32), "y": rng.standard_normal((2, 4)).astype(np.float32),
             "w": rng.standard_normal((4, 3)).astype(np.float32)}
    np.testing.assert_allclose(module.run(feeds)["z"], model_zoo.onnxruntime_outputs(model, feeds)["z"], rtol=1e-5)
    feeds["y"], feeds["w"] = np.zeros((2, 5), np.float32), np.zeros((5, 3), np.float32)
    with pytest.raises(KilnError, match=r"node 'sum' \(Add\), axis 1: [mk] = [45] and [mk] = [45] must be equal"):
        module.run(feeds)
    header = result.files["kiln_model.h"].decode()
    assert "3 (sizes the model needs equal differ)" in header
    entry = result.files["kiln_entry.c"].decode()
    assert entry.count("return 3;") == 4  # (m = k twice: the Add and the MatMul; in both entry points)


def test_the_generation_example_gives_onnxruntime_tokens(tmp_path):
    """docs/example_generate.py: one build, the prompt with an empty cache, then a token per call."""
    example = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "example_generate.py")
    env = {**os.environ, "KILN_CACHE_DIR": str(tmp_path / "cache")}
    flags = ["--layers", "1", "--width", "128", "--vocab", "300", "--tokens", "12", "--past", "64", "--check"]
    out = subprocess.run([sys.executable, example, *flags], check=True, env=env, capture_output=True, text=True).stdout
    assert "built once" in out and "ms per token (median of 12)" in out
    assert "(the same)" in out, out


def test_a_manifest_edited_to_redefine_a_derived_symbol_is_refused(executor, tmp_path):
    """Output sizes follow the derived symbols' definitions: the library carries them in its
    signature, so a manifest that redefines one (smaller outputs: a heap overrun) never loads."""
    from modelkiln.artifacts.module import Module
    from tests.conftest import bundle_copy
    bundle = build(dynamic_zoo.cnn_dynamic_image(), dims={"batch": (1, 2), "height": (6, 40), "width": (6, 40)},
                   executor=executor, cache=None, progress=False).export(str(tmp_path / "cnn"))

    def halve_the_height(m):
        m["derived"][0]["divisor"] = 4
    with pytest.raises(KilnError, match="describes inputs, outputs or arena other than the library was built for"):
        Module(bundle_copy(bundle, tmp_path, halve_the_height))


@pytest.mark.parametrize("target", X86_TARGETS)
def test_convs_of_small_windows_over_run_time_sizes_take_the_weights_as_rows(target, executor):
    """Stems over run-time image sizes (3 -> 32 3x3 and 3 -> 16 5x5 at stride 2, a stride of 3
    with uneven pads; a group's are in _conv_branches): the weights as rows, as over static sizes, B each
    output row read through a table of tap offsets the kernel computes from the sizes, from a
    copy split by column phase where there is a column stride. Against onnxruntime at sizes
    from below one tile of pixels to the bounds, where this host runs the target."""
    from modelkiln.ir.loop import Expr, Gemm
    rng = np.random.default_rng(7)
    weights, nodes, outputs = [], [], []
    for name, wshape, attrs in [("stem", (32, 3, 3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1]}),
                                ("stem5", (16, 3, 5, 5), {"strides": [2, 2], "pads": [2, 1, 2, 2]}),
                                ("s3", (24, 3, 3, 3), {"strides": [1, 3], "pads": [0, 1, 2, 2]})]:
        weights += [numpy_helper.from_array((rng.standard_normal(wshape) * 0.3).astype(np.float32), f"{name}_w"),
                    numpy_helper.from_array(rng.standard_normal(wshape[0]).astype(np.float32), f"{name}_b")]
        nodes.append(helper.make_node("Conv", ["x", f"{name}_w", f"{name}_b"], [name], **attrs))
        outputs.append(helper.make_tensor_value_info(name, F, None))
    graph = helper.make_graph(nodes, "stems", [helper.make_tensor_value_info("x", F, ["n", 3, "h", "w"])], outputs,
                              weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    result = build(model, target=target, dims={"n": (1, 2), "h": (5, 120), "w": (5, 150)}, executor=executor,
                   cache=None, progress=False)
    for call in result.lowered.calls:  # (a run-time batch: each kernel also holds a batch of one's Gemm)
        gemms = [s for s in kernel_statements(call.kernel.body) if isinstance(s, Gemm)]
        assert gemms and all(g.b_ktab and isinstance(g.n, Expr) for g in gemms), call.name
    assert len(result.lowered.calls) == 3

    def run():
        module = result.load(threads=2)
        for shape in [(1, 3, 5, 5), (2, 3, 17, 40), (1, 3, 120, 150), (1, 3, 64, 33), (2, 3, 9, 131)]:
            _assert_like_onnxruntime(module, model, {"x": rng.standard_normal(shape).astype(np.float32)})
    run_or_inspect(result, run)


def test_a_float16_stem_over_run_time_sizes(executor):
    """A float16 3 -> 32 stride-2 conv over run-time sizes: its copy split by column phase
    widens each element (a Deinterleave reads float32 rows only). Against onnxruntime in
    float32 on the same float16 values."""
    from onnxconverter_common import float16
    rng = np.random.default_rng(9)
    w = numpy_helper.from_array((rng.standard_normal((32, 3, 3, 3)) * 0.3).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1], strides=[2, 2])], "g",
                              [helper.make_tensor_value_info("x", F, [1, 3, "h", "w"])],
                              [helper.make_tensor_value_info("y", F, None)], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    half = float16.convert_float_to_float16(model, keep_io_types=False)
    module = build(half, dims={"h": (5, 100), "w": (5, 100)}, executor=executor, cache=shared_cache(), progress=False).load()
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(
        numpy_helper.to_array(half.graph.initializer[0]).astype(np.float32), "w"))
    for h, w_ in [(5, 5), (37, 91), (100, 100)]:
        x = rng.standard_normal((1, 3, h, w_)).astype(np.float16)
        got = module.run({"x": x})["y"].astype(np.float32)
        want = model_zoo.onnxruntime_outputs(model, {"x": x.astype(np.float32)})["y"]
        np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)
