"""precision="bf16": MatMul and Gemm operands rounded to bfloat16, summed in float32.

Checked against a numpy emulation of the contract (ir/lower/bf16_gemm.py): both operands
rounded to the nearest bfloat16 (ties to even), their products and sums in float64; Kiln's
float32 sums may differ from that by float32 rounding of a sum of |products|. The same
cases run on each path: the tile unit (the `sapphirerapids` preset: run on an AMX host,
checked by its tdpbf16ps elsewhere) and the float32 kernels over the rounded operands
(Cascade Lake's AVX-512 and AVX2 targets, run where the host can).
"""
import subprocess
import sys

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from modelkiln.ir.errors import KilnError
from modelkiln.ir.lower.bf16_gemm import bf16_bits, bf16_rounded
from modelkiln.orchestrator.api import build
from tests import transformer_zoo
from tests.conftest import kernel_statements, shared_cache
from tests.isa import AVX2, AVX512, run_or_inspect

F = TensorProto.FLOAT
AMX = "sapphirerapids"
TARGETS = (AMX, AVX512, AVX2)


def _model(nodes, inputs, inits):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, F, s) for n, s in inputs],
                              [helper.make_tensor_value_info("y", F, None)],
                              [numpy_helper.from_array(v, n) for n, v in inits])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def _gemms(result) -> list:
    return [s for c in result.lowered.calls for s in kernel_statements(c.kernel.body) if type(s).__name__ == "Gemm"]


def _emulated(a, w):
    """The contract in float64, and the bound of float32 summation's error on it."""
    a64, w64 = bf16_rounded(a).astype(np.float64), bf16_rounded(w).astype(np.float64)
    return a64 @ w64, np.abs(a64) @ np.abs(w64) * 2e-6 + 1e-30


def test_rounding_is_to_nearest_even():
    """bf16_bits against ml_dtypes' bfloat16 (onnx's own), ties and NaN included."""
    import ml_dtypes
    x = np.array([1.0, 1.00390625, 1.01171875, -2.5, 3.4e38, 1e-40, np.inf, -np.inf], np.float32)
    x = np.concatenate([x, np.random.default_rng(0).standard_normal(1000).astype(np.float32)])
    np.testing.assert_array_equal(bf16_bits(x), x.astype(ml_dtypes.bfloat16).view(np.uint16))
    assert bf16_bits(np.array([np.nan], np.float32))[0] & 0x7FC0 == 0x7FC0


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("m,k,n", [(37, 200, 70), (128, 256, 96), (3, 30, 16), (1, 64, 300)])
def test_matmul_in_bf16(target, m, k, n):
    """A MatMul with constant weights: rows and k off the tiles' 16 x 32 elements (A's rows
    padded with zeros, meeting zero weights), columns off the 16-column tiles."""
    rng = np.random.default_rng(1)
    w, a = rng.standard_normal((k, n)).astype(np.float32), rng.standard_normal((m, k)).astype(np.float32)
    model = _model([helper.make_node("MatMul", ["a", "w"], ["y"])], [("a", [m, k])], [("w", w)])
    result = build(model, target=target, executor="inprocess", cache=shared_cache(), progress=False,
                   precision="bf16")
    assert [g.kind for g in _gemms(result)] == ["bf16" if target == AMX else "f32"]

    def run():
        got = result.load().run({"a": a})["y"]
        want, bound = _emulated(a, w)
        assert np.all(np.abs(got - want) <= bound), np.abs(got - want).max()
        assert np.abs(got - a.astype(np.float64) @ w).max() > 0  # (it is not float32)
    run_or_inspect(result, run, ["tdpbf16ps", "ldtilecfg"] if target == AMX else None)


