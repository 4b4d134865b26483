"""4-bit weight-only MatMul (com.microsoft.MatMulNBits, what int4 LLMs are made of): Kiln
running on the codes against the same layer as a float32 MatMul (the dequantized weight,
what Kiln built before it kept codes) and against onnxruntime's MatMulNBits.

    python bench/bench_matmul_nbits.py [--threads 1] [--rounds 3] [--target llvm]

Layers of a 7B-class decoder (K x N: attention 4096 x 4096, MLP 4096 x 11008 and back),
blocks of 32 with zero points (onnxruntime's MatMulNBitsQuantizer, asymmetric), at 1 row
(a decoding step), 4 rows and 128 rows (a prompt). Each is checked against onnxruntime,
then timed in interleaved rounds (the better median of each). Prints a Markdown table.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_models import cpu_name, host_isa, interleaved, ort_session  # noqa: E402
from modelkiln.orchestrator.api import build  # noqa: E402

LAYERS = {"attn_4096x4096": (4096, 4096), "mlp_up_4096x11008": (4096, 11008), "mlp_down_11008x4096": (11008, 4096)}
ROWS = (1, 4, 128)


def quantized_layer(k: int, n: int, rows: int):
    """A MatMul of random weights, quantized by onnxruntime's own tool to MatMulNBits."""
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization import QuantFormat
    from onnxruntime.quantization import matmul_nbits_quantizer as mq
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((k, n)).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    config = mq.DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=False, quant_format=QuantFormat.QOperator)
    quantizer = mq.MatMulNBitsQuantizer(model, algo_config=config)
    quantizer.process()
    return quantizer.model.model


def float_layer(weight: np.ndarray, rows: int):
    from onnx import TensorProto, helper, numpy_helper
    k = weight.shape[0]
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(weight, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def dequantized(nbits_model) -> np.ndarray:
    """The [K, N] float32 weight a MatMulNBits node's codes encode (4 bits, packed zero points)."""
    from onnx import numpy_helper
    node = nbits_model.graph.node[0]
    attrs = {a.name: a.i for a in node.attribute}
    k, n, block = attrs["K"], attrs["N"], attrs["block_size"]
    init = {i.name: numpy_helper.to_array(i) for i in nbits_model.graph.initializer}
    blocks = -(-k // block)
    packed = init[node.input[1]].reshape(n, blocks, block // 2)
    codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(n, blocks, block).astype(np.float32)
    zp_bytes = init[node.input[3]].reshape(n, -1)
    zp = np.stack([zp_bytes & 15, zp_bytes >> 4], axis=-1).reshape(n, -1)[:, :blocks].astype(np.float32)
    scales = init[node.input[2]].reshape(n, blocks, 1)
    w = (codes - zp[:, :, None]) * scales
    return np.ascontiguousarray(w.reshape(n, -1)[:, :k].T)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--target", default="llvm")
    parser.add_argument("--layers", default=",".join(LAYERS))
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    args = parser.parse_args()
    print(f"{cpu_name()} ({host_isa()}), {args.threads} thread(s), target {args.target}, better of {args.rounds} "
          "interleaved rounds, ms\n")
    print("| layer | rows | Kiln int4 | Kiln float32 | onnxruntime int4 | Kiln int4 / onnxruntime "
          "| weights int4 / float32 MB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in args.layers.split(","):
        k, n = LAYERS[name]
        for rows in map(int, args.rows.split(",")):
            nbits = quantized_layer(k, n, rows)
            dense = float_layer(dequantized(nbits), rows)
            x = np.random.default_rng(1).standard_normal((rows, k)).astype(np.float32)
            kiln = build(nbits, target=args.target, cache=None, progress=False).load(threads=args.threads)
            kiln_float = build(dense, target=args.target, cache=None, progress=False).load(threads=args.threads)
            ort = ort_session(nbits, args.threads)
            want = ort.run(None, {"x": x})[0]
            for module in (kiln, kiln_float):
                np.testing.assert_allclose(module.run({"x": x})["y"], want, rtol=1e-3, atol=1e-3)
            out = {"y": np.empty_like(want)}
            ms = interleaved({"int4": lambda: kiln.run({"x": x}, out=out),
                              "float": lambda: kiln_float.run({"x": x}, out=out),
                              "ort": lambda: ort.run(None, {"x": x})}, 2, args.repeat, args.rounds)
            mb = kiln.manifest.weights_bytes / 2 ** 20, kiln_float.manifest.weights_bytes / 2 ** 20
            print(f"| {name} | {rows} | {ms['int4']:.3f} | {ms['float']:.3f} | {ms['ort']:.3f} | "
                  f"{ms['int4'] / ms['ort']:.2f}x | {mb[0]:.1f} / {mb[1]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
