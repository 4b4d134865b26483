"""Kiln's int8 on AMX's tile unit against its own VNNI and float32 kernels and the peers.

    python bench/bench_amx.py [--repeat 50] [--rounds 2] [--models resnet18_int8_qdq,...] [--no-models]

Runs on an AMX host only (Sapphire Rapids and later Xeons). Two tables, every runner in the
same interleaved rounds (these machines are noisy), the better median of each:

- GEMMs (MatMulInteger, u8 x s8 at 1 thread): Kiln on tiles (the host target), Kiln on VNNI
  (the host without AMX: "llvm -mattr=-amx-tile,-amx-int8"), Kiln float32 (MatMul) and
  onnxruntime int8 and float32; the tile unit's share of its peak: 2,048 int8 operations
  per cycle per core at the clock /proc/cpuinfo reports (a hypervisor's figure: the share
  is approximate).
- int8 models quantized by onnxruntime's tool (bench/bench_models.py's): Kiln on tiles and on
  VNNI, onnxruntime, OpenVINO (its default precision and f32), at 1 thread and at every
  usable core. Kiln's two builds must give identical outputs (both sum exactly in int32).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_models import (MODELS, THREADS, _product_model, cpu_name, interleaved, openvino_runner,  # noqa: E402
                                ort_session)
from modelkiln.artifacts.cpu_features import host_flags  # noqa: E402
from modelkiln.orchestrator.api import build  # noqa: E402

TILES = "llvm"
VNNI = "llvm -mattr=-amx-tile,-amx-int8,-amx-bf16"
GEMM_SHAPES = [(128, 768, 768), (128, 768, 3072), (512, 1024, 1024), (1, 4096, 4096)]
INT8_MODELS = ["resnet18_int8_qdq", "resnet18_int8_qoperator", "mobilenet_v2_int8_qdq", "regnety_400mf_int8_qdq",
               "bert_encoder_int8_dynamic"]
PEAK_OPS_PER_CYCLE = 2048  # int8 multiply-adds count 2 operations: 1,024 MACs per cycle per core


def clock_ghz() -> float:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("cpu MHz"):
                return float(line.split(":")[1]) / 1e3
    return float("nan")


def bench_gemms(args) -> None:
    ghz = clock_ghz()
    print(f"\n| GEMM m x k x n | kiln AMX ms | kiln VNNI ms | kiln fp32 ms | AMX over VNNI | AMX share of peak | "
          f"onnxruntime int8 ms | onnxruntime fp32 ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for m, k, n in GEMM_SHAPES:
        model8, inputs8 = _product_model(m, k, n, True)
        model32, inputs32 = _product_model(m, k, n, False)
        tiles = build(model8, target=TILES, cache=None, progress=False).load(threads=1)
        vnni = build(model8, target=VNNI, cache=None, progress=False).load(threads=1)
        fp32 = build(model32, target=TILES, cache=None, progress=False).load(threads=1)
        assert np.array_equal(tiles.run(inputs8)["y"], vnni.run(inputs8)["y"]), "AMX and VNNI GEMMs differ"
        ort8, ort32 = ort_session(model8), ort_session(model32)
        ms = interleaved({"amx": lambda: tiles.run(inputs8), "vnni": lambda: vnni.run(inputs8),
                          "fp32": lambda: fp32.run(inputs32), "ort8": lambda: ort8.run(None, inputs8),
                          "ort32": lambda: ort32.run(None, inputs32)}, args.warmup, args.repeat, args.rounds)
        share = 2 * m * k * n / (ms["amx"] * 1e-3) / (PEAK_OPS_PER_CYCLE * ghz * 1e9)
        print(f"| {m} x {k} x {n} | {ms['amx']:.3f} | {ms['vnni']:.3f} | {ms['fp32']:.3f} | "
              f"{ms['vnni'] / ms['amx']:.2f}x | {share:.0%} | {ms['ort8']:.3f} | {ms['ort32']:.3f} |", flush=True)


def bench_model(name: str, args) -> None:
    model, inputs = MODELS[name]()
    t0 = time.perf_counter()
    tiles = build(model, target=TILES, cache=None, progress=False)
    build_s = time.perf_counter() - t0
    vnni = build(model, target=VNNI, cache=None, progress=False)
    runs = {}
    for threads in (1, THREADS):
        a, b = tiles.load(threads=threads), vnni.load(threads=threads)
        got, want = a.run(inputs), b.run(inputs)
        for key in want:
            assert np.array_equal(got[key], want[key]), f"{name}: AMX and VNNI outputs differ ({key})"
        sess = ort_session(model, threads)
        runs[f"amx {threads}t"] = lambda a=a: a.run(inputs)
        runs[f"vnni {threads}t"] = lambda b=b: b.run(inputs)
        runs[f"ort {threads}t"] = lambda sess=sess: sess.run(None, inputs)
        for precision in ("default", "f32"):
            ov = openvino_runner(model, threads, inputs, f32=precision == "f32")
            if ov is not None:
                runs[f"ov {precision} {threads}t"] = lambda ov=ov: ov(inputs)
    ms = interleaved(runs, args.warmup, args.repeat, args.rounds)
    cell = lambda k: f"{ms[k]:.3f}" if k in ms else "n/a"  # noqa: E731
    cols = []
    for t in (1, THREADS):
        cols += [cell(f"amx {t}t"), cell(f"vnni {t}t"), f"{ms[f'vnni {t}t'] / ms[f'amx {t}t']:.2f}x",
                 cell(f"ort {t}t"), cell(f"ov default {t}t"), cell(f"ov f32 {t}t")]
    print(f"| {name} | {build_s:.2f} | " + " | ".join(cols) + " |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(INT8_MODELS))
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-models", action="store_true")
    ap.add_argument("--no-gemm", action="store_true")
    args = ap.parse_args()
    flags = host_flags() or set()
    if not {"amx_tile", "amx_int8"} <= flags:
        sys.exit("bench_amx: this host has no AMX-INT8 (no amx_tile/amx_int8 in /proc/cpuinfo)")
    import onnxruntime
    print(f"# {time.strftime('%Y-%m-%d')}, {cpu_name()} (AVX-512 VNNI, AMX-INT8), {THREADS} usable cores, "
          f"{clock_ghz():.2f} GHz reported; onnxruntime {onnxruntime.__version__}; ms, better median of "
          f"{args.rounds} interleaved rounds")
    if not args.no_gemm:
        bench_gemms(args)
    if not args.no_models:
        print(f"\n| model | kiln build (cold, s) | " + " | ".join(
            f"kiln AMX {t}t | kiln VNNI {t}t | AMX over VNNI {t}t | onnxruntime {t}t | OpenVINO default {t}t | "
            f"OpenVINO f32 {t}t" for t in (1, THREADS)) + " |")
        print("|---|---:|" + "---:|" * 12)
        for name in args.models.split(","):
            bench_model(name, args)


if __name__ == "__main__":
    main()
