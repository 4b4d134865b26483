"""Models stored in float16 and bfloat16: their products compute on float32 operands
(ir/passes/widen_half_products.py) and their conversions are the CPU's where it has them
(F16C; codegen_worker/math_ir.py), with the same numbers as the software conversions.

Oracles: numpy's and ml_dtypes' conversions, onnxruntime on the float16 file, onnx's reference
evaluator on the float32 model over the same (widened) values.
"""
import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from modelkiln.orchestrator.api import build
from tests import model_zoo
from tests.conftest import kernel_statements, shared_cache
from tests.isa import AVX2, kernel_assembly, run_or_inspect

# x86-64 without F16C (a CPU before Ivy Bridge): the software conversions.
NO_F16C = "llvm -mtriple=x86_64-unknown-linux-gnu -mcpu=x86-64 -mattr=+sse4.2"
CONVERSION_TARGETS = (AVX2, NO_F16C)
TYPES = {"float16": (TensorProto.FLOAT16, np.dtype(np.float16)),
         "bfloat16": (TensorProto.BFLOAT16, np.dtype(ml_dtypes.bfloat16))}


def _model(nodes, inputs, outputs, inits=()):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
                              [helper.make_tensor_value_info(n, t, None) for n, t in outputs], list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def _build(model, target="llvm", cache="shared"):
    """cache=None where a test reads what was lowered (a whole-model hit lowers nothing)."""
    return build(model, target=target, executor="inprocess", cache=shared_cache() if cache else None, progress=False)


@pytest.mark.parametrize("target", CONVERSION_TARGETS, ids=["f16c", "software"])
def test_every_float16_widens_exactly(target):
    """All 65,536 float16 bit patterns to float32 and back: numpy's values, NaNs as NaNs."""
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    model = _model([helper.make_node("Cast", ["h"], ["f"], to=TensorProto.FLOAT),
                    helper.make_node("Cast", ["f"], ["back"], to=TensorProto.FLOAT16)],
                   [("h", TensorProto.FLOAT16, [1 << 16])], [("f", TensorProto.FLOAT), ("back", TensorProto.FLOAT16)])
    result = _build(model, target)

    def run():
        got = result.load().run({"h": bits.view(np.float16)})
        want = bits.view(np.float16).astype(np.float32)
        nan = np.isnan(want)
        np.testing.assert_array_equal(got["f"].view(np.uint32)[~nan], want.view(np.uint32)[~nan])
        assert np.isnan(got["f"][nan]).all() and np.isnan(got["back"][nan]).all()
        np.testing.assert_array_equal(got["back"].view(np.uint16)[~nan], bits[~nan])
    run_or_inspect(result, run)


@pytest.mark.parametrize("target", CONVERSION_TARGETS, ids=["f16c", "software"])
def test_float32_rounds_to_float16_as_numpy_does(target):
    """Ties to even, overflow to Inf, the largest finite value, denormals and their ties,
    signed zeros, NaN, and random values over float16's range and past it."""
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, 65504.0, 65519.99, 65520.0, 1e6, 2 ** -24, 2 ** -25,
               3 * 2 ** -25, 2 ** -26, 1e-9, 1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11, -(1.0 + 2 ** -11), 6.1e-5, 3.4e38]
    rng = np.random.default_rng(7)
    x = np.concatenate([np.array(special, np.float32),
                        (rng.standard_normal(4000) * 10 ** rng.uniform(-9, 6, 4000)).astype(np.float32)])
    model = _model([helper.make_node("Cast", ["x"], ["h"], to=TensorProto.FLOAT16)],
                   [("x", TensorProto.FLOAT, [len(x)])], [("h", TensorProto.FLOAT16)])
    result = _build(model, target)

    def run():
        got = result.load().run({"x": x})["h"]
        with np.errstate(over="ignore"):
            want = x.astype(np.float16)
        nan = np.isnan(want)
        np.testing.assert_array_equal(got.view(np.uint16)[~nan], want.view(np.uint16)[~nan])
        assert np.isnan(got[nan]).all()
    run_or_inspect(result, run)


def test_f16c_targets_convert_with_its_instructions():
    """With F16C the kernels convert by vcvtph2ps/vcvtps2ph; without it, by integer code."""
    model = _model([helper.make_node("Mul", ["h", "h"], ["y"])], [("h", TensorProto.FLOAT16, [64])],
                   [("y", TensorProto.FLOAT16)])
    f16c, software = (kernel_assembly(_build(model, target, cache=None)) for target in (AVX2, NO_F16C))
    assert "vcvtph2ps" in f16c and "vcvtps2ph" in f16c
    assert "vcvtph2ps" not in software and "vcvtps2ph" not in software


