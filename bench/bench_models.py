"""Inference latency: Kiln against onnxruntime, side by side in one run, single thread.

    python bench/bench_models.py [--repeat 50] [--models resnet18,mlp_b1]

For every test model: Kiln's cold build time (no cache, local executor), Kiln's median
latency and onnxruntime's (both after warm-up, one thread, same inputs), and the ratio.
Prints a Markdown table (the one in the README).
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from modelkiln.orchestrator.api import build  # noqa: E402
from tests import model_zoo, transformer_zoo  # noqa: E402

# name -> () -> (model, inputs): the test zoo's models on random inputs, and a BERT-style
# encoder (4 layers, d=256, 128 tokens, a padded attention mask) as torch's dynamo exports it.
MODELS = {name: (lambda make=make: (lambda m: (m, model_zoo.random_inputs(m)))(make()))
          for name, make in model_zoo.ALL.items()}
MODELS["bert_encoder"] = lambda: transformer_zoo.bert_encoder("dynamo", seq=128, d=256, heads=4, layers=4,
                                                              vocab=8000, ffn=1024)


def ort_latency(model, inputs, warmup: int, repeat: int) -> float:
    import onnxruntime as ort
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    for _ in range(warmup):
        sess.run(None, inputs)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        sess.run(None, inputs)
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=50)
    args = ap.parse_args()
    import onnxruntime
    print(f"# {time.strftime('%Y-%m-%d')}, {cpu_name()}, {len(os.sched_getaffinity(0))} usable cores; "
          f"single-thread inference; onnxruntime {onnxruntime.__version__}\n")
    print("| model | kiln build (cold, s) | kernels | kiln ms | onnxruntime ms | kiln / ort |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in args.models.split(","):
        model, inputs = MODELS[name]()
        t0 = time.perf_counter()
        result = build(model, cache=None, progress=False)
        build_s = time.perf_counter() - t0
        module = result.load()
        got, want = module.run(inputs), model_zoo.onnxruntime_outputs(model, inputs)
        assert all(np.allclose(got[k], want[k], rtol=1e-3, atol=1e-4) for k in want), f"{name}: outputs differ"
        kiln_ms = module.benchmark(args.warmup, args.repeat, inputs)["median_ms"]
        ort_ms = ort_latency(model, inputs, args.warmup, args.repeat)
        print(f"| {name} | {build_s:.2f} | {result.report['totals']['kernels']} | {kiln_ms:.3f} | {ort_ms:.3f} | "
              f"{kiln_ms / ort_ms:.2f} |", flush=True)


if __name__ == "__main__":
    main()