@pytest.mark.parametrize("target", (AMX, AVX2))
def test_gemm_and_batched_rows_in_bf16(target):
    """Gemm with transB, alpha, beta and a bias (the epilogue stays float32), then a MatMul of
    [2, 9, K] rows by [K, N] weights."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 9, 48)).astype(np.float32)
    w1, c1 = rng.standard_normal((40, 48)).astype(np.float32), rng.standard_normal(40).astype(np.float32)
    w2 = rng.standard_normal((40, 24)).astype(np.float32)
    nodes = [helper.make_node("Reshape", ["x", "flat"], ["x2"]),
             helper.make_node("Gemm", ["x2", "w1", "c1"], ["h"], transB=1, alpha=0.5, beta=2.0),
             helper.make_node("Reshape", ["h", "back"], ["h3"]),
             helper.make_node("MatMul", ["h3", "w2"], ["y"])]
    model = _model(nodes, [("x", [2, 9, 48])], [("w1", w1), ("c1", c1), ("w2", w2),
                                                   ("flat", np.array([18, 48])), ("back", np.array([2, 9, 40]))])
    result = build(model, target=target, executor="inprocess", cache=shared_cache(), progress=False,
                   precision="bf16")
    assert len(_gemms(result)) == 2

    def run():
        got = result.load().run({"x": x})["y"]
        h = _emulated(x.reshape(18, 48), w1.T)[0]
        h = (0.5 * h + 2.0 * c1).astype(np.float32)
        y = _emulated(h.reshape(2, 9, 40), w2)[0]
        # (h itself carries float32 rounding into the second product's rounding to bf16)
        assert np.abs(got - y).max() <= 0.02 * np.abs(y).max(), np.abs(got - y).max()
    run_or_inspect(result, run, ["tdpbf16ps"] if target == AMX else None)


def test_transformer_in_bf16_stays_near_float32():
    """A BERT-style encoder: softmax, LayerNorm and GELU stay float32; its output in bf16
    within 3% of the float32 build's range (OpenVINO's bf16 default: 0.1-3% on transformers)."""
    model, feeds = transformer_zoo.bert_encoder("dynamo", seq=16, d=64, heads=2, layers=1)
    fp32 = build(model, executor="inprocess", cache=shared_cache(), progress=False).load().run(feeds)
    result = build(model, executor="inprocess", cache=shared_cache(), progress=False, precision="bf16")
    got = result.load().run(feeds)
    for name, want in fp32.items():
        diff = np.abs(got[name].astype(np.float64) - want).max() / np.abs(want).max()
        assert 0 < diff < 0.03, (name, diff)
    assert result.report["precision"] == "bf16"


def _conv_emulated(x, w, bias, **attrs):
    """The bf16 conv contract in float64 (onnx's reference evaluator over the rounded operands),
    and the bound of float32 summation's error on it (the same conv over their magnitudes)."""
    import onnx.reference
    d = TensorProto.DOUBLE

    def conv(xv, wv):
        g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], **attrs)], "ref",
                              [helper.make_tensor_value_info("x", d, xv.shape)],
                              [helper.make_tensor_value_info("y", d, None)],
                              [numpy_helper.from_array(wv, "w")])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
        return onnx.reference.ReferenceEvaluator(m).run(None, {"x": xv})[0]
    x64, w64 = bf16_rounded(x).astype(np.float64), bf16_rounded(w).astype(np.float64)
    want = conv(x64, w64) + (0 if bias is None else bias.astype(np.float64).reshape(1, -1, 1, 1))
    return want, conv(np.abs(x64), np.abs(w64)) * 2e-6 + 1e-6


# (channels in, out, size, kernel, stride, pad, dilation, group, bias)
CONVS = [(64, 64, 14, 3, 1, 1, 1, 1, True),     # a stride-1 3x3: one GEMM over the padded plane's rows
         (3, 64, 32, 7, 2, 3, 1, 1, True),      # a stem: 3 channels, runs of 28 elements padded to 32
         (16, 40, 9, 3, 2, 1, 1, 1, False),     # strided: rows of ow pixels; columns off the 16-column tiles
         (5, 24, 11, 3, 1, 1, 1, 1, True),      # odd channels: the copy's pad channel meets zero weights
         (32, 48, 12, 3, 1, 2, 2, 1, True),     # dilated
         (64, 128, 8, 1, 2, 0, 1, 1, True),     # a strided 1x1 projection
         (64, 96, 10, 3, 1, 1, 1, 2, True),     # two groups of 32 channels
         (64, 256, 14, 1, 1, 0, 1, 1, True),    # pointwise: the weights as A, the input as B read in place
         (40, 24, 9, 1, 1, 0, 1, 1, False)]     # pointwise: channels off whole steps, pixels off panels


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("cin,cout,size,kernel,stride,pad,dilation,group,bias", CONVS)
def test_conv_in_bf16(target, cin, cout, size, kernel, stride, pad, dilation, group, bias):
    """A conv (with a ReLU fused after it) in a bf16 build: on AMX-BF16 a bf16 GEMM on tiles
    against the emulated contract; on targets without it, float32, what the fp32 build gives."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, cin, size, size)).astype(np.float32)
    w = rng.standard_normal((cout, cin // group, kernel, kernel)).astype(np.float32)
    b = rng.standard_normal(cout).astype(np.float32) if bias else None
    attrs = dict(strides=[stride] * 2, pads=[pad] * 4, dilations=[dilation] * 2, group=group)
    nodes = [helper.make_node("Conv", ["x", "w"] + (["b"] if bias else []), ["c"], **attrs),
             helper.make_node("Relu", ["c"], ["y"])]
    model = _model(nodes, [("x", list(x.shape))], [("w", w)] + ([("b", b)] if bias else []))
    result = build(model, target=target, executor="inprocess", cache=shared_cache(), progress=False,
                   precision="bf16")
    assert [(g.kind, g.tiles) for g in _gemms(result)] == ([("bf16", True)] if target == AMX else [("f32", False)])

    def run():
        got = result.load().run({"x": x})["y"]
        if target == AMX:
            want, bound = _conv_emulated(x, w, b, **attrs)
            want = np.maximum(want, 0)
            assert np.all(np.abs(got - want) <= bound), np.abs(got - want).max()
        else:
            fp32 = build(model, target=target, executor="inprocess", cache=shared_cache(), progress=False)
            np.testing.assert_array_equal(got, fp32.load().run({"x": x})["y"])
    run_or_inspect(result, run, ["tdpbf16ps", "ldtilecfg"] if target == AMX else None)


def test_convs_the_tiles_do_not_take_stay_float32():
    """In a bf16 build for AMX, a depthwise conv and a conv whose groups hold an odd number of
    channels compute in float32: their outputs are the fp32 build's."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((1, 30, 12, 12)).astype(np.float32)
    dw = rng.standard_normal((30, 1, 3, 3)).astype(np.float32)
    odd = rng.standard_normal((30, 3, 3, 3)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "dw"], ["d"], pads=[1] * 4, group=30),
             helper.make_node("Conv", ["d", "odd"], ["y"], pads=[1] * 4, group=10)]
    model = _model(nodes, [("x", [1, 30, 12, 12])], [("dw", dw), ("odd", odd)])
    result = build(model, target=AMX, executor="inprocess", cache=shared_cache(), progress=False, precision="bf16")
    assert all(g.kind == "f32" for g in _gemms(result))

    def run():
        fp32 = build(model, target=AMX, executor="inprocess", cache=shared_cache(), progress=False)
        np.testing.assert_array_equal(result.load().run({"x": x})["y"], fp32.load().run({"x": x})["y"])
    run_or_inspect(result, run, [])


