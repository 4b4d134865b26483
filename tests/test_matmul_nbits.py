"""onnxruntime's com.microsoft.MatMulNBits (block-quantized weights, what int4 LLMs are made
of) and its QDQ spelling (DequantizeLinear of int4 blocks, then MatMul), against onnxruntime:
models written by onnxruntime's own `MatMulNBitsQuantizer`, and nodes packed here from the
op's definition for what the quantizer does not write (2 and 8 bits, float zero points, a
bias, K not a whole number of blocks); 4-bit codes kept as codes on both of their paths
(few rows, more rows in chunks, a row count known at run time)."""
import logging

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from modelkiln.ir.graph import UnsupportedError
from modelkiln.orchestrator.api import build
from tests.conftest import shared_cache


def _matmul_model(k: int, n: int, seed: int):
    w = numpy_helper.from_array(np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _quantized_by_onnxruntime(symmetric: bool, quant_format):
    from onnxruntime.quantization import matmul_nbits_quantizer as mq
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    config = mq.DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=symmetric, quant_format=quant_format)
    quantizer = mq.MatMulNBitsQuantizer(_matmul_model(128, 48, seed=int(symmetric)), algo_config=config)
    quantizer.process()
    return quantizer.model.model


def _onnxruntime(model, feeds, optimize=True):
    options = ort.SessionOptions()
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def _kiln(model, feeds, executor):
    return build(model, executor=executor, cache=shared_cache(), progress=False).load().run(feeds)["y"]


@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "zero-points"])
def test_onnxruntimes_quantizer_output(symmetric, executor):
    """MatMulNBits as onnxruntime's quantizer writes it (4 bits, blocks of 32, packed zero
    points where asymmetric)."""
    from onnxruntime.quantization import QuantFormat
    model = _quantized_by_onnxruntime(symmetric, QuantFormat.QOperator)
    assert [n.op_type for n in model.graph.node] == ["MatMulNBits"]
    x = np.random.default_rng(7).standard_normal((2, 3, 128)).astype(np.float32)
    np.testing.assert_allclose(_kiln(model, {"x": x}, executor), _onnxruntime(model, {"x": x}), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "zero-points"])
def test_onnxruntimes_quantizer_qdq_output(symmetric, executor):
    """The quantizer's QDQ format: DequantizeLinear of an int4 (uint4 with zero points)
    [K, N] weight with a scale a block of 32 rows, then MatMul. onnxruntime's optimized
    session fuses the pair into a kernel that rounds A to 8 bits (0.2 off here); with its
    optimizations off it computes the ops as written, which is the oracle."""
    from onnxruntime.quantization import QuantFormat
    model = _quantized_by_onnxruntime(symmetric, QuantFormat.QDQ)
    weight = [i for i in model.graph.initializer if i.dims[0] == 128][0]
    assert weight.data_type == (TensorProto.INT4 if symmetric else TensorProto.UINT4)
    x = np.random.default_rng(8).standard_normal((2, 3, 128)).astype(np.float32)
    want = _onnxruntime(model, {"x": x}, optimize=False)
    result = build(model, executor=executor, cache=None, progress=False)
    np.testing.assert_allclose(result.load().run({"x": x})["y"], want, rtol=1e-5, atol=1e-4)
    # (the pair runs as MatMulNBits on the codes: ir/passes/weight_only_blocks.py)
    assert [op for call in result.lowered.calls for op in call.ops] == ["com.microsoft.MatMulNBits"]
    assert result.load().manifest.weights_bytes < 128 * 48 * 4 / 2  # (float32: 24 KiB)


