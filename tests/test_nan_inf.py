"""NaN and Inf follow IEEE semantics as onnxruntime has them: NaN propagates through
Relu, Clip, Max, Min, ReduceMax, Softmax, the exp family; Inf saturates where it should.
The oracle is onnxruntime on the same inputs, compared with NaN positions equal."""
import numpy as np
import pytest
from onnx import TensorProto, helper

from modelkiln.codegen_worker.compile import compile_kernel
from modelkiln.ir.lower import ScheduleConfig, lower
from modelkiln.orchestrator.api import build, optimize
from modelkiln.orchestrator.target import parse_target
from tests import model_zoo
from tests.isa import X86_TARGETS, run_or_inspect
from tests.conftest import shared_cache

SPECIALS = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0, 3.5, -3.5, 88.5, -88.5, 89.0, -89.0, 100.0,
                     -100.0, 1e-3], np.float32)


def _model(op, n_inputs=1, shape=(4, 16), opset=17, extra_inputs=(), **attrs):
    names = [f"x{i}" for i in range(n_inputs)]
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(shape)) for n in names]
    inits = [helper.make_tensor(n, TensorProto.FLOAT, [], [v]) for n, v in extra_inputs]
    node = helper.make_node(op, names + [n for n, _ in extra_inputs], ["y"], **attrs)
    graph = helper.make_graph([node], "g", ins, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _inputs(n, shape=(4, 16)):
    rng = np.random.default_rng(0)
    out = {}
    for i in range(n):
        x = rng.permutation(np.tile(SPECIALS, int(np.prod(shape)) // len(SPECIALS)))
        out[f"x{i}"] = x.reshape(shape).astype(np.float32)
    return out


def _compare(model, inputs, executor):
    got = build(model, executor=executor, cache=shared_cache(), progress=False).load().run(inputs)["y"]
    want = model_zoo.onnxruntime_outputs(model, inputs)["y"]
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(got) * np.sign(got), np.isinf(want) * np.sign(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op,attrs", [("Relu", {}), ("Sigmoid", {}), ("Exp", {}), ("Tanh", {}), ("Erf", {}),
                                      ("HardSigmoid", {}), ("HardSwish", {}), ("LeakyRelu", {}), ("Abs", {}),
                                      ("Neg", {}), ("Softmax", {"axis": -1}),
                                      ("ReduceMax", {"axes": [1], "keepdims": 0})])
def test_unary_ops_on_nan_and_inf(op, attrs, executor):
    _compare(_model(op, **attrs), _inputs(1), executor)


def test_reduce_max_over_an_outer_axis_propagates_nan(executor):
    # onnxruntime 1.2x is not consistent here: over an outer axis its result depends on where
    # the NaN stands (a NaN followed by larger numbers is dropped). numpy is the oracle.
    inputs = _inputs(1)
    got = build(_model("ReduceMax", axes=[0], keepdims=1), executor=executor, cache=None,
                progress=False).load().run(inputs)["y"]
    np.testing.assert_array_equal(got, np.max(inputs["x0"], axis=0, keepdims=True))


@pytest.mark.parametrize("op", ["Max", "Min"])
def test_max_min_propagate_nan_from_either_side(op, executor):
    _compare(_model(op, 2), _inputs(2), executor)


def test_clip_keeps_nan(executor):
    _compare(_model("Clip", extra_inputs=[("lo", -1.0), ("hi", 1.0)]), _inputs(1), executor)


def test_softmax_rows_with_inf_and_all_minus_inf(executor):
    x = np.array([[1, 2, 3, 4], [1, np.inf, 2, 3], [-np.inf] * 4, [-np.inf, 0, -np.inf, 1]], np.float32)
    _compare(_model("Softmax", shape=(4, 4), axis=-1), {"x0": x}, executor)


@pytest.mark.parametrize("target", X86_TARGETS)
def test_a_softmax_row_with_a_nan_anywhere_is_all_nan(target, executor):
    """Rows of 49 (three vectors and a remainder on AVX-512, six and one on AVX2) with a NaN
    first, in a middle vector, in the remainder or last; beside them rows with +inf, with
    -inf, and plain ones. The row maximum ignores NaN (one vmaxps a step): the NaN reaches
    every output of its row through exp and the sum instead."""
    x = np.random.default_rng(2).standard_normal((8, 49)).astype(np.float32) * 4
    for row, col in ((0, 0), (1, 20), (2, 48), (3, 47)):
        x[row, col] = np.nan
    x[4, 30], x[5, 5], x[6, :] = np.inf, -np.inf, -np.inf
    model = _model("Softmax", shape=(8, 49), axis=-1)
    result = build(model, target=target, executor=executor, cache=None, progress=False)

    def run():
        got = result.load().run({"x0": x})["y"]
        want = model_zoo.onnxruntime_outputs(model, {"x0": x})["y"]
        assert np.isnan(got[:4]).all() and np.isnan(want[:4]).all()
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        finite = np.isfinite(want)
        np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-6)
    run_or_inspect(result, run)


def test_maxpool_propagates_nan(executor):
    x = np.random.default_rng(1).standard_normal((1, 2, 8, 8)).astype(np.float32)
    x[0, 0, 3, 3], x[0, 1, 0, 0] = np.nan, np.inf
    _compare(_model("MaxPool", shape=(1, 2, 8, 8), kernel_shape=[2, 2], strides=[2, 2]), {"x0": x}, executor)


@pytest.mark.parametrize("kernel,stride,pad", [(2, 2, 0), (3, 2, 1), (9, 1, 4), (9, 2, 4)])
def test_maxpool_keeps_a_nan_from_any_tap(kernel, stride, pad, executor):
    """A NaN anywhere in a window makes its maximum NaN, whichever tap it is (onnxruntime's
    own pooling keeps only a NaN among the last taps, so numpy is the oracle), in the checked
    border columns and the unchecked interior alike (stride 1), from a bordered copy (a
    strided window), for a window computed as a tree of maxima and for one too large for that
    (81 taps: running maxima)."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 3, 13, 13)).astype(np.float32)
    x[0, 0, 0, 0] = x[0, 1, 6, 5] = x[0, 2, 12, 7] = np.nan
    model = _model("MaxPool", shape=(1, 3, 13, 13), kernel_shape=[kernel] * 2, strides=[stride] * 2, pads=[pad] * 4)
    got = build(model, executor=executor, cache=shared_cache(), progress=False).load().run({"x0": x})["y"]
    padded = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)), constant_values=-np.inf)
    out = got.shape[2]
    windows = np.stack([padded[:, :, i:i + stride * out:stride, j:j + stride * out:stride]
                        for i in range(kernel) for j in range(kernel)])
    want = windows.max(axis=0)  # np.max propagates NaN
    assert np.isnan(want).any()
    np.testing.assert_array_equal(got, want)


def test_cnn_given_nan_does_not_return_finite_scores(executor):
    model = model_zoo.cnn()
    x = model_zoo.random_inputs(model)["x"]
    x[0, 1, 5, 7] = np.nan
    got = build(model, executor=executor, cache=shared_cache(), progress=False).load().run({"x": x})["logits"]
    want = model_zoo.onnxruntime_outputs(model, {"x": x})["logits"]
    assert np.isnan(want).all()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))


@pytest.mark.parametrize("op", ["Relu", "Max", "Exp"])
def test_nan_aware_code_stays_vectorized(op):
    """The NaN checks must not cost the vector code: the loop still uses packed 512-bit ops
    (exp's clamps keep NaN by their operand order: no check of their own)."""
    graph, _ = optimize(_model(op, 2 if op == "Max" else 1, shape=(64, 64)))
    call = lower(graph, ScheduleConfig.for_vector_width(16)).calls[0]
    target = parse_target("llvm -mcpu=skylake-avx512")
    asm = compile_kernel(call.kernel.to_bytes(), call.kernel.symbol, target.to_dict(), emit_asm=True)["asm"]
    packed = {"Relu": ["vmaxps"], "Max": ["vmaxps", "vcmpunordps"], "Exp": ["vmulps", "vmaxps", "vminps"]}[op]
    for mnemonic in packed:
        assert any(mnemonic in line and "zmm" in line for line in asm.splitlines()), (mnemonic, asm[:3000])
