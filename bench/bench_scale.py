"""The build system at scale: cold builds beside TVM and IREE, a batch of CNNs on 1 and 2
workers and on Ray, and that batch on a simulated cluster.

    python bench/bench_scale.py [--repeat 3] [--sections cold,batch,cluster] [--no-ray]
                                [--tvm-python PATH] [--iree-bin DIR]

Peers, each in a venv of its own (a section's column reads "not installed" without it):
    python -m venv /opt/tvm && /opt/tvm/bin/pip install apache-tvm onnx
    python -m venv /opt/iree && /opt/iree/bin/pip install "iree-base-compiler[onnx]"
and --tvm-python /opt/tvm/bin/python --iree-bin /opt/iree/bin (or KILN_BENCH_TVM_PYTHON,
KILN_BENCH_IREE_BIN).

cold: one model, a new process each time, as a CI job builds it: `kiln build` with an empty
  store; TVM's import, from_onnx, tvm.compile for this CPU and export_library
  (bench/peer_builds.py); IREE's iree-import-onnx then iree-compile for this CPU. Rounds
  interleaved, medians. Kiln's time split from its trace: Python's start and imports (before
  the build), planning, compiling (wall; worker seconds beside it), linking.
batch: `kiln build-many` of the test zoo's 8 CNNs, empty store, on 1 and 2 local workers and
  on Ray with 2 actors (a local Ray cluster started first, not counted). The driver's own
  seconds (report timing.driver_s: neither waiting nor planning or linking) per model.
cluster: the 1-worker batch's trace replayed (bench/scale_sim.py): first the real runs
  (1 and 2 workers sharing this machine's cores with the driver) to check the replay, then
  1 to 256 workers of their own, with plans and links on this machine's cores as the Ray
  executor runs them today (model hosts forked by the driver), and on the workers.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import onnx  # noqa: E402

from bench.scale_sim import Batch, simulate  # noqa: E402
from tests import model_zoo, transformer_zoo, vision_zoo  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
KILN = [sys.executable, "-m", "modelkiln.orchestrator.cli"]
# (as on a user's machine, Python keeps its bytecode: some sandboxes set PYTHONDONTWRITEBYTECODE)
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}

COLD = {  # (the transformer zoo's functions return (model, feeds))
    "ResNet-18": model_zoo.resnet18,
    "GPT-2 block, 128 tokens": lambda: transformer_zoo.gpt2_block(seq=128, d=768, heads=12)[0],
    "BERT encoder (4 layers)": lambda: transformer_zoo.bert_encoder("dynamo", seq=128, d=256, heads=4, layers=4,
                                                                    vocab=8000, ffn=1024)[0],
    "GPT-2 block, 1 token": lambda: transformer_zoo.gpt2_block(seq=1, d=768, heads=12)[0],
}
CNNS = {"resnet50": vision_zoo.resnet50, "mobilenet_v3": vision_zoo.mobilenet_v3,
        "efficientnet_b0": vision_zoo.efficientnet_b0, "regnety_400mf": vision_zoo.regnety_400mf,
        "densenet121": vision_zoo.densenet121, "resnet18": model_zoo.resnet18,
        "mobilenet_v2": lambda: model_zoo.mobilenet_v2(224), "unet": lambda: model_zoo.unet(128)}


def save_for_peers(model: onnx.ModelProto, path: str) -> str:
    """The model with every output's shape stated (IREE's importer checks it) and saved."""
    inferred = onnx.shape_inference.infer_shapes(model)
    shapes = {v.name: v.type for v in list(inferred.graph.value_info) + list(inferred.graph.output)}
    for out in model.graph.output:
        if not out.type.tensor_type.HasField("shape") and out.name in shapes:
            out.type.CopyFrom(shapes[out.name])
    onnx.save(model, path)
    return path


def timed_run(cmd: list, **kw) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=ENV, stdout=subprocess.DEVNULL, **kw)
    return time.perf_counter() - t0


def trace_split(trace: str) -> dict:
    """Kiln's build from its trace: plan and link spans, compile wall and worker seconds."""
    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    compiles = [e for e in events if e["cat"] in ("compile", "fallback")]
    span = {cat: sum(e["dur"] for e in events if e["cat"] == cat) / 1e6 for cat in ("plan", "link")}
    if compiles:
        span["compile_wall"] = (max(e["ts"] + e["dur"] for e in compiles) - min(e["ts"] for e in compiles)) / 1e6
        span["worker_s"] = sum(e["dur"] for e in compiles) / 1e6
    return span


