"""The build API: ONNX model in, BuildResult (a deployable bundle) out.

    result = build("model.onnx", target="llvm", opt_level=3)
    result.export("out/")            # model.so + manifest.json + weights.bin
    module = artifacts.load("out/")  # or result.load()

Stages: frontend -> passes (under a PassContext) -> lowering -> one compile job per unique
kernel -> store lookup -> executor (fresh process per job) -> store write -> link.
"""
from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field

from ir.errors import KilnError
from ir.frontend_onnx import from_onnx
from ir.lower import ScheduleConfig, lower
from ir.passes import default_pipeline
from ir.transform import PassContext, PassTimingInstrument

from . import build_log
from .bundle import assemble, write_bundle
from .executor_local import Executor, make_executor
from .plan import JobResult, make_job, unique_jobs
from .progress import Progress
from .store_policy import DEFAULT_CACHE, open_store
from .target import Target, parse_target

KILN_VERSION = "0.1.0"


class BuildError(KilnError):
    def __init__(self, message: str, report: dict | None = None):
        super().__init__(message)
        self.report = report


@dataclass
class BuildResult:
    target: Target
    graph: object
    lowered: object
    files: dict
    report: dict
    pass_timings: list = field(default_factory=list)

    def export(self, path: str) -> str:
        return write_bundle(self.files, path)

    def load(self):
        """Export to a temporary folder and load it (kept alive with the module)."""
        from artifacts.module import Module
        tmp = tempfile.mkdtemp(prefix="kiln-module-")
        self.export(os.path.join(tmp, "bundle"))
        return Module(os.path.join(tmp, "bundle"))


def optimize(model, shapes=None, opt_level: int = 3, pass_context: PassContext | None = None, extra_passes=()):
    """Frontend + graph passes: the graph that lowering sees, and per-pass timings."""
    g = from_onnx(model, shapes)
    ctx = pass_context or PassContext(opt_level=opt_level)
    timing = PassTimingInstrument()
    ctx.instruments = list(ctx.instruments) + [timing]
    with ctx:
        g = default_pipeline(extra_passes)(g, ctx)
    ctx.instruments.remove(timing)
    return g, timing.timings


def _kernel_rows(lowered, jobs_by_symbol, results: dict[str, JobResult]) -> list[dict]:
    rows = []
    for call in lowered.calls:
        job = jobs_by_symbol[call.kernel.symbol]
        r = results[job.key]
        rows.append({"name": call.name, "symbol": call.kernel.symbol, "key": job.key, "ops": call.ops,
                     "nodes": call.nodes, "cache_hit": r.cached, "worker": r.worker,
                     "attempts": len(r.attempts), "attempt_log": r.attempts,
                     "compile_ms": round(r.compile_ms, 2), "fallback": r.fallback, "ok": r.ok})
    return rows


def build(model, target="llvm", opt_level: int = 3, shapes: dict | None = None, executor: "str | Executor" = "local",
          workers: int | None = None, cache=DEFAULT_CACHE, pass_context: PassContext | None = None,
          kernel_timeout: float = 300.0, progress: bool | None = None, inject: dict | None = None,
          salt: str = "", extra_passes=()) -> BuildResult:
    """Build an ONNX model (path, bytes or ModelProto) into a bundle for `target`.

    cache: a folder for the content-addressed store (default: KILN_CACHE_DIR or the user
    cache dir), an artifacts.store.Store, or None for no cache. inject maps a kernel-name
    substring to a fault (crash, hang, exit, corrupt): for tests of fault handling.
    extra_passes run after the built-in graph passes and before fusion.
    """
    t_start = time.perf_counter()
    tgt = parse_target(target)
    g, timings = optimize(model, shapes, opt_level, pass_context, extra_passes)
    lowered = lower(g, ScheduleConfig.for_vector_width(tgt.vector_width))
    all_jobs = [make_job(c, tgt, opt_level, salt) for c in lowered.calls]
    for job in all_jobs:
        for pattern, fault in (inject or {}).items():
            if pattern in job.name:
                job.inject = fault
    jobs = unique_jobs(all_jobs)
    store = open_store(cache)
    results: dict[str, JobResult] = {}
    misses = []
    for job in jobs:
        obj = store.get(job.key) if store else None
        if obj is not None:
            results[job.key] = JobResult(job.key, True, obj, cached=True, worker="cache")
        else:
            misses.append(job)
    owned = isinstance(executor, str)
    ex = make_executor(executor, workers, kernel_timeout) if owned else executor
    bar = Progress(len(jobs), ex.workers, enabled=progress)
    bar.update(cached=len(jobs) - len(misses))
    t_compile = time.perf_counter()
    try:
        def done(r: JobResult):
            if r.ok and store:
                store.put(r.key, r.object)
            bar.update(compiled=int(r.ok), failed=int(not r.ok))
        results.update(ex.run(misses, done) if misses else {})
    finally:
        if owned:
            ex.close()
        bar.close()
    compile_s = time.perf_counter() - t_compile
    by_symbol = {j.symbol: j for j in all_jobs}
    rows = _kernel_rows(lowered, by_symbol, results)
    unique_rows = {j.key: results[j.key] for j in jobs}
    totals = {"kernels": len(jobs), "kernel_calls": len(lowered.calls),
              "compiled": sum(1 for r in unique_rows.values() if r.ok and not r.cached),
              "cached": sum(1 for r in unique_rows.values() if r.cached),
              "failed": sum(1 for r in unique_rows.values() if not r.ok),
              "retried": sum(1 for r in unique_rows.values() if len(r.attempts) > 1),
              "fallback": sum(1 for r in unique_rows.values() if r.fallback)}
    report = {"model": g.name, "target": tgt.to_dict(), "opt_level": opt_level, "executor": ex.name,
              "workers": ex.workers, "totals": totals, "kernels": rows,
              "passes": [{"name": n, "ms": round(ms, 3)} for n, ms in timings]}
    failed = [j for j in jobs if not results[j.key].ok]
    if failed:
        lines = [f"  kernel {j.name} ({j.symbol}; ops {', '.join(j.ops)}): {results[j.key].kind}: "
                 f"{results[j.key].message.strip().splitlines()[-1] if results[j.key].message else ''}"
                 for j in failed]
        raise BuildError(f"{len(failed)} of {len(jobs)} kernels failed to compile after "
                         f"{len(results[failed[0].key].attempts)} attempts:\n" + "\n".join(lines), report)
    if store is not None and not store.readonly:
        from .explain import kernel_id
        by_key = {j.key: j for j in all_jobs}
        build_log.append(store.root, g.name,
                         [{"id": kernel_id(c), "key": by_symbol[c.kernel.symbol].key,
                           "parts": by_key[by_symbol[c.kernel.symbol].key].parts} for c in lowered.calls],
                         hits=totals["cached"], lookups=len(jobs))
    objects = {j.symbol: results[j.key].object for j in jobs}
    manifest = {"kiln_version": KILN_VERSION, "model": g.name, "target": tgt.to_dict(), "opt_level": opt_level}
    files = assemble(lowered, objects, tgt, manifest)
    report["timing"] = {"total_s": round(time.perf_counter() - t_start, 3), "compile_s": round(compile_s, 3)}
    return BuildResult(tgt, g, lowered, files, report, timings)
