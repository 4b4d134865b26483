"""Scale: one batch of models compiled on 1, 2 and 3 Ray nodes, and how fast one driver hands
out jobs.

    python bench/bench_cluster.py [--nodes 1,2,3] [--repeat 2] [--dispatch-jobs 400]

Nodes are real raylets (ray.cluster_utils), one CPU each, all on this machine: past its usable
cores (2 here) more nodes add processes, not capacity, and the table says so. What carries
over to a real cluster is the second table: the driver's own cost per job (CPU it spends to
send a job, take the object back, check it and store it), measured with trivially small
kernels so that the workers are never the limit, beside what a real kernel costs a worker.
Their ratio is how many worker CPUs one driver can keep busy (docs/DESIGN.md, "Building at
scale").
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from onnx import TensorProto, helper  # noqa: E402

from modelkiln.artifacts.store import Store  # noqa: E402
from modelkiln.orchestrator.api import build_many as _build_many, optimize  # noqa: E402
from modelkiln.orchestrator.executor_ray import RayExecutor  # noqa: E402
from modelkiln.ir.lower import lower  # noqa: E402
from modelkiln.orchestrator.pipeline import schedule_for  # noqa: E402
from modelkiln.orchestrator.plan import make_job  # noqa: E402
from modelkiln.orchestrator.target import parse_target  # noqa: E402
from tests import model_zoo  # noqa: E402


def build_many(models, **options):
    """A batch that stops at its first failure: a timing of a batch that lost a model is no timing."""
    return _build_many(models, fail_fast=True, **options)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start_cluster(nodes: int):
    import ray
    from ray.cluster_utils import Cluster
    env = {"PYTHONPATH": ROOT}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                            "env_vars": env})
    for _ in range(nodes - 1):
        cluster.add_node(num_cpus=1, env_vars=env)
    cluster.wait_for_nodes()
    here = os.getcwd()
    os.chdir(tempfile.gettempdir())  # Ray puts the driver's folder on workers' paths: not this checkout
    try:
        ray.init(address=cluster.address, log_to_driver=False)
    finally:
        os.chdir(here)
    return ray, cluster


def trivial_jobs(n: int) -> list:
    """n distinct jobs (one salt each) of the smallest kernel there is: a Relu on 16 floats."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16])
    model = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)])
    target = parse_target("llvm")
    [call] = lower(optimize(model)[0], schedule_for(target)).calls
    return [make_job(call, target, 3, salt=f"dispatch-{i}") for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", default="1,2,3")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--dispatch-jobs", type=int, default=400)
    args = ap.parse_args()
    node_counts = [int(n) for n in args.nodes.split(",")]
    tmp = tempfile.mkdtemp(prefix="kiln-bench-cluster-")
    os.environ["RAY_TMPDIR"] = tmp
    batch = list(model_zoo.ALL.values())
    models = [make() for make in batch]
    rows, dispatch = [], None
    for n in node_counts:
        ray, cluster = start_cluster(n)
        try:
            with RayExecutor(kernel_timeout=120) as ex:
                ex.run([])  # actors up before the clock starts
                times, result = [], None
                for _ in range(args.repeat):
                    t0 = time.perf_counter()
                    result = build_many(models, executor=ex, cache=None, progress=False)
                    times.append(time.perf_counter() - t0)
                kernels = [k for r in result.results for k in r.report["kernels"]]
                used = {k["worker"].split(":")[2] for k in kernels}
                compile_ms = [a["ms"] for k in kernels for a in k["attempt_log"] if a["ok"]]
                rows.append((n, statistics.median(times), result.report["totals"]["kernels"], len(used), compile_ms))
                if n == max(node_counts):
                    jobs = trivial_jobs(args.dispatch_jobs)
                    with tempfile.TemporaryDirectory(dir=tmp) as store_dir:
                        store = Store(store_dir)
                        cpu0, t0 = time.process_time(), time.perf_counter()
                        results = ex.run(jobs, on_result=lambda r: store.put(r.key, r.object))
                        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
                    assert all(r.ok for r in results.values())
                    dispatch = (len(jobs), wall, cpu, n)
        finally:
            ray.shutdown()
            cluster.shutdown()
    print(f"# {time.strftime('%Y-%m-%d')}, {len(os.sched_getaffinity(0))} usable cores, "
          f"batch = every test model ({len(models)}), median of {args.repeat}\n")
    print("| Ray nodes (1 CPU each) | nodes that compiled | batch build (s) | kernels | speed-up over 1 node |")
    print("|---:|---:|---:|---:|---:|")
    base = rows[0][1]
    for n, t, kernels, used, _ in rows:
        print(f"| {n} | {used} | {t:.2f} | {kernels} | {base / t:.2f}x |")
    if dispatch:
        jobs, wall, cpu, n = dispatch
        per_job_ms = 1000 * cpu / jobs
        real_ms = statistics.mean(rows[-1][4])
        print(f"\n| driver dispatch ({n} nodes, {jobs} trivial jobs) | jobs/s | driver CPU per job (ms) | "
              f"jobs/s one driver CPU can feed | a real job's worker time (ms, mean of the batch) | "
              f"worker CPUs one driver can feed |\n|---|---:|---:|---:|---:|---:|\n"
              f"| send, receive, check, store | {jobs / wall:.0f} | {per_job_ms:.2f} | {1000 / per_job_ms:.0f} | "
              f"{real_ms:.0f} | {real_ms / per_job_ms:.0f} |")
    import shutil
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
