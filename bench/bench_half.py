"""Models stored in float16 beside their float32 build, and beside onnxruntime running the same
float16 file, in one interleaved run.

    python bench/bench_half.py [--models bert_encoder,resnet18,...] [--repeat 30] [--rounds 2]

Each model of bench_models' zoo is converted as users convert theirs (onnxconverter-common's
convert_float_to_float16: float16 weights, activations, inputs and outputs). For each: median
latency at 1 thread and at every usable core of Kiln's float32 build, Kiln's build of the
float16 file and onnxruntime on the float16 file; the float16 outputs' largest difference
from the float32 build's, relative to its largest magnitude (Kiln's and onnxruntime's); and
Kiln float16 over its float32 build and over onnxruntime. (T5's block is left out: the
converter breaks its relative-position buckets, and onnxruntime refuses the file too.)
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_models import MODELS, THREADS, cpu_name, host_isa, interleaved, ort_session  # noqa: E402
from modelkiln.orchestrator.api import build  # noqa: E402

DEFAULT_MODELS = "bert_encoder,gpt2_block,vit_encoder,resnet18,resnet50,mobilenet_v2,mobilenet_v3,unet"


def to_float16(model):
    from onnxconverter_common import float16
    with warnings.catch_warnings():  # (it warns where a constant is out of float16's range: clamped, intended)
        warnings.simplefilter("ignore", UserWarning)
        return float16.convert_float_to_float16(model)


def difference(got: dict, want: dict) -> float:
    return max(float(np.abs(np.asarray(g, np.float64) - w).max() / max(np.abs(w).max(), 1e-30))
               for g, w in zip(got.values(), want.values()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=DEFAULT_MODELS)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    import onnxruntime
    print(f"# {time.strftime('%Y-%m-%d')}, {cpu_name()} ({host_isa()}), {THREADS} usable cores; onnxruntime "
          f"{onnxruntime.__version__}; ms, better median of {args.rounds} interleaved rounds; difference: largest "
          "|float16 output - Kiln float32| / largest |Kiln float32|\n")
    print("| model | threads | kiln fp32 | kiln fp16 file | onnxruntime fp16 file | kiln fp16 / fp32 | "
          "kiln fp16 / onnxruntime | kiln difference | onnxruntime difference |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.models.split(","):
        model, inputs = MODELS[name]()
        half = to_float16(model)
        half_inputs = {k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in inputs.items()}
        fp32, fp16 = build(model, cache=None, progress=False), build(half, cache=None, progress=False)
        want = {k: np.asarray(v, np.float64) for k, v in fp32.load(threads=1).run(inputs).items()}
        for threads in sorted({1, THREADS}):
            m32, m16, sess = fp32.load(threads=threads), fp16.load(threads=threads), ort_session(half, threads)
            ort_out = dict(zip(want, sess.run(None, half_inputs)))
            runs = {"fp32": lambda: m32.run(inputs), "fp16": lambda: m16.run(half_inputs),
                    "ort": lambda: sess.run(None, half_inputs)}
            ms = interleaved(runs, 10, args.repeat, args.rounds)
            print(f"| {name} | {threads} | {ms['fp32']:.3f} | {ms['fp16']:.3f} | {ms['ort']:.3f} | "
                  f"{ms['fp16'] / ms['fp32']:.2f} | {ms['fp16'] / ms['ort']:.2f} | "
                  f"{difference(m16.run(half_inputs), want):.4f} | {difference(ort_out, want):.4f} |", flush=True)


if __name__ == "__main__":
    main()
