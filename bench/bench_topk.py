"""TopK on the lines models sort: a detector's pre-NMS candidates (the best 1000 of 8400
scores), an LLM's top-k sampling (50 of a 32000 or 128256 vocabulary), a classifier's top 5.
Kiln against onnxruntime and OpenVINO on the same model and inputs.

    python bench/bench_topk.py [--threads 1] [--rounds 3]

Kiln's values and indices are checked against onnxruntime's first. Times: ms, the better
median of interleaved rounds. Prints a Markdown table.
"""
from __future__ import annotations

import os
import sys

import numpy as np
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_models import beside_onnxruntime, interleaved, peer_table_args  # noqa: E402

# name: (input shape, k)
CASES = {"detector candidates": ((1, 8400), 1000), "LLM sampling, 32000 vocabulary": ((1, 32000), 50),
         "LLM sampling, 128256 vocabulary": ((1, 128256), 50), "batch of 8, 4 beams": ((32, 32000), 8),
         "classifier top 5": ((16, 1000), 5)}


def topk_model(shape, k: int):
    graph = helper.make_graph([helper.make_node("TopK", ["x", "k"], ["values", "indices"])], "topk",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                              [helper.make_tensor_value_info("values", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("indices", TensorProto.INT64, None)],
                              [numpy_helper.from_array(np.array([k], np.int64), "k")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def main() -> None:
    args = peer_table_args(__doc__)
    print("| TopK | shape | k | Kiln ms | onnxruntime ms | OpenVINO ms |")
    print("|---|---|---:|---:|---:|---:|")
    for name, (shape, k) in CASES.items():
        model = topk_model(shape, k)
        feeds = {"x": np.random.default_rng(0).standard_normal(shape).astype(np.float32)}
        got, want, runs, request = beside_onnxruntime(model, feeds, args.threads)
        if not (np.array_equal(got["values"], want[0]) and np.array_equal(got["indices"], want[1])):
            raise SystemExit(f"{name}: Kiln's values or indices differ from onnxruntime's")
        if request is not None:
            runs["openvino"] = lambda: request.infer(feeds)
        ms = interleaved(runs, warmup=5, repeat=50, rounds=args.rounds)
        ov_ms = f"{ms['openvino']:.3f}" if "openvino" in ms else "-"
        print(f"| {name} | {'x'.join(map(str, shape))} | {k} | {ms['kiln']:.3f} | {ms['onnxruntime']:.3f} | {ov_ms} |")


if __name__ == "__main__":
    main()
