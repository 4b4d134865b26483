"""The build API: ONNX models in, deployable bundles out.

    result = build("model.onnx", target="llvm", opt_level=3)
    result.export("out/")            # model.so + manifest.json + weights.bin
    module = artifacts.load("out/")  # or result.load()

    batch = build_many(["a.onnx", ("b.onnx", "x86-64-v3")])   # kernels shared across models compile once

Stages: frontend -> passes (under a PassContext) -> lowering -> one compile job per unique
(kernel, target, options) key across the whole batch -> store lookup -> executor (a fresh
process per job) -> store write -> link each model.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass, field

from codegen_worker.llvm_options import check_options
from ir.errors import KilnError

from . import build_log, model_cache
from .bundle import write_bundle
from .executor import Executor
from .executors import make_executor
from .plan import JobResult, kernel_id, unique_jobs
from .progress import Progress
from .store_policy import DEFAULT_CACHE, open_store
from .target import Target, parse_target


def optimize(*args, **kwargs):
    """Frontend + graph passes: see orchestrator.pipeline.optimize."""
    from .pipeline import optimize as _optimize
    return _optimize(*args, **kwargs)



class BuildError(KilnError):
    def __init__(self, message: str, report: dict | None = None):
        super().__init__(message)
        self.report = report


@dataclass
class BuildResult:
    """A built bundle: `files` maps file names to bytes (on a whole-model hit, large ones are
    artifacts.store.StoredFile: blobs in the store, compared and read like bytes). `graph` and `lowered` are None when the bundle came
    whole from the store (report["whole_model_hit"]): nothing was optimized or lowered."""
    target: Target
    graph: object
    lowered: object
    files: dict
    report: dict
    pass_timings: list = field(default_factory=list)

    def export(self, path: str) -> str:
        return write_bundle(self.files, path)

    def load(self):
        """Load the bundle without keeping it on disk: it is exported to a temporary folder
        that is gone again when this returns (the loaded library and weights live on in
        memory)."""
        from artifacts.module import Module
        with tempfile.TemporaryDirectory(prefix="kiln-module-") as tmp:
            return Module(self.export(os.path.join(tmp, "bundle")))


@dataclass
class BatchResult:
    results: list
    report: dict


def _kernel_rows(planned, results: dict[str, JobResult]) -> list[dict]:
    rows = []
    for call, job in zip(planned.lowered.calls, planned.jobs):
        r = results[job.key]
        rows.append({"name": call.name, "symbol": call.kernel.symbol, "key": job.key, "ops": call.ops,
                     "nodes": call.nodes, "cache_hit": r.cached, "worker": r.worker,
                     "attempts": len(r.attempts), "attempt_log": r.attempts,
                     "compile_ms": round(r.compile_ms, 2), "fallback": r.fallback, "ok": r.ok})
    return rows


def _totals(results: list[JobResult], calls: int) -> dict:
    return {"kernels": len(results), "kernel_calls": calls,
            "compiled": sum(1 for r in results if r.ok and not r.cached),
            "cached": sum(1 for r in results if r.cached),
            "failed": sum(1 for r in results if not r.ok),
            "retried": sum(1 for r in results if len(r.attempts) > 1),
            "fallback": sum(1 for r in results if r.fallback)}


def _trace_events(results: dict[str, JobResult], names: dict[str, str], t0: float) -> list[dict]:
    """Chrome trace-event format: one complete event per attempt, one row per worker."""
    events = []
    for key, r in results.items():
        for a in r.attempts:
            if "t_start" in a:
                events.append({"name": names.get(key, key[:12]), "cat": "fallback" if a["fallback"] else "compile",
                               "ph": "X", "ts": round((a["t_start"] - t0) * 1e6), "pid": "kiln",
                               "dur": max(1, round((a["t_end"] - a["t_start"]) * 1e6)), "tid": a["worker"],
                               "args": {"key": key, "attempt": a["attempt"], "ok": a["ok"], "kind": a["kind"]}})
    return sorted(events, key=lambda e: e["ts"])


def _as_whole_hit(report: dict, elapsed: float) -> dict:
    """The stored report of a bundle, restated for a build that reused it whole."""
    kernels = [{**k, "cache_hit": True, "worker": "cache", "attempts": 0, "attempt_log": [], "compile_ms": 0.0,
                "fallback": False} for k in report["kernels"]]
    totals = {**report["totals"], "compiled": 0, "cached": report["totals"]["kernels"], "failed": 0, "retried": 0,
              "fallback": 0}
    return {**report, "kernels": kernels, "totals": totals, "whole_model_hit": True,
            "timing": {"total_s": round(elapsed, 3), "compile_s": 0.0}, "executor": "cache"}


def build_many(models, target="llvm", opt_level: int = 3, shapes: dict | None = None,
               executor: "str | Executor" = "local", workers: int | None = None, cache=DEFAULT_CACHE,
               pass_context=None, kernel_timeout: float = 300.0, progress: bool | None = None,
               inject: dict | None = None, salt: str = "", extra_passes=(), verify_cache: bool = False,
               cache_readonly: bool = False, trace: str | None = None, ray_address: str | None = None) -> BatchResult:
    """Build several models in one batch: every kernel they share (same key) compiles once.

    Each entry of `models` is a model (path, bytes, ModelProto) or a (model, target) pair.
    cache: a folder for the content-addressed store (default: KILN_CACHE_DIR or the user
    cache dir), an artifacts.store.Store, or None for no cache. inject maps a kernel-name
    substring to a fault (crash, hang, exit, corrupt): for tests of fault handling.
    verify_cache recompiles every hit and fails on a byte difference (non-determinism).
    """
    t_start = time.time()
    entries = [m if isinstance(m, tuple) else (m, target) for m in models]
    if not entries:
        raise KilnError("build_many: no models given")
    targets: dict = {}
    for _, spec in entries:
        if spec not in targets:
            targets[spec] = parse_target(spec)
            check_options(targets[spec].llvm_options, f"target {targets[spec].name}")  # before any job runs
    store = open_store(cache, readonly=cache_readonly)
    use_model_cache = store is not None and not (pass_context or extra_passes or inject or verify_cache)
    model_keys = [model_cache.model_key(m, targets[spec], opt_level, shapes, salt) if use_model_cache else None
                  for m, spec in entries]
    whole_hits = {}
    for i, key in enumerate(model_keys):
        payload = store.get(key) if key else None
        if payload is not None:
            try:
                whole_hits[i] = model_cache.unpack(payload, store)
            except (ValueError, KeyError):
                pass  # a damaged bundle entry is a miss like any other
    todo = [i for i in range(len(entries)) if i not in whole_hits]
    owned = isinstance(executor, str)
    ex = None  # a build served whole from the store needs no executor at all
    if todo:
        # An executor we own is made now: Ray actors (slow to boot) start while we plan.
        ex = make_executor(executor, workers, kernel_timeout, ray_address) if owned else executor
    try:
        if todo:
            from .pipeline import plan_model  # the heavy imports: only when something is not cached whole
        planned = {i: plan_model(entries[i][0], targets[entries[i][1]], opt_level, shapes, pass_context, extra_passes,
                            salt, inject) for i in todo}
        all_jobs = [j for p in planned.values() for j in p.jobs]
        jobs = unique_jobs(all_jobs)
        results: dict[str, JobResult] = {}
        to_compile = []
        for job in jobs:
            obj = store.get(job.key) if store else None
            if obj is not None:
                results[job.key] = JobResult(job.key, True, obj, cached=True, worker="cache")
            if obj is None or verify_cache:
                to_compile.append(job)
        workers_n = ex.workers if ex else 0
        bar = Progress(len(jobs), workers_n, enabled=progress if todo else False)
        bar.update(cached=len(jobs) - sum(1 for j in to_compile if j.key not in results))
        mismatched = []
        t_compile = time.perf_counter()

        def done(r: JobResult):
            hit = results.get(r.key)
            if hit is not None and hit.cached:  # --verify-cache: a recompiled hit
                if r.ok and r.object != hit.object:
                    mismatched.append(r.key)
                hit.attempts = r.attempts
                return
            results[r.key] = r
            # A fallback object (no vectorize, no unroll) is correct but slow: it must never
            # answer a normal lookup, so it is not stored and the next build tries again.
            if r.ok and store and not r.fallback:
                store.put(r.key, r.object)
            bar.update(compiled=int(r.ok), failed=int(not r.ok))

        try:
            if to_compile:
                ex.run(to_compile, done)
        finally:
            bar.close()
    finally:
        if owned and ex:
            ex.close()
    compile_s = time.perf_counter() - t_compile
    names = {j.key: j.name for j in jobs}
    unique_results = [results[j.key] for j in jobs]
    ex_name = ex.name if ex else "cache"
    report = {"target": [targets[spec].to_dict() for _, spec in entries], "opt_level": opt_level,
              "executor": ex_name, "workers": workers_n, "totals": _totals(unique_results, len(all_jobs)),
              "models": [], "timing": {"compile_s": round(compile_s, 3)}}
    report["totals"]["verify_mismatches"] = len(mismatched)
    if trace:
        with open(trace, "w") as f:
            json.dump({"traceEvents": _trace_events(results, names, t_start), "displayTimeUnit": "ms"}, f)
    failed = [j for j in jobs if not results[j.key].ok]
    if failed or mismatched:
        lines = [f"  kernel {j.name} ({j.symbol}; ops {', '.join(j.ops)}): {results[j.key].kind}: "
                 f"{(results[j.key].message.strip().splitlines() or [''])[-1]}" for j in failed]
        lines += [f"  kernel {names[k]}: recompiling gave different bytes than the cached object "
                  "(non-deterministic codegen, or a stale entry)" for k in mismatched]
        head = (f"{len(failed)} of {len(jobs)} kernels failed to compile after all attempts (a retry in a fresh "
                f"process, then the safe fallback schedule)" if failed else "cache verification failed")
        report["kernels"] = [row for p in planned.values() for row in _kernel_rows(p, results)]
        raise BuildError(head + ":\n" + "\n".join(lines), report)
    out = []
    for i in range(len(entries)):
        if i in whole_hits:
            files, model_report = whole_hits[i]
            model_report = _as_whole_hit(model_report, time.time() - t_start)
            out.append(BuildResult(targets[entries[i][1]], None, None, files, model_report))
            report["models"].append({"model": model_report["model"], "target": model_report["target"]["name"],
                                     "totals": model_report["totals"], "whole_model_hit": True})
            for key in ("kernels", "kernel_calls", "cached"):  # a hit's kernels count as cached
                report["totals"][key] += model_report["totals"][key]
            if not store.readonly:
                n = model_report["totals"]["kernels"]
                build_log.append(store.root, model_report["model"], [], hits=n, lookups=n)
            continue
        p = planned[i]
        rows = _kernel_rows(p, results)
        model_results = [results[k] for k in dict.fromkeys(j.key for j in p.jobs)]
        if store is not None and not store.readonly:
            build_log.append(store.root, p.graph.name,
                             [{"id": kernel_id(c), "key": j.key, "parts": j.parts}
                              for c, j in zip(p.lowered.calls, p.jobs)],
                             hits=sum(r.cached for r in model_results), lookups=len(model_results))
        manifest = {"model": p.graph.name, "target": p.target.to_dict(), "opt_level": opt_level,
                    "cpu_features": p.target.cpu_flags()}
        degraded = any(r.fallback for r in model_results)  # nothing built from a fallback is stored
        from .bundle import assemble
        files = assemble(p.lowered, {j.symbol: results[j.key].object for j in p.jobs}, p.target, manifest,
                         None if degraded else store, [j.key for j in p.jobs])
        model_report = {"model": p.graph.name, "target": p.target.to_dict(), "opt_level": opt_level,
                        "executor": ex_name, "workers": workers_n, "totals": _totals(model_results, len(p.jobs)),
                        "kernels": rows, "passes": [{"name": n, "ms": round(ms, 3)} for n, ms in p.timings],
                        "timing": {"total_s": round(time.time() - t_start, 3), "compile_s": round(compile_s, 3)}}
        if model_keys[i] and not store.readonly and not degraded:
            store.put(model_keys[i], model_cache.pack(files, model_report, store))
        report["models"].append({"model": p.graph.name, "target": p.target.name, "totals": model_report["totals"]})
        out.append(BuildResult(p.target, p.graph, p.lowered, files, model_report, p.timings))
    report["timing"]["total_s"] = round(time.time() - t_start, 3)
    return BatchResult(out, report)


def build(model, target="llvm", opt_level: int = 3, shapes: dict | None = None, executor: "str | Executor" = "local",
          workers: int | None = None, cache=DEFAULT_CACHE, pass_context=None,
          kernel_timeout: float = 300.0, progress: bool | None = None, inject: dict | None = None,
          salt: str = "", extra_passes=(), verify_cache: bool = False, cache_readonly: bool = False,
          trace: str | None = None, ray_address: str | None = None) -> BuildResult:
    """Build one ONNX model (path, bytes or ModelProto) into a bundle for `target`.
    extra_passes run after the built-in graph passes and before fusion. See build_many
    for the other options."""
    batch = build_many([(model, target)], opt_level=opt_level, shapes=shapes, executor=executor, workers=workers,
                       cache=cache, pass_context=pass_context, kernel_timeout=kernel_timeout, progress=progress,
                       inject=inject, salt=salt, extra_passes=extra_passes, verify_cache=verify_cache,
                       cache_readonly=cache_readonly, trace=trace, ray_address=ray_address)
    return batch.results[0]