def _products_model():
    """A float32 model with every product kind: a MatMul of constant weights over 3-D rows, a
    MatMul of two run-time tensors (attention's), a Gemm with a bias, a 3x3 conv, a depthwise
    conv, a pointwise conv and a ConvTranspose."""
    rng = np.random.default_rng(21)

    def w(*shape):
        return (rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype(np.float32)
    inits = {"wm": w(24, 16), "wc": w(8, 4, 3, 3), "wd": w(8, 1, 3, 3), "wp": w(12, 8, 1, 1), "wt": w(12, 6, 2, 2),
             "bc": w(8), "wg": w(16, 10), "bg": w(10)}
    nodes = [helper.make_node("MatMul", ["t", "wm"], ["tm"]),
             helper.make_node("Transpose", ["tm"], ["tt"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["tm", "tt"], ["att"]),
             helper.make_node("Flatten", ["tm"], ["fl"], axis=2),
             helper.make_node("Reshape", ["fl", "rows"], ["r2"]),
             helper.make_node("Gemm", ["r2", "wg", "bg"], ["gm"]),
             helper.make_node("Conv", ["x", "wc", "bc"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["cr"]),
             helper.make_node("Conv", ["cr", "wd"], ["dw"], group=8, pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["dw", "wp"], ["pw"]),
             helper.make_node("ConvTranspose", ["pw", "wt"], ["ct"], strides=[2, 2])]
    inits["rows"] = np.array([-1, 16], np.int64)
    outputs = ["att", "gm", "ct"]
    graph = helper.make_graph(nodes, "products", [helper.make_tensor_value_info("t", TensorProto.FLOAT, [2, 7, 24]),
                                                  helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 9, 11])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
                              [numpy_helper.from_array(v, n) for n, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _feeds(dtype):
    rng = np.random.default_rng(22)
    return {"t": rng.standard_normal((2, 7, 24)).astype(dtype), "x": rng.standard_normal((1, 4, 9, 11)).astype(dtype)}


def _converted(model, half: str):
    """The model as float16 (onnxconverter-common, as users convert) or bfloat16 (every float
    initializer and tensor type rewritten)."""
    if half == "float16":
        from onnxconverter_common import float16
        return float16.convert_float_to_float16(model, keep_io_types=False)
    out = model.__deepcopy__()
    for init in out.graph.initializer:
        if init.data_type == TensorProto.FLOAT:
            values = numpy_helper.to_array(init).astype(ml_dtypes.bfloat16)
            init.CopyFrom(helper.make_tensor(init.name, TensorProto.BFLOAT16, values.shape,
                                             values.view(np.uint16).tobytes(), raw=True))
    for vi in list(out.graph.input) + list(out.graph.output):
        vi.type.tensor_type.elem_type = TensorProto.BFLOAT16
    return out


def _gemm_operand_types(result) -> set:
    """The storage types of the A operands of every GEMM the build's kernels run."""
    types = set()
    for call in result.lowered.calls:
        buffers = {b.name: b.dtype for b in call.kernel.buffers}
        types |= {buffers.get(s.a_buf, "f32") for s in kernel_statements(call.kernel.body) if type(s).__name__ == "Gemm"}
    return types


def _widened_reference(model, half_model, feeds) -> dict:
    """onnx's reference evaluator on the float32 model over the half model's weights and
    inputs, widened exactly to float32, its outputs rounded to the half type."""
    from onnx.reference import ReferenceEvaluator
    reference = model.__deepcopy__()
    half_weights = {i.name: numpy_helper.to_array(i) for i in half_model.graph.initializer}
    for init in reference.graph.initializer:
        if init.data_type == TensorProto.FLOAT:
            init.CopyFrom(numpy_helper.from_array(half_weights[init.name].astype(np.float32), init.name))
    dtype = next(iter(feeds.values())).dtype
    outs = ReferenceEvaluator(reference).run(None, {k: v.astype(np.float32) for k, v in feeds.items()})
    return {o.name: v.astype(dtype) for o, v in zip(reference.graph.output, outs)}


@pytest.mark.parametrize("half", ["float16", "bfloat16"])
def test_half_products_compute_on_float32_operands(half):
    """Every GEMM of a float16 or bfloat16 model's products reads float32 operands (each
    activation converted once, in the kernel that writes it), and the outputs are onnx's
    reference evaluator's over the widened values, within the half type's rounding."""
    model = _products_model()
    half_model = _converted(model, half)
    result = _build(half_model, cache=None)
    assert _gemm_operand_types(result) == {"f32"}
    feeds = _feeds(TYPES[half][1])
    got, want = result.load().run(feeds), _widened_reference(model, half_model, feeds)
    ulp = 2 ** -10 if half == "float16" else 2 ** -7  # (one rounding of each intermediate, a few ulps)
    for name in want:
        assert got[name].dtype == TYPES[half][1]
        scale = np.abs(want[name].astype(np.float32)).max()
        np.testing.assert_allclose(got[name].astype(np.float32), want[name].astype(np.float32), rtol=4 * ulp,
                                   atol=4 * ulp * scale, err_msg=name)


def test_float16_products_match_onnxruntime():
    """The same float16 file in onnxruntime (which casts its float16 products to float32 too)."""
    half_model = _converted(_products_model(), "float16")
    feeds = _feeds(np.float16)
    got, want = _build(half_model).load().run(feeds), model_zoo.onnxruntime_outputs(half_model, feeds)
    for name in want:
        np.testing.assert_allclose(got[name].astype(np.float32), want[name].astype(np.float32), rtol=5e-3,
                                   atol=5e-3 * np.abs(want[name].astype(np.float32)).max(), err_msg=name)


@pytest.mark.parametrize("half", ["float16", "bfloat16"])
def test_a_cast_from_a_half_type_reads_the_value_as_stored(half):
    """x + c in a 16-bit float, cast to float32 in the same kernel: the cast reads the rounded
    sum (what a stored tensor holds), not the float32 sum the fused Add computed."""
    onnx_type, dtype = TYPES[half]
    rng = np.random.default_rng(31)
    x = rng.standard_normal(256).astype(dtype)
    c = (rng.standard_normal(256) * 1e-2).astype(dtype)
    model = _model([helper.make_node("Add", ["x", "c"], ["s"]), helper.make_node("Cast", ["s"], ["y"],
                                                                                  to=TensorProto.FLOAT)],
                   [("x", onnx_type, [256])], [("y", TensorProto.FLOAT)],
                   [helper.make_tensor("c", onnx_type, [256], c.view(np.uint16).tobytes(), raw=True)])
    got = _build(model).load().run({"x": x})["y"]
    want = (x.astype(np.float32) + c.astype(np.float32)).astype(dtype).astype(np.float32)
    assert not np.array_equal(want, x.astype(np.float32) + c.astype(np.float32))  # (the case rounds)
    np.testing.assert_array_equal(got, want)


def test_a_batchnorm_folds_into_the_float32_weights_of_a_float16_conv():
    """Conv -> BatchNormalization in float16: the BatchNorm folds into the widened conv's
    float32 weights (rounded to float16 once, at the output), not into float16 weights (each
    scaled weight rounded: a random MobileNetV3 then moved 0.135 of its output's range from
    float32). Within one float16 ulp of onnx's reference over the widened values."""
    from modelkiln.ir.frontend_onnx import from_onnx
    from modelkiln.ir.passes import default_pipeline
    rng = np.random.default_rng(41)
    w = (rng.standard_normal((16, 32, 3, 3)) / 8).astype(np.float16)
    bn = [(rng.random(16) * 40 + 1).astype(np.float16), rng.standard_normal(16).astype(np.float16),
          rng.standard_normal(16).astype(np.float16), (rng.random(16) + 0.01).astype(np.float16)]
    names = ["gamma", "beta", "mean", "var"]
    inits = [numpy_helper.from_array(w, "w")] + [numpy_helper.from_array(v, n) for n, v in zip(names, bn)]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", *names], ["y"])]
    model = _model(nodes, [("x", TensorProto.FLOAT16, [1, 32, 12, 12])], [("y", TensorProto.FLOAT16)], inits)
    graph = default_pipeline()(from_onnx(model))
    [conv] = [n for n in graph.nodes if n.op == "Conv"]
    assert graph.constants[conv.inputs[1]].dtype == np.float32 and not any(n.op == "BatchNormalization"
                                                                          for n in graph.nodes)
    x = rng.standard_normal((1, 32, 12, 12)).astype(np.float16)
    got = _build(model).load().run({"x": x})["y"]
    wide = model.__deepcopy__()
    for init in wide.graph.initializer:
        init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float32), init.name))
    for vi in list(wide.graph.input) + list(wide.graph.output):
        vi.type.tensor_type.elem_type = TensorProto.FLOAT
    from onnx.reference import ReferenceEvaluator
    want = ReferenceEvaluator(wide).run(None, {"x": x.astype(np.float32)})[0].astype(np.float16)
    ulp = np.spacing(np.abs(want)).astype(np.float32)
    assert (np.abs(got.astype(np.float32) - want.astype(np.float32)) <= ulp).all()