def test_cnn_in_bf16_stays_near_float32():
    """The test zoo's ResNet-18 at 64 x 64 (its stem, BatchNorms folded into convs, residual
    adds, strided projections, pooling, a Gemm head): a bf16 build for the host is within 2%
    of the fp32 build's range, and not equal to it."""
    from tests import model_zoo
    model = model_zoo.resnet18(size=64)
    feeds = model_zoo.random_inputs(model)
    fp32 = build(model, executor="inprocess", cache=shared_cache(), progress=False).load().run(feeds)
    got = build(model, executor="inprocess", cache=shared_cache(), progress=False, precision="bf16").load().run(feeds)
    for name, want in fp32.items():
        diff = np.abs(got[name].astype(np.float64) - want).max() / np.abs(want).max()
        assert 0 < diff < 0.02, (name, diff)


def test_fp32_is_the_default_and_precision_is_in_the_keys():
    """precision="fp32" builds what a build without it builds (the same kernel keys); "bf16"
    changes the kernels' keys and the whole-model key."""
    from modelkiln.orchestrator.cache_policy import CachePolicy
    from modelkiln.orchestrator.options import BuildOptions
    from modelkiln.orchestrator.target import parse_target
    w = np.random.default_rng(3).standard_normal((64, 32)).astype(np.float32)
    model = _model([helper.make_node("MatMul", ["a", "w"], ["y"])], [("a", [8, 64])], [("w", w)])
    keys = {}
    for precision in (None, "fp32", "bf16"):
        extra = {} if precision is None else {"precision": precision}
        result = build(model, executor="inprocess", cache=shared_cache(), progress=False, **extra)
        keys[precision] = [k["key"] for k in result.report["kernels"]]
    assert keys[None] == keys["fp32"] != keys["bf16"]
    policy = CachePolicy(BuildOptions(cache=shared_cache()))
    target = parse_target("llvm")
    plain = policy.model_key(model, target, BuildOptions(cache=shared_cache()))
    assert plain == policy.model_key(model, target, BuildOptions(cache=shared_cache(), precision="fp32"))
    assert plain != policy.model_key(model, target, BuildOptions(cache=shared_cache(), precision="bf16"))


def test_unknown_precision_is_refused_by_name():
    with pytest.raises(KilnError, match="precision 'fp8' is not one of fp32, bf16"):
        build(_model([helper.make_node("Relu", ["a"], ["y"])], [("a", [4])], []), precision="fp8")


def test_cli_precision(tmp_path):
    w = np.random.default_rng(4).standard_normal((32, 16)).astype(np.float32)
    model = _model([helper.make_node("MatMul", ["a", "w"], ["y"])], [("a", [4, 32])], [("w", w)])
    path = tmp_path / "m.onnx"
    path.write_bytes(model.SerializeToString())
    proc = subprocess.run([sys.executable, "-m", "modelkiln.orchestrator.cli", "build", str(path), "-o",
                           str(tmp_path / "out"), "--precision", "bf16", "--no-cache", "--quiet",
                           "--report", str(tmp_path / "r.json")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert '"precision": "bf16"' in (tmp_path / "r.json").read_text()
