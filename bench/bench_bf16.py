"""precision="bf16" beside float32, and beside OpenVINO at its default precision (bf16 on CPUs
with AVX512-BF16 or AMX) and at f32, in one interleaved run.

    python bench/bench_bf16.py [--models bert_encoder,gpt2_block,...] [--repeat 30] [--rounds 2]

For each model: median latency at 1 thread of Kiln fp32, Kiln bf16, OpenVINO default and
f32, and the largest output difference of each reduced-precision runner from Kiln's float32,
relative to the output's largest magnitude. MatMul and Gemm take bf16 in Kiln, and on AMX-BF16
convs too (depthwise convs stay float32).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_models import MODELS, cpu_name, host_isa, interleaved, openvino_runner  # noqa: E402
from modelkiln.orchestrator.api import build  # noqa: E402


def _difference(got: dict, want: dict) -> float:
    return max(float(np.abs(np.asarray(g, np.float64) - w).max() / max(np.abs(w).max(), 1e-30))
               for g, w in zip(got.values(), want.values()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="bert_encoder,gpt2_block,t5_block,vit_encoder,resnet18,resnet50,"
                    "densenet121,convnext_stage,mobilenet_v3")
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    print(f"# {time.strftime('%Y-%m-%d')}, {cpu_name()} ({host_isa()}), 1 thread; ms, better median of "
          f"{args.rounds} interleaved rounds; difference: largest |output - Kiln fp32| / largest |Kiln fp32|\n")
    print("| model | kiln fp32 | kiln bf16 | bf16 speedup | kiln bf16 difference | OpenVINO default | "
          "OpenVINO default difference | OpenVINO f32 | kiln bf16 / OpenVINO default |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.models.split(","):
        model, inputs = MODELS[name]()
        fp32 = build(model, cache=None, progress=False).load(threads=1)
        bf16 = build(model, cache=None, progress=False, precision="bf16").load(threads=1)
        want = {k: np.asarray(v, np.float64) for k, v in fp32.run(inputs).items()}
        runs = {"fp32": lambda: fp32.run(inputs), "bf16": lambda: bf16.run(inputs)}
        ov_default, ov_f32 = openvino_runner(model, 1, inputs, f32=False), openvino_runner(model, 1, inputs)
        ov_diff = "n/a"
        if ov_default is not None:
            runs["ov"] = lambda: ov_default(inputs)
            ov_diff = f"{_difference(dict(zip(want, ov_default(inputs).values())), want):.4f}"
        if ov_f32 is not None:
            runs["ov32"] = lambda: ov_f32(inputs)
        ms = interleaved(runs, 10, args.repeat, args.rounds)
        cell = lambda k: f"{ms[k]:.3f}" if k in ms else "n/a"  # noqa: E731
        ratio = f"{ms['bf16'] / ms['ov']:.2f}" if "ov" in ms else "n/a"
        print(f"| {name} | {ms['fp32']:.3f} | {ms['bf16']:.3f} | {ms['fp32'] / ms['bf16']:.2f}x | "
              f"{_difference(bf16.run(inputs), want):.4f} | {cell('ov')} | {ov_diff} | {cell('ov32')} | {ratio} |",
              flush=True)


if __name__ == "__main__":
    main()