def host_cpu() -> str:
    from modelkiln.orchestrator.target import parse_target
    return parse_target("host").cpu


def cold_section(args, tmp: str) -> None:
    tvm, iree = args.tvm_python, args.iree_bin
    mcpu = host_cpu()
    print(f"\n### Cold builds (a new process each, empty store), median of {args.repeat}\n")
    print("| model | Kiln | start + imports | plan | compile (worker-s) | link | TVM | IREE | Kiln / TVM |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, make in COLD.items():
        path = save_for_peers(make(), os.path.join(tmp, "cold.onnx"))
        runs: dict = {"kiln": [], "tvm": [], "iree": []}
        splits = []
        for r in range(args.repeat):
            out, trace, report = (os.path.join(tmp, x) for x in ("out", "trace.json", "report.json"))
            runs["kiln"].append(timed_run(KILN + ["build", path, "-o", out, "--quiet", "--cache",
                                                  os.path.join(tmp, f"store-{time.time()}"), "--trace", trace,
                                                  "--report", report]))
            with open(report) as f:
                total_s = json.load(f)["timing"]["total_s"]
            splits.append({**trace_split(trace), "start": runs["kiln"][-1] - total_s})
            if tvm:
                runs["tvm"].append(timed_run([tvm, os.path.join(HERE, "peer_builds.py"), "tvm", path,
                                              os.path.join(tmp, "tvm.so"), "--mcpu", mcpu], stderr=subprocess.DEVNULL))
            if iree:
                mlir, vmfb = os.path.join(tmp, "m.mlir"), os.path.join(tmp, "m.vmfb")
                runs["iree"].append(timed_run([os.path.join(iree, "iree-import-onnx"), path, "-o", mlir]) + timed_run(
                    [os.path.join(iree, "iree-compile"), mlir, "--iree-hal-target-device=local",
                     "--iree-hal-local-target-device-backends=llvm-cpu", "--iree-llvmcpu-target-cpu=host",
                     "-o", vmfb]))
        med = {k: statistics.median(v) if v else None for k, v in runs.items()}
        part = {k: statistics.median(s.get(k, 0.0) for s in splits) for k in ("start", "plan", "compile_wall",
                                                                              "worker_s", "link")}
        peer = (lambda v: f"{v:.2f} s" if v else "not installed")
        ratio = f"{med['kiln'] / med['tvm']:.2f}" if med["tvm"] else "n/a"
        print(f"| {name} | {med['kiln']:.2f} s | {part['start']:.2f} | {part['plan']:.2f} | {part['compile_wall']:.2f} "
              f"({part['worker_s']:.2f}) | {part['link']:.2f} | {peer(med['tvm'])} | {peer(med['iree'])} | {ratio} |",
              flush=True)


def batch_run(paths: list, tmp: str, label: str, extra: list) -> dict:
    out, trace, report = (os.path.join(tmp, f"{label}-{x}") for x in ("out", "trace.json", "report.json"))
    wall = timed_run(KILN + ["build-many", *paths, "-o", out, "--quiet", "--fail-fast", "--cache",
                             os.path.join(tmp, f"store-{label}-{time.time()}"), "--trace", trace, "--report", report]
                     + extra)
    shutil.rmtree(out, ignore_errors=True)
    with open(report) as f:
        rep = json.load(f)
    return {"wall": wall, "total_s": rep["timing"]["total_s"], "driver_s": rep["timing"]["driver_s"],
            "hosts": rep["timing"]["model_hosts"], "trace": trace, **trace_split(trace)}


def batch_section(args, tmp: str) -> dict:
    paths = []
    for name, make in CNNS.items():
        paths.append(os.path.join(tmp, f"{name}.onnx"))
        onnx.save(make(), paths[-1])
    print(f"\n### A batch of {len(paths)} CNNs ({', '.join(CNNS)}), empty store\n")
    print("| executor | wall | in the build | worker-s | plan (s, summed) | link (s, summed) | model hosts "
          "| driver's own s | per model |")
    print("|---|---|---|---|---|---|---|---|---|")
    runs = {}
    configs = [("1 local worker", ["--workers", "1"]), ("2 local workers", ["--workers", "2"])]
    cluster = None
    if not args.no_ray:
        from ray.cluster_utils import Cluster
        os.environ["RAY_TMPDIR"] = ENV["RAY_TMPDIR"] = tmp
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
        configs.append(("Ray, 2 actors", ["--executor", "ray", "--ray-address", cluster.address, "--workers", "2"]))
    try:
        for label, extra in configs:
            r = runs[label] = batch_run(paths, tmp, label.replace(" ", "_").replace(",", ""), extra)
            print(f"| {label} | {r['wall']:.1f} s | {r['total_s']:.1f} s | {r['worker_s']:.1f} | {r['plan']:.1f} | "
                  f"{r['link']:.1f} | {r['hosts']} | {r['driver_s']:.2f} | {r['driver_s'] / len(paths):.3f} |",
                  flush=True)
    finally:
        if cluster is not None:
            cluster.shutdown()
    one, two = runs["1 local worker"], runs["2 local workers"]
    print(f"\n2 local workers over 1: {one['total_s'] / two['total_s']:.2f}x")
    return runs


def recorded_batch(trace: str) -> Batch:
    """The batch's tasks as a build recorded them: each model's plan and link, and the jobs
    its plan sent, in order (a job's seconds: all its attempts')."""
    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    plans = {e["args"]["model"]: e for e in events if e["cat"] == "plan"}
    links = {e["args"]["model"]: e["dur"] / 1e6 for e in events if e["cat"] == "link"}
    seconds: dict = {}
    for e in events:
        if e["cat"] in ("compile", "fallback"):
            seconds[e["args"]["key"]] = seconds.get(e["args"]["key"], 0.0) + e["dur"] / 1e6
    order = sorted(plans, key=lambda i: plans[i]["ts"])
    jobs = {i: [(key, seconds[key]) for key in plans[i]["args"]["jobs"] if key in seconds] for i in order}
    return Batch(order, {i: plans[i]["dur"] / 1e6 for i in order}, links, jobs)


def cluster_section(runs: dict) -> None:
    cores = len(os.sched_getaffinity(0))
    one = runs["1 local worker"]
    batch = recorded_batch(one["trace"])
    tasks = len(batch.order) * 2 + sum(len(j) for j in batch.jobs.values())
    dispatch = one["driver_s"] / tasks
    print(f"\n### The batch replayed ({tasks} tasks; the driver's own time per task {dispatch * 1e3:.1f} ms)\n")
    print("| run on this machine | measured | replayed | off by |")
    print("|---|---|---|---|")
    for label, workers in (("1 local worker", 1), ("2 local workers", 2)):
        real = runs[label]["total_s"]
        sim = simulate(batch, workers, hosts="driver", cores=cores, dispatch_s=dispatch)
        print(f"| {label} | {real:.1f} s | {sim:.1f} s | {100 * (sim - real) / real:+.0f}% |", flush=True)
    print(f"\n| workers | plans and links on the driver's {cores} cores | speed-up | on the workers | speed-up |")
    print("|---|---|---|---|---|")
    base = {}
    for n in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        row = []
        for hosts in (cores, "workers"):
            t = simulate(batch, n, hosts=hosts, dispatch_s=dispatch, dt=0.002 if n < 32 else 0.001)
            base.setdefault(hosts, t)
            row += [f"{t:.1f} s", f"{base[hosts] / t:.1f}x"]
        print(f"| {n} | " + " | ".join(row) + " |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--sections", default="cold,batch,cluster")
    ap.add_argument("--no-ray", action="store_true")
    ap.add_argument("--tvm-python", default=os.environ.get("KILN_BENCH_TVM_PYTHON"))
    ap.add_argument("--iree-bin", default=os.environ.get("KILN_BENCH_IREE_BIN"))
    args = ap.parse_args()
    sections = args.sections.split(",")
    from bench.bench_models import cpu_name, host_isa
    print(f"{cpu_name()} ({host_isa()}), {len(os.sched_getaffinity(0))} usable cores, "
          f"{time.strftime('%Y-%m-%d')}")
    with tempfile.TemporaryDirectory(prefix="kiln-bench-scale-") as tmp:
        if "cold" in sections:
            cold_section(args, tmp)
        if "batch" in sections or "cluster" in sections:
            runs = batch_section(args, tmp)
            if "cluster" in sections:
                cluster_section(runs)


if __name__ == "__main__":
    main()
