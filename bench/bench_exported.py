"""Real architectures as exported by torch.onnx: does Kiln build them, match onnxruntime, and
run them as fast? One run, a Markdown table.

    python bench/bench_exported.py [--models llama,xlnet] [--rounds 2] [--repeat 20] [--dir DIR] [--tolerance 1e-4]
    python bench/bench_exported.py --models deployed --openvino   (the architectures a user would deploy, beside
        onnxruntime and OpenVINO: Kiln over the better of the two)
    python bench/bench_exported.py --dynamic-images [--models ssdlite320,...]   (torchvision's detectors exported
        with a dynamic image size: one build for 64..1024 each, checked against onnxruntime at five sizes)

Each model of bench/exported_zoo.py is exported once into DIR (default
~/.cache/kiln-exported), by a child process (torch, torchvision, timm and transformers are
needed for that alone: `pip install torch torchvision timm transformers onnxscript`). Then,
per model: Kiln's cold build (no store), its outputs against onnxruntime's on the same
random inputs (the largest difference over the largest value, per output, the worst listed;
a detector's rows matched by their boxes, since near-equal scores may come out in either
order, compared where the boxes agree: the table says how many do where not all),
and both at 1 thread in interleaved rounds (median of `repeat` runs, the better round).
A model Kiln refuses or gets wrong is listed with what went wrong; the run goes on.
"""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench_models import cpu_name, host_isa, interleaved, openvino_runner  # noqa: E402
from exported_zoo import ALL, DEPLOYED, DETECTORS, HELD_OUT, MODELS  # noqa: E402

TOLERANCE = 1e-4  # largest difference over the largest value: float32 kernels summing in other orders


def exported(name: str, folder: str, dynamic: bool = False) -> str:
    """The model's file, exported first if it is not there yet."""
    where = os.path.join(folder, name + ("-dynamic" if dynamic else ""))
    path = os.path.join(where, "model.onnx")
    if not os.path.exists(path):
        done = subprocess.run([sys.executable, os.path.join(HERE, "exported_zoo.py"), name, where,
                               *(["--dynamic"] if dynamic else [])], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"export failed: {done.stderr.strip().splitlines()[-1] if done.stderr else ''}")
    return path


def random_inputs(session, images: bool = False) -> dict:
    """Token ids in [0, 100), floats standard normal (in [0, 1) with `images`)."""
    rng = np.random.default_rng(0)
    feeds = {}
    for i in session.get_inputs():
        shape = [d if isinstance(d, int) else 1 for d in i.shape]
        feeds[i.name] = (rng.integers(0, 100, shape).astype(np.int64) if "int64" in i.type
                         else rng.random(shape, dtype=np.float32) if images
                         else rng.standard_normal(shape).astype(np.float32))
    return feeds


