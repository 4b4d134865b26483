"""Auto-tuning: what `kiln tune` buys, how long it takes, and what a machine that never tuned gets.

    python bench/bench_tune.py [--models resnet50,...] [--budget 600] [--rounds 3] [--parts tables,nodes,fresh]

tables: every model is tuned on this machine at 1 thread and at every usable core (one store
        for the whole run, so later models learn from earlier ones), within `--budget` seconds
        each; then its rules' build and its tuned build run beside onnxruntime and OpenVINO
        (float32) in interleaved rounds, the better median of each. Columns: tuning time and
        trials, the model's time under the rules and tuned, the peers', tuned over the best peer.
nodes:  one model's tune with a fixed number of trials, compiling on Ray clusters of 1, 2 and 3
        nodes started on this machine (each its own raylet; the CPUs divided between them):
        the wall time to the same trials and the gain each found.
fresh:  one machine tunes with an HTTP cache (nginx) behind its store; a second one with an
        empty store and the same cache builds the model: what it compiled, measured and how
        fast the module is.
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_models import (LOOSE, MODELS, THREADS, cpu_name, host_isa, interleaved,  # noqa: E402
                                openvino_runner, ort_session)
from modelkiln.orchestrator.api import build  # noqa: E402
from modelkiln.orchestrator.tuner import tune  # noqa: E402

DEFAULT_MODELS = "resnet50,mobilenet_v3,convnext_stage,vit_encoder,bert_encoder,unet,resnet18_int8_qdq"


def _check(name, module, model, inputs) -> None:
    sess = ort_session(model)
    want = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, inputs)))
    got = module.run(inputs)
    for k in want:
        tol = float(np.abs(want[k]).max()) * LOOSE.get(name, 1e-5) + 1e-4
        assert np.allclose(got[k], want[k], rtol=1e-3, atol=tol), f"{name}: tuned outputs differ from onnxruntime"


def bench_tables(args, store: str) -> None:
    print(f"| model | threads | tune s | trials | expected gain | kiln rules | kiln tuned | onnxruntime | "
          f"OpenVINO | rules / best | tuned / best |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    ratios = {t: [] for t in args.threads}
    for name in args.models.split(","):
        model, inputs = MODELS[name]()
        for threads in args.threads:
            t0 = time.perf_counter()
            report = tune([model], budget_s=args.budget, threads=threads, cache=store, progress=False).report
            tune_s = time.perf_counter() - t0
            rules = build(model, cache=store, progress=False, tuning=False).load(threads=threads)
            tuned_build = build(model, cache=store, progress=False, tuning_threads=threads)
            tuned = tuned_build.load(threads=threads)
            _check(name, tuned, model, inputs)
            sess = ort_session(model, threads)
            runs = {"rules": lambda: rules.run(inputs), "tuned": lambda: tuned.run(inputs),
                    "ort": lambda: sess.run(None, inputs)}
            ov = openvino_runner(model, threads)
            if ov is not None:
                runs["ov"] = lambda: ov(inputs)
            ms = interleaved(runs, args.warmup, args.repeat, args.rounds)
            best = min(ms[k] for k in ("ort", "ov") if k in ms)
            ratios[threads].append(ms["tuned"] / best)
            ov_ms = f"{ms['ov']:.3f}" if "ov" in ms else "n/a"
            print(f"| {name} | {threads} | {tune_s:.0f} | {report['trials']} | {100 * report['expected_gain']:.1f}% | "
                  f"{ms['rules']:.3f} | {ms['tuned']:.3f} | {ms['ort']:.3f} | {ov_ms} | {ms['rules'] / best:.2f} | "
                  f"{ms['tuned'] / best:.2f} |", flush=True)
    for threads, rs in ratios.items():
        if rs:
            print(f"\ntuned / best peer at {threads} thread(s): geometric mean "
                  f"{math.exp(sum(map(math.log, rs)) / len(rs)):.2f}, highest {max(rs):.2f}")


def bench_nodes(args) -> None:
    """The same tune (fixed trials) compiling on 1, 2 and 3 local Ray nodes."""
    import ray
    from ray.cluster_utils import Cluster
    from modelkiln.orchestrator.executor_ray import RayExecutor
    model, _ = MODELS[args.nodes_model]()
    print(f"\n{args.nodes_model}: {args.nodes_trials} trials at 1 thread, compiling on N local Ray nodes "
          f"({THREADS} cores in all)\n")
    print("| nodes | CPUs per node | wall s | trials | expected gain |")
    print("|---:|---:|---:|---:|---:|")
    for nodes in (1, 2, 3):
        ray_tmp = tempfile.mkdtemp(prefix="kiln-bench-ray-")
        os.environ["RAY_TMPDIR"] = ray_tmp
        per_node = max(1, THREADS // nodes)
        env = {"PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": per_node, "include_dashboard": False,
                                                                "env_vars": env})
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=per_node, env_vars=env)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        store = tempfile.mkdtemp(prefix="kiln-bench-store-")
        try:
            with RayExecutor() as ex:
                ex.wait_ready()
                t0 = time.perf_counter()
                report = tune([model], trials=args.nodes_trials, threads=1, executor=ex, cache=store,
                              progress=False, learn=False).report
                wall = time.perf_counter() - t0
            print(f"| {nodes} | {per_node} | {wall:.0f} | {report['trials']} | "
                  f"{100 * report['expected_gain']:.1f}% |", flush=True)
        finally:
            ray.shutdown()
            cluster.shutdown()
            shutil.rmtree(store, ignore_errors=True)
            shutil.rmtree(ray_tmp, ignore_errors=True)


def bench_fresh(args) -> None:
    """Tune behind an HTTP cache; build on a machine with an empty store."""
    from tests.cache_servers import Nginx
    name = args.fresh_model
    model, inputs = MODELS[name]()
    root = tempfile.mkdtemp(prefix="kiln-bench-fresh-")
    server = Nginx(os.path.join(root, "nginx"))
    try:
        os.environ["KILN_CACHE_DIR"] = os.path.join(root, "tuner")
        t0 = time.perf_counter()
        report = tune([model], budget_s=args.budget, threads=THREADS, cache=server.url, progress=False).report
        tune_s = time.perf_counter() - t0
        os.environ["KILN_CACHE_DIR"] = os.path.join(root, "fresh")
        t0 = time.perf_counter()
        fresh = build(model, cache=server.url, progress=False, tuning_threads=THREADS)
        build_s = time.perf_counter() - t0
        rules = build(model, cache=None, progress=False, tuning=False).load(threads=THREADS)
        module = fresh.load(threads=THREADS)
        _check(name, module, model, inputs)
        ms = interleaved({"rules": lambda: rules.run(inputs), "fresh": lambda: module.run(inputs)},
                         args.warmup, args.repeat, args.rounds)
        t = fresh.report["tuning"]
        print(f"\n{name}, {THREADS} threads: tuned in {tune_s:.0f} s ({report['trials']} trials) behind the HTTP "
              f"cache; a machine with an empty store built it in {build_s:.2f} s: "
              f"{fresh.report['totals']['compiled']} kernels compiled, {fresh.report['totals']['cached']} from the "
              f"cache, {t['tuned_kernels']} kernels following records ({t['changed_kernels']} changed), no "
              f"measurement; {ms['fresh']:.3f} ms against {ms['rules']:.3f} ms under the rules")
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=DEFAULT_MODELS)
    ap.add_argument("--budget", type=float, default=600.0, help="seconds of tuning per model and thread count")
    ap.add_argument("--threads", default=f"1,{THREADS}")
    ap.add_argument("--parts", default="tables,nodes,fresh")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--nodes-model", default="resnet50")
    ap.add_argument("--nodes-trials", type=int, default=300)
    ap.add_argument("--fresh-model", default="resnet50")
    args = ap.parse_args()
    args.threads = sorted({int(t) for t in args.threads.split(",")})
    import onnxruntime
    print(f"# {time.strftime('%Y-%m-%d')}, {cpu_name()} ({host_isa()}), {THREADS} usable cores; onnxruntime "
          f"{onnxruntime.__version__}; OpenVINO f32; ms, better median of {args.rounds} interleaved rounds; "
          f"tuning budget {args.budget:.0f} s per model and thread count\n")
    parts = args.parts.split(",")
    store = tempfile.mkdtemp(prefix="kiln-bench-tune-")
    try:
        if "tables" in parts:
            bench_tables(args, store)
    finally:
        shutil.rmtree(store, ignore_errors=True)
    if "nodes" in parts:
        bench_nodes(args)
    if "fresh" in parts:
        bench_fresh(args)


if __name__ == "__main__":
    main()
