"""Build times: cold and warm, 1 and 2 workers, local and Ray, and the cost of isolation.

    python bench/bench_build.py [--repeat 3] [--no-ray]

Workloads: ResNet-18 alone, and a batch of every test model (build_many). For each:
  - cold builds (no cache) with the local executor and with Ray, 1 and 2 workers; Ray is
    started once beforehand (its ~3-6 s start is printed, not counted), but each Ray build
    starts its own actors, as a fresh `kiln build --executor ray` would;
  - the same on Ray with its actors already up (one RayExecutor reused across builds, as a
    long-running service or build_many over many models uses it);
  - warm builds: an unchanged model (a whole-model hit: hash the file, read the bundle), and
    the same graph in new bytes (every kernel and the linked module hit; frontend, passes,
    lowering and weight packing still run);
  - a cold `kiln build` in a new process, local beside `--executor ray` against a warm pool
    (`kiln workers up`) on a local Ray cluster: what a CI job pays either way;
  - per-job isolation: the same unique kernels compiled one after another in this process
    (in-process debug mode) and through the zygote (a fresh forked process per job), one
    worker each; the difference per job is what isolation costs.
Each number is the median of --repeat runs. Prints Markdown tables (the ones in docs/performance.md).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import onnx  # noqa: E402

from modelkiln.ir.lower import lower  # noqa: E402
from modelkiln.orchestrator.api import build_many as _build_many, optimize  # noqa: E402
from modelkiln.orchestrator.executor_local import InProcessExecutor, LocalExecutor  # noqa: E402
from modelkiln.orchestrator.pipeline import schedule_for  # noqa: E402
from modelkiln.orchestrator.plan import make_job, unique_jobs  # noqa: E402
from modelkiln.orchestrator.target import parse_target  # noqa: E402
from tests import model_zoo  # noqa: E402


def build_many(models, **options):
    """A batch that stops at its first failure: a timing of a batch that lost a model is no timing."""
    return _build_many(models, fail_fast=True, **options)


def _touched(path: str, tag: str) -> str:
    """A copy of the model at `path` with different bytes and the same graph."""
    m = onnx.load(path)
    m.doc_string = f"touched {tag}"
    out = f"{path}.{tag}.onnx"
    onnx.save(m, out)
    return out


def timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def unique_kernel_jobs(models) -> list:
    target = parse_target("llvm")
    jobs = []
    for m in models:
        g, _ = optimize(m)
        jobs += [make_job(c, target, 3) for c in lower(g, schedule_for(target)).calls]
    return unique_jobs(jobs)


def isolation_cost(jobs, repeat: int) -> tuple[float, float]:
    """(in-process s, zygote s) to compile `jobs` one at a time."""
    inproc = timed(lambda: InProcessExecutor().run(jobs), repeat)
    with LocalExecutor(workers=1) as ex:
        ex.run(jobs[:1])  # start the zygote outside the measurement
        forked = timed(lambda: ex.run(jobs), repeat)
    return inproc, forked


def cli_warm_cold(model: str, repeat: int) -> tuple[float, float]:
    """(cold s, warm s) of `kiln build MODEL -o OUT` as a user runs it: a fresh process each
    time, the cold one with an empty store, the warm one an unchanged model (a whole-model hit)."""
    import subprocess
    kiln = [sys.executable, "-m", "modelkiln.orchestrator.cli", "build", model, "--quiet"]
    # As on a user's machine, Python keeps its bytecode (some sandboxes set
    # PYTHONDONTWRITEBYTECODE, which makes every start compile Kiln's modules again).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    with tempfile.TemporaryDirectory() as tmp:
        def run(store: str):
            subprocess.run(kiln + ["-o", os.path.join(tmp, "out"), "--cache", os.path.join(tmp, store)], check=True,
                           env=env)
        cold = timed(lambda: run(f"store-{time.perf_counter()}"), repeat)
        run("store-warm")
        warm = timed(lambda: run("store-warm"), repeat)
    return cold, warm


def cli_cold_pool_vs_local(model: str, repeat: int) -> tuple[float, float]:
    """(local s, Ray s) of a cold `kiln build MODEL` in a new process, interleaved: local with
    2 workers, and `--executor ray` against a warm pool (`kiln workers up`) of 2 actors on a
    local Ray cluster of this machine's cores. Both include starting Python and importing."""
    import subprocess

    from ray.cluster_utils import Cluster
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    kiln = [sys.executable, "-m", "modelkiln.orchestrator.cli"]
    with tempfile.TemporaryDirectory() as tmp:
        env["RAY_TMPDIR"] = os.environ["RAY_TMPDIR"] = tmp
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
        address = cluster.address
        try:
            subprocess.run(kiln + ["workers", "up", "--ray-address", address, "-n", "2"], check=True, env=env,
                           stdout=subprocess.DEVNULL)
            times: dict = {"local": [], "ray": []}
            for i in range(repeat):
                for kind, extra in (("local", []), ("ray", ["--executor", "ray", "--ray-address", address])):
                    t0 = time.perf_counter()
                    subprocess.run(kiln + ["build", model, "-o", os.path.join(tmp, "out"), "--quiet", "--no-cache"]
                                   + extra, check=True, env=env)
                    times[kind].append(time.perf_counter() - t0)
            subprocess.run(kiln + ["workers", "down", "--ray-address", address], check=True, env=env,
                           stdout=subprocess.DEVNULL)
        finally:
            cluster.shutdown()
            os.environ.pop("RAY_TMPDIR", None)
    return statistics.median(times["local"]), statistics.median(times["ray"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-ray", action="store_true")
    args = ap.parse_args()
    # Models as files, the way the CLI and CI pass them.
    model_dir = tempfile.mkdtemp(prefix="kiln-bench-models-")
    for name, make in model_zoo.ALL.items():
        onnx.save(make(), os.path.join(model_dir, f"{name}.onnx"))
    paths = {name: os.path.join(model_dir, f"{name}.onnx") for name in model_zoo.ALL}
    workloads = {"resnet18": [paths["resnet18"]], "all test models": list(paths.values())}
    rows = {}
    # Local builds, warm builds and isolation first, with no Ray running: its background
    # processes would take CPU from the measurements on a 2-core machine.
    for n, (name, models) in enumerate(workloads.items()):
        row = rows[name] = {}
        for w in (1, 2):
            row["local", w] = timed(lambda: build_many(models, executor="local", workers=w, cache=None,
                                                       progress=False), args.repeat)
        with tempfile.TemporaryDirectory() as store:
            batch = build_many(models, cache=store, progress=False)
            row["kernels"] = batch.report["totals"]["kernels"]
            row["warm"] = timed(lambda: build_many(models, cache=store, progress=False), args.repeat)
            # Same graphs in new bytes: whole-model misses whose kernels and linked module all hit.
            # Each timed run gets its own copies, or the second run would be a whole-model hit.
            copies = iter([[_touched(p, f"{n}-{run}") for p in models] for run in range(args.repeat)])
            row["kernels_warm"] = timed(lambda: build_many(next(copies), cache=store, progress=False), args.repeat)
        row["isolation"] = (unique_kernel_jobs(models),) + isolation_cost(unique_kernel_jobs(models), args.repeat)
    cli = cli_warm_cold(paths["resnet18"], args.repeat)
    pool = None if args.no_ray else cli_cold_pool_vs_local(paths["resnet18"], max(3, args.repeat))
    if not args.no_ray:
        import ray
        t0 = time.perf_counter()
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}})
        print(f"(Ray started in {time.perf_counter() - t0:.1f} s, not counted below)\n")
        from modelkiln.orchestrator.executor_ray import RayExecutor
        for name, models in workloads.items():
            row = rows[name]
            for w in (1, 2):  # each build starts its own actors, as `kiln build --executor ray` does
                row["ray", w] = timed(lambda: build_many(models, executor="ray", workers=w, cache=None,
                                                         progress=False), args.repeat)
            with RayExecutor(workers=2) as ex:
                build_many(models, executor=ex, cache=None, progress=False)  # actors boot here
                row["actors_up"] = timed(lambda: build_many(models, executor=ex, cache=None, progress=False),
                                         args.repeat)
        ray.shutdown()
    nan = float("nan")
    print(f"# {time.strftime('%Y-%m-%d')}, {len(os.sched_getaffinity(0))} usable cores, median of {args.repeat}\n")
    print("| workload | kernels | local 1w (s) | local 2w (s) | ray 1w (s) | ray 2w (s) | ray 2w, actors up (s) "
          "| warm: unchanged (s) | warm/cold | warm: kernels hit (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['kernels']} | {r['local', 1]:.2f} | {r['local', 2]:.2f} | {r.get(('ray', 1), nan):.2f} | "
              f"{r.get(('ray', 2), nan):.2f} | {r.get('actors_up', nan):.2f} | {r['warm']:.2f} | "
              f"{100 * r['warm'] / r['local', 2]:.0f}% | {r['kernels_warm']:.2f} |")
    print("\n| workload | jobs | in-process (s) | forked from zygote (s) | isolation per job (ms) |")
    print("|---|---:|---:|---:|---:|")
    for name, r in rows.items():
        jobs, inproc, forked = r["isolation"]
        print(f"| {name} | {len(jobs)} | {inproc:.2f} | {forked:.2f} | {1000 * (forked - inproc) / len(jobs):.1f} |")
    cold, warm = cli
    print(f"\n| kiln build resnet18 (CLI, new process) | cold (s) | warm: unchanged (s) | warm/cold |\n|---|---:|---:|---:|\n"
          f"| 2 workers, local | {cold:.2f} | {warm:.3f} | {100 * warm / cold:.1f}% |")
    if pool:
        local, ray_pool = pool
        print(f"\n| kiln build resnet18 (CLI, new process), cold | local, 2 workers (s) | --executor ray, warm pool "
              f"of 2 (s) | ray/local |\n|---|---:|---:|---:|\n| interleaved, median | {local:.2f} | {ray_pool:.2f} | "
              f"{ray_pool / local:.2f} |")
    shutil.rmtree(model_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