def _matched_order(got: np.ndarray, want: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Kiln's rows in onnxruntime's order: each of onnxruntime's rows (a detection's box) takes
    the nearest row of Kiln's not yet taken. Returns (that order, whether each row's box
    agrees within TOLERANCE of the largest coordinate)."""
    g, w = got.reshape(len(got), -1).astype(np.float64), want.reshape(len(want), -1).astype(np.float64)
    distance = np.abs(g[None, :, :] - w[:, None, :]).max(axis=2)  # (onnxruntime's row, Kiln's row)
    order, free = np.zeros(len(w), np.int64), np.ones(len(g), bool)
    for i in range(len(w)):
        j = int(np.argmin(np.where(free, distance[i], np.inf)))
        order[i], free[j] = j, False
    scale = max(float(np.max(np.abs(w))) if w.size else 0.0, 1.0)
    return order, distance[np.arange(len(w)), order] <= TOLERANCE * scale


def worst_difference(got: dict, want: list, names: list, detections: bool = False) -> tuple[float, str]:
    """(the largest difference over the largest value, inf where shapes or integers differ;
    a note). A detector's rows (`detections`) are matched by their boxes, its first output:
    two detections whose scores differ in the 6th digit may come out in either order. Where
    some boxes disagree, the note says how many agree and how far apart the rest of their
    outputs are."""
    order = agree = None
    if detections and want and want[0].ndim == 2 and got[names[0]].shape == want[0].shape:
        order, agree = _matched_order(got[names[0]], want[0])
    worst, on_agreeing = 0.0, 0.0
    for name, w in zip(names, want):
        g = got[name]
        if g.shape != w.shape:
            return math.inf, f"{name}: shape {g.shape}, onnxruntime's {w.shape}"
        rows = order is not None and g.ndim and len(g) == len(order)
        g = g[order] if rows else g
        if w.size and w.dtype.kind == "f":
            scale = float(np.max(np.abs(w))) or 1.0
            error = np.abs(g.astype(np.float64) - w).reshape(len(w), -1).max(axis=1) / scale if w.ndim else \
                np.abs(np.float64(g) - w).reshape(1) / scale
            worst = max(worst, float(error.max()))
            if rows and agree.any():
                on_agreeing = max(on_agreeing, float(error[agree].max()))
        elif not np.array_equal(g, w):
            if not rows or np.array_equal(g[agree], w[agree]):
                return math.inf, f"{name}: integers differ"
            worst = math.inf
    note = "" if agree is None or agree.all() else \
        f"{int(agree.sum())} of {len(agree)} detections agree, within {on_agreeing:.1e} there"
    return worst, note


def bench(name: str, args) -> tuple | str:
    import onnxruntime as ort
    from modelkiln.orchestrator.api import build
    path = exported(name, args.dir)
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = 1, 1
    session = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    feeds = random_inputs(session, images=name in DETECTORS)
    want = session.run(None, feeds)
    t0 = time.perf_counter()
    result = build(path, cache=None, progress=False)  # (cold: every kernel compiled)
    seconds = time.perf_counter() - t0
    module = result.load(1)
    diff, note = worst_difference(module.run(feeds), want, [o.name for o in session.get_outputs()],
                                  name in DETECTORS)
    if not diff <= args.tolerance:
        return f"outputs differ from onnxruntime's by {diff:.2g} of their largest value{f' ({note})' if note else ''}"
    runs = {"kiln": lambda: module.run(feeds), "ort": lambda: session.run(None, feeds)}
    openvino = openvino_runner(path, 1, feeds) if args.openvino else None
    if openvino is not None:
        runs["ov"] = lambda: openvino(feeds)
    times = interleaved(runs, warmup=3, repeat=args.repeat, rounds=args.rounds)
    return seconds, result.report["totals"]["kernels"], diff, note, times["kiln"], times["ort"], times.get("ov")


# --dynamic-images: a detector exported with its image's height and width dynamic, built once
# for every size in IMAGE_BOUNDS, checked at each of IMAGE_SIZES.
IMAGE_BOUNDS = {"height": (64, 1024), "width": (64, 1024)}
IMAGE_SIZES = ((320, 320), (240, 400), (500, 333), (97, 1000), (1024, 64))


def check_dynamic_images(name: str, args) -> str:
    """One build of the dynamic export; a table row: its build, arena, worst difference."""
    import onnxruntime as ort
    from modelkiln.orchestrator.api import build
    path = exported(name, args.dir, dynamic=True)
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    t0 = time.perf_counter()
    module = build(path, cache=None, progress=False, dims=IMAGE_BOUNDS).load()
    seconds, worst, notes = time.perf_counter() - t0, 0.0, []
    rng = np.random.default_rng(0)
    for h, w in IMAGE_SIZES:
        feeds = {"x": rng.random((3, h, w), dtype=np.float32)}
        diff, note = worst_difference(module.run(feeds), session.run(None, feeds),
                                      [o.name for o in session.get_outputs()], detections=True)
        worst = max(worst, diff)
        notes.append(f"{h}x{w}: {note}" if note else "")
    notes = "; ".join(n for n in notes if n)
    return f"| {name} | {seconds:.1f} | {module.manifest.arena_bytes / 2**20:.0f} | {worst:.1e}" \
        f"{f' ({notes})' if notes else ''} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", help="comma-separated names (default: the tuned-for set), 'heldout': the "
                                     "architectures tried after it (exported_zoo.HELD_OUT), or 'deployed': the "
                                     "ones a user would deploy (exported_zoo.DEPLOYED)")
    ap.add_argument("--openvino", action="store_true",
                    help="OpenVINO too (float32, 1 thread): Kiln over the better of the two peers")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--dir", default=os.path.join(os.path.expanduser("~"), ".cache", "kiln-exported"))
    ap.add_argument("--tolerance", type=float, default=TOLERANCE,
                    help="the largest difference (over the largest value) timed as a match; the table shows it either "
                         f"way (default {TOLERANCE})")
    ap.add_argument("--dynamic-images", action="store_true",
                    help="the detectors exported with a dynamic image size: one build each, checked at several sizes")
    args = ap.parse_args()
    groups = {"heldout": list(HELD_OUT), "deployed": DEPLOYED}
    names = groups.get(args.models) or (args.models.split(",") if args.models else list(MODELS))
    unknown = [n for n in names if n not in ALL]
    if unknown:
        sys.exit(f"unknown models: {', '.join(unknown)} (known: {', '.join(ALL)})")
    import onnxruntime
    if args.dynamic_images:
        print(f"# {time.strftime('%Y-%m-%d')}, {cpu_name()} ({host_isa()}); onnxruntime {onnxruntime.__version__}; "
              f"dims {IMAGE_BOUNDS}; checked at {', '.join(f'{h}x{w}' for h, w in IMAGE_SIZES)}\n")
        print("| model | kiln build (s) | arena at the bounds (MiB) | worst difference |\n|---|---:|---:|---:|")
        for name in (n for n in names if n in DETECTORS):
            try:
                print(check_dynamic_images(name, args), flush=True)
            except Exception as e:  # (refused, or a failed export: listed, the run goes on)
                print(f"| {name} | - | - | {type(e).__name__}: {str(e).splitlines()[0][:200]} |", flush=True)
        return
    print(f"# {time.strftime('%Y-%m-%d')}, {cpu_name()} ({host_isa()}), 1 thread; onnxruntime "
          f"{onnxruntime.__version__}; rounds {args.rounds}, median of {args.repeat} runs\n")
    peers = "onnxruntime and OpenVINO" if args.openvino else "onnxruntime"
    print("| model | exporter | kiln build (s) | kernels | max difference | kiln ms | onnxruntime ms |"
          + (" OpenVINO ms | kiln / best |" if args.openvino else " kiln / onnxruntime |"))
    print("|---|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if args.openvino else ""))
    ratios, failed = [], []
    for name in names:
        try:
            outcome = bench(name, args)
        except Exception as e:  # (a refused model or a failed export: listed, the run goes on)
            outcome = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        if isinstance(outcome, str):
            failed.append((name, outcome))
            print(f"| {name} | {ALL[name][1]} | - | - | - | - | -{' | -' if args.openvino else ''} | {outcome} |",
                  flush=True)
            continue
        seconds, kernels, diff, note, kiln_ms, ort_ms, ov_ms = outcome
        best = min(ort_ms, ov_ms or math.inf)  # (OpenVINO's n/a where it cannot run the model)
        ratios.append(kiln_ms / best)
        ov = (f" {ov_ms:.3f} |" if ov_ms else " n/a |") if args.openvino else ""
        print(f"| {name} | {ALL[name][1]} | {seconds:.1f} | {kernels} | {diff:.1e}{f' ({note})' if note else ''} "
              f"| {kiln_ms:.3f} | {ort_ms:.3f} |{ov} {kiln_ms / best:.2f} |", flush=True)
    if ratios:
        print(f"\n{len(ratios)} of {len(names)} built and within {args.tolerance:g}; geometric mean of kiln / "
              f"{'the better of ' if args.openvino else ''}{peers} "
              f"{math.exp(sum(map(math.log, ratios)) / len(ratios)):.2f}; above 1.05: "
              f"{sum(r > 1.05 for r in ratios)}, above 1.10: {sum(r > 1.10 for r in ratios)}")
    for name, why in failed:
        print(f"- {name}: {why}")


if __name__ == "__main__":
    main()