def test_a_dequantized_weight_read_elsewhere_stays_float(executor):
    """Where the dequantized weight is also a graph output, the pair stays as written (the
    weight folded to float32), and both outputs match."""
    from onnxruntime.quantization import QuantFormat
    model = _quantized_by_onnxruntime(False, QuantFormat.QDQ)
    dq = next(n for n in model.graph.node if n.op_type == "DequantizeLinear")
    model.graph.output.append(helper.make_tensor_value_info(dq.output[0], TensorProto.FLOAT, None))
    x = np.random.default_rng(13).standard_normal((2, 3, 128)).astype(np.float32)
    result = build(model, executor=executor, cache=None, progress=False)
    assert "com.microsoft.MatMulNBits" not in [op for call in result.lowered.calls for op in call.ops]
    got = result.load().run({"x": x})
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    want = session.run(None, {"x": x})
    np.testing.assert_allclose(got["y"], want[0], rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(got[dq.output[0]], want[1])


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint8 codes [..., count] packed lowest bits first, `8 // bits` a byte (count a whole
    number of bytes' worth)."""
    per_byte = 8 // bits
    grouped = codes.reshape(*codes.shape[:-1], -1, per_byte).astype(np.uint16)
    return np.sum(grouped << (np.arange(per_byte) * bits), axis=-1).astype(np.uint8)


def _nbits_model(k, n, bits, block, zero_points: str, bias: bool, float_type=np.float32, seed=0, a_shape=(5,),
                 then_relu=False):
    """A MatMulNBits node with random codes (zero_points "none", "packed" or "float"), A of
    shape a_shape + [K]; then_relu: a Relu after it (fused into its kernel)."""
    rng = np.random.default_rng(seed)
    blocks = -(-k // block)
    codes = rng.integers(0, 1 << bits, (n, blocks, block)).astype(np.uint8)
    scales = rng.uniform(0.01, 0.1, (n, blocks)).astype(float_type)
    inits = [numpy_helper.from_array(_pack(codes, bits), "b"), numpy_helper.from_array(scales.ravel(), "scales")]
    inputs = ["x", "b", "scales"]
    if zero_points == "packed":
        zp = rng.integers(0, 1 << bits, (n, blocks)).astype(np.uint8)
        per_byte = 8 // bits
        padded = np.zeros((n, -(-blocks // per_byte) * per_byte), np.uint8)
        padded[:, :blocks] = zp
        inits.append(numpy_helper.from_array(_pack(padded, bits).ravel(), "zp"))
        inputs.append("zp")
    elif zero_points == "float":
        inits.append(numpy_helper.from_array(rng.uniform(0, (1 << bits) - 1, (n, blocks)).astype(float_type), "zp"))
        inputs.append("zp")
    if bias:
        inputs += [""] * (5 - len(inputs)) + ["bias"]
        inits.append(numpy_helper.from_array(rng.standard_normal(n).astype(float_type), "bias"))
    elem = TensorProto.FLOAT if float_type == np.float32 else TensorProto.FLOAT16
    nodes = [helper.make_node("MatMulNBits", inputs, ["y"], domain="com.microsoft", K=k, N=n, bits=bits,
                              block_size=block)]
    if then_relu:
        nodes = [helper.make_node("MatMulNBits", inputs, ["p"], domain="com.microsoft", K=k, N=n, bits=bits,
                                  block_size=block), helper.make_node("Relu", ["p"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", elem, [*a_shape, k])],
                              [helper.make_tensor_value_info("y", elem, None)], inits)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


@pytest.mark.parametrize("k,bits,block,zero_points,bias", [
    (100, 4, 32, "packed", True),  # the last block only partly used: dequantized when built
    (96, 4, 16, "float", False),   # codes kept
    (100, 8, 32, "packed", False),
    (100, 8, 64, "none", True),
    (100, 2, 32, "packed", False),
])
def test_packed_by_definition(k, bits, block, zero_points, bias, executor):
    model = _nbits_model(k, 24, bits, block, zero_points, bias)
    x = np.random.default_rng(9).standard_normal((5, k)).astype(np.float32)
    np.testing.assert_allclose(_kiln(model, {"x": x}, executor), _onnxruntime(model, {"x": x}), rtol=1e-5, atol=1e-4)


def test_float16(executor):
    model = _nbits_model(64, 16, 4, 32, "packed", True, float_type=np.float16)
    x = np.random.default_rng(10).standard_normal((5, 64)).astype(np.float16)
    got, want = _kiln(model, {"x": x}, executor), _onnxruntime(model, {"x": x})
    assert got.dtype == want.dtype == np.float16
    # Kiln sums in float32 and rounds once; onnxruntime's float16 kernel rounds along the way.
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=1e-2, atol=1e-2)


def test_unsupported_forms_are_refused_by_name():
    model = _nbits_model(64, 16, 4, 32, "none", False)
    model.graph.node[0].input.extend(["", "g_idx"])
    model.graph.initializer.append(numpy_helper.from_array(np.arange(64, dtype=np.int32) // 32, "g_idx"))
    with pytest.raises(UnsupportedError, match="MatMulNBits.*g_idx"):
        build(model, executor="inprocess", cache=None, progress=False)
    model = _nbits_model(64, 16, 4, 32, "none", False)
    b = model.graph.initializer[0]
    model.graph.input.append(helper.make_tensor_value_info("b", TensorProto.UINT8, list(b.dims)))
    del model.graph.initializer[0]
    with pytest.raises(UnsupportedError, match="input 'b' \\(B\\) must be known at compile time"):
        build(model, executor="inprocess", cache=None, progress=False)


# ---- 4-bit codes kept as codes (ir/lower/matmul_nbits.py) ---------------------------------------

@pytest.mark.parametrize("target", ["llvm", "x86-64-v3"])
@pytest.mark.parametrize("rows", [1, 3, 5, 40])
def test_codes_kept_few_and_many_rows(rows, target, executor):
    """A decoding step's few rows run on the codes (1, 3), more on panels dequantized per call
    (5, 40); N=80 ends inside a panel; the bias and a Relu are the kernel's epilogue. For
    the host's vector width and AVX2's (its panels are half as wide)."""
    model = _nbits_model(256, 80, 4, 32, "packed", True, seed=rows, a_shape=(rows,), then_relu=True)
    x = np.random.default_rng(rows).standard_normal((rows, 256)).astype(np.float32)
    module = build(model, executor=executor, cache=shared_cache(), progress=False, target=target).load()
    got = module.run({"x": x})["y"]
    np.testing.assert_allclose(got, _onnxruntime(model, {"x": x}), rtol=1e-5, atol=1e-4)
    assert module.manifest.weights_bytes < 256 * 80 * 4 / 4  # half a byte a weight, and the block tables


@pytest.mark.parametrize("limit", ["columns", "bytes"])
def test_codes_kept_over_columns_in_chunks(limit, monkeypatch, executor):
    """More rows dequantize a chunk of columns at a time: three chunks, the last one short,
    where the chunk's columns or its bytes (40 columns of K = 64 floats: 32, whole panels)
    are the limit."""
    from modelkiln.ir.lower import matmul_nbits
    if limit == "columns":
        monkeypatch.setattr(matmul_nbits, "CHUNK_COLUMNS", 32)
    else:
        monkeypatch.setattr(matmul_nbits, "CHUNK_BYTES", 4 * 64 * 40)
    model = _nbits_model(64, 80, 4, 16, "none", True, a_shape=(2, 9))
    x = np.random.default_rng(12).standard_normal((2, 9, 64)).astype(np.float32)
    got = build(model, executor="inprocess", cache=shared_cache(), progress=False).load().run({"x": x})["y"]
    np.testing.assert_allclose(got, _onnxruntime(model, {"x": x}), rtol=1e-5, atol=1e-4)


def test_codes_kept_over_rows_known_at_run_time(executor):
    """A [batch, seq, K] input with seq bounded, as a decoder with a KV cache has it: one build
    takes the decoding step's path (seq 1) and the prompt's (seq 37) as each call's rows say."""
    model = _nbits_model(128, 48, 4, 32, "packed", False, a_shape=(1, "seq"))
    module = build(model, executor=executor, cache=None, progress=False, dims={"seq": (1, 64)}).load()
    for seq in (1, 2, 3, 4, 5, 37):
        x = np.random.default_rng(seq).standard_normal((1, seq, 128)).astype(np.float32)
        got = module.run({"x": x})["y"]
        np.testing.assert_allclose(got, _onnxruntime(model, {"x": x}), rtol=1e-5, atol=1e-4, err_msg=f"seq {seq}")


def test_an_int4_decoder_generates_onnxruntimes_tokens(executor):
    """A GPT-2-style decoder with a KV cache, every MatMul with constant weights quantized by
    onnxruntime's MatMulNBitsQuantizer: one build (batch, seq and past symbolic) generates
    greedily from a prompt, its cache in place, as onnxruntime does on the same model."""
    import json

    from onnxruntime.quantization import QuantFormat
    from onnxruntime.quantization import matmul_nbits_quantizer as mq

    from tests import dynamic_zoo, model_zoo
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    model, info = dynamic_zoo.gpt2_decoder_dynamic(positions="range")
    config = mq.DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=False, quant_format=QuantFormat.QOperator)
    quantizer = mq.MatMulNBitsQuantizer(model, algo_config=config)
    quantizer.process()
    model = quantizer.model.model
    assert sum(n.op_type == "MatMulNBits" for n in model.graph.node) == 4 * info["layers"] + 1
    result = build(model, dims={"batch": (1, 2), "seq": (1, 16), "past": (0, 60)}, executor=executor, cache=None,
                   progress=False)
    ops = [op for call in json.loads(result.files["manifest.json"])["calls"] for op in call["ops"]]
    assert ops.count("com.microsoft.MatMulNBits") == 4 * info["layers"] + 1  # (all kept as codes)
    module = result.load()
    prompt = [5, 17, 3, 40, 11]
    want_tokens, want_logits = dynamic_zoo.greedy_tokens(lambda f: model_zoo.onnxruntime_outputs(model, f), info,
                                                         prompt, 16)
    cache = module.new_cache()
    got_tokens, got_logits = dynamic_zoo.greedy_tokens(lambda f: module.run(f, cache=cache), info, prompt, 16,
                                                       feed_past=False)
    assert got_tokens == want_tokens
    for step, (got, want) in enumerate(zip(got_logits, want_logits)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"step {step}")
