"""The build API: ONNX models in, deployable bundles out.

    import modelkiln as kiln
    result = kiln.build("model.onnx", target="llvm", opt_level=3)
    result.export("out/")            # model.so + manifest.json + weights.bin
    module = kiln.load("out/")       # or result.load()

    batch = kiln.build_many(["a.onnx", ("b.onnx", "x86-64-v3")])   # kernels shared across models compile once

Stages: frontend -> passes (under a PassContext) -> lowering -> one compile job per unique
(kernel, target, options) key across the whole batch -> store lookup -> executor (a fresh
process per job) -> store write -> link each model.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from dataclasses import dataclass, field, replace

from ..codegen_worker.llvm_options import check_options
from ..ir.errors import KilnError

from . import report
from .batch_manifest import BatchEntry
from .bundle import write_bundle
from .cache_policy import CachePolicy
from .executors import make_executor
from .options import BuildOptions
from .plan import JobResult, kernel_id, unique_jobs
from .progress import Progress
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
    artifacts.store.StoredFile: blobs in the store, compared and read like bytes). `graph`
    and `lowered` are None when the bundle came whole from the store
    (report["whole_model_hit"]): nothing was optimized or lowered."""
    target: Target
    graph: object
    lowered: object
    files: dict
    report: dict
    pass_timings: list = field(default_factory=list)

    def export(self, path: str) -> str:
        return write_bundle(self.files, path)

    def load(self, threads: int | None = None):
        """Load the bundle without keeping it on disk: it is exported to a temporary folder
        that is gone again when this returns (the loaded library and weights live on in
        memory). threads: as artifacts.load."""
        from ..artifacts.module import Module
        with tempfile.TemporaryDirectory(prefix="kiln-module-") as tmp:
            return Module(self.export(os.path.join(tmp, "bundle")), threads)


@dataclass
class ModelFailure:
    """A model of a batch that was not built: which, at what stage ("read", "plan", "compile"
    or "link"), and the error that stopped it."""
    index: int
    model: str
    stage: str
    error: Exception

    @property
    def message(self) -> str:
        e = self.error
        return str(e).strip() if isinstance(e, KilnError) else f"internal error: {type(e).__name__}: {e}"

    def to_dict(self) -> dict:
        return {"model": self.model, "status": "failed", "stage": self.stage, "error": self.message}


@dataclass
class BatchResult:
    """results[i] is model i's BuildResult, or None where it failed (failures says why: a
    batch keeps going past a model that fails, unless BuildOptions.fail_fast)."""
    results: list
    report: dict
    failures: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


def _entry(m, o: BuildOptions) -> tuple:
    """(model, target spec, its options) of one entry of a batch: a model, a (model, target)
    pair, a BatchEntry, or a dict of BatchEntry's fields (what a manifest entry holds)."""
    if isinstance(m, dict):
        m = BatchEntry(**m)
    if isinstance(m, BatchEntry):
        own = {k: v for k, v in (("target", m.target), ("opt_level", m.opt_level), ("shapes", m.shapes),
                                 ("dims", m.dims)) if v is not None}
        eo = replace(o, **own)
        return m.model, eo.target, eo
    if isinstance(m, tuple):
        return m[0], m[1], replace(o, target=m[1])
    return m, o.target, o


def _label(model, i: int) -> str:
    """How a batch's report names a model before (or without) reading it."""
    if isinstance(model, (str, os.PathLike)):
        return os.fspath(model)
    name = getattr(getattr(model, "graph", None), "name", "")
    return f"model {i}" + (f" ({name})" if name else "")


class _Batch:
    """Each model's fate in a batch: a model that fails at some stage is recorded and left out
    of the stages after it; with fail_fast its error ends the batch instead, as it is raised."""

    def __init__(self, entries: list, fail_fast: bool):
        self.labels = [_label(m, i) for i, (m, *_) in enumerate(entries)]
        self.fail_fast = fail_fast
        self.failures: dict[int, ModelFailure] = {}

    def alive(self, indices) -> list:
        return [i for i in indices if i not in self.failures]

    def record(self, i: int, stage: str, error: Exception) -> None:
        self.failures[i] = ModelFailure(i, self.labels[i], stage, error)

    def attempt(self, i: int, stage: str, fn):
        """fn(), or None once its failure is recorded for model i."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - a model's failure, whatever it is, is that model's alone
            if self.fail_fast:
                raise
            self.record(i, stage, e)
            return None


def _targets(entries) -> dict:
    """Each target of the batch, parsed once; its LLVM options checked before any job runs."""
    targets: dict = {}
    for _, spec, _ in entries:
        if spec not in targets:
            targets[spec] = parse_target(spec)
            check_options(targets[spec].llvm_options, f"target {targets[spec].name}")
    return targets


@contextlib.contextmanager
def _executor(needed: bool, o: BuildOptions):
    """The executor for this batch: the caller's, or one made (and closed) here, only when a
    job must compile. Made before planning: Ray actors are slow to boot and boot meanwhile."""
    if not needed:
        yield None
    elif not isinstance(o.executor, str):
        yield o.executor
    else:
        ray_options = {"ship": o.ray_ship, "resource": o.ray_resource, "local_fallback": o.ray_local_fallback}
        ex = make_executor(o.executor, o.workers, o.kernel_timeout, o.ray_address,
                           **(ray_options if o.executor == "ray" else {}))
        try:
            yield ex
        finally:
            ex.close()


def _compile(jobs: list, cache: CachePolicy, ex, o: BuildOptions) -> tuple[dict, list]:
    """Every job's result, from the store or an executor; and the keys whose recompiled
    bytes differed from their stored object (--verify-cache). A missing kernel another
    builder on this store is compiling (its lease: artifacts/leases.py) is waited for, not
    compiled again, once this builder's own are done."""
    results: dict[str, JobResult] = {}
    to_compile, leased = [], []
    cache.prefetch([job.key for job in jobs])
    leases = cache.leases()
    for job in jobs:
        obj = cache.find_object(job.key)
        if obj is not None:
            results[job.key] = JobResult(job.key, True, obj, cached=True, worker="cache")
        if obj is not None and not o.verify_cache:
            continue
        (to_compile if obj is not None or leases is None or leases.take(job.key) else leased).append(job)
    bar = Progress(len(jobs), ex.workers if ex else 0, enabled=o.progress if ex else False)
    bar.update(cached=len(jobs) - len(leased) - sum(1 for j in to_compile if j.key not in results))
    mismatched = []

    def done(r: JobResult):
        hit = results.get(r.key)
        if hit is not None and hit.cached:  # --verify-cache: a recompiled hit
            if r.ok and r.object != hit.object:
                mismatched.append(r.key)
            hit.attempts = r.attempts
            return
        results[r.key] = r
        cache.keep_object(r)
        if leases is not None:  # (after the object is stored: a waiter that sees neither compiles it)
            leases.release(r.key)
        bar.update(compiled=int(r.ok), failed=int(not r.ok))

    try:
        if to_compile:
            ex.run(to_compile, done)
        if leased:
            found, ours = leases.wait_for([j.key for j in leased], cache.find_object)
            for key, obj in found.items():
                results[key] = JobResult(key, True, obj, cached=True, worker="another builder")
            bar.update(cached=len(found))
            if ours:
                ex.run([j for j in leased if j.key in set(ours)], done)
    finally:
        if leases is not None:
            leases.release_all()
        bar.close()
    return results, mismatched


def _assemble(p, results: dict, cache: CachePolicy, model_key, o: BuildOptions, ex_name: str, workers: int,
              compile_s: float, t_start: float) -> BuildResult:
    """Link one planned model from its compiled kernels; store the bundle for next time."""
    from .bundle import assemble
    model_results = [results[k] for k in dict.fromkeys(j.key for j in p.jobs)]
    cache.log(p.graph.name, [{"id": kernel_id(c), "key": j.key, "parts": j.parts}
                             for c, j in zip(p.lowered.calls, p.jobs)],
              hits=sum(r.cached for r in model_results), lookups=len(model_results))
    degraded = any(r.fallback for r in model_results)
    manifest = {"model": p.graph.name, "target": p.target.to_dict(), "opt_level": o.opt_level,
                "cpu_features": p.target.cpu_flags()}
    files = assemble(p.lowered, {j.symbol: results[j.key].object for j in p.jobs}, p.target, manifest,
                     cache.link_store(degraded), [j.key for j in p.jobs])
    model_report = {"model": p.graph.name, "target": p.target.to_dict(), "opt_level": o.opt_level,
                    "precision": o.precision, "executor": ex_name, "workers": workers, "totals": report.totals(model_results, len(p.jobs)),
                    "kernels": report.kernel_rows(p, results),
                    "passes": [{"name": n, "ms": round(ms, 3)} for n, ms in p.timings],
                    "tuning": report.tuning_summary(p, o),
                    "timing": {"total_s": round(time.time() - t_start, 3), "compile_s": round(compile_s, 3),
                               "driver_peak_rss_mb": report.peak_rss_mb()}}
    cache.keep_bundle(model_key, files, model_report, degraded)
    return BuildResult(p.target, p.graph, p.lowered, files, model_report, p.timings)


def build_many(models, options: BuildOptions | None = None, **overrides) -> BatchResult:
    """Build several models in one batch: every kernel they share (same key) compiles once.

    Each entry of `models` is a model (path, bytes, ModelProto), a (model, target) pair, or a
    BatchEntry (or a dict of its fields) with settings of its own: target, opt_level, shapes,
    dims (orchestrator/batch_manifest.py reads them from a manifest file).
    Settings: a BuildOptions and/or its fields as keywords (target, opt_level, shapes,
    executor, workers, cache, verify_cache, fail_fast, ...; see orchestrator/options.py).
    A model that fails to read, plan, compile or link fails alone: the others are built, and
    BatchResult.failures names each failed model, its stage and its error. With fail_fast the
    first failure is raised instead.
    """
    o = BuildOptions.of(options, overrides)
    t_start = time.time()
    entries = [_entry(m, o) for m in models]
    if not entries:
        raise KilnError("build_many: no models given")
    targets = _targets(entries)
    cache = CachePolicy(o)
    batch = _Batch(entries, o.fail_fast)
    keys = {i: batch.attempt(i, "read", lambda m=m, spec=spec, eo=eo: cache.model_key(m, targets[spec], eo))
            for i, (m, spec, eo) in enumerate(entries)}
    cache.prefetch(keys[i] for i in batch.alive(range(len(entries))))
    whole = {i: hit for i in batch.alive(range(len(entries))) if (hit := cache.find_bundle(keys[i])) is not None}
    todo = [i for i in batch.alive(range(len(entries))) if i not in whole]

    with _executor(bool(todo), o) as ex:
        if todo:
            from .pipeline import plan_model  # the heavy imports: only when something is not found whole
        planned = {}
        for i in todo:
            model, spec, eo = entries[i]
            records = cache.records(targets[spec]) if o.tuning and cache.store else None
            p = batch.attempt(i, "plan", lambda: plan_model(model, targets[spec], eo.opt_level, eo.shapes,
                                                            o.pass_context, o.extra_passes, o.salt, o.inject,
                                                            eo.dims, records, eo.precision))
            if p is not None:
                planned[i] = p
        all_jobs = [j for p in planned.values() for j in p.jobs]
        jobs = unique_jobs(all_jobs)
        t_compile = time.perf_counter()
        results, mismatched = _compile(jobs, cache, ex, o)
        compile_s = time.perf_counter() - t_compile
        ex_name, workers = (ex.name, ex.workers) if ex else ("cache", 0)
        cluster = ex.describe() if hasattr(ex, "describe") else None

    names = {j.key: j.name for j in jobs}
    batch_report = {"target": [targets[spec].to_dict() for _, spec, _ in entries], "opt_level": o.opt_level,
                    "executor": ex_name, "workers": workers,
                    "totals": {**report.totals([results[j.key] for j in jobs], len(all_jobs)),
                               "verify_mismatches": len(mismatched)},
                    "models": [], "timing": {"compile_s": round(compile_s, 3)},
                    **({"cluster": cluster} if cluster else {})}
    if o.trace:
        with open(o.trace, "w") as f:
            json.dump({"traceEvents": report.trace_events(results, names, t_start), "displayTimeUnit": "ms"}, f)
    failed = [j for j in jobs if not results[j.key].ok]
    if (failed or mismatched) and o.fail_fast:
        batch_report["kernels"] = [row for p in planned.values() for row in report.kernel_rows(p, results)]
        raise BuildError(report.failure_message(failed, mismatched, results, names, len(jobs)), batch_report)
    kernel_rows = _record_compile_failures(planned, results, mismatched, names, batch)

    out = []
    for i, (_, spec, eo) in enumerate(entries):
        result = None
        if i in whole:
            files, stored = whole[i]
            result = BuildResult(targets[spec], None, None, files, report.as_whole_hit(stored, time.time() - t_start))
            n = result.report["totals"]["kernels"]
            cache.log(result.report["model"], [], hits=n, lookups=n)
            for key in ("kernels", "kernel_calls", "cached"):  # a whole hit's kernels count as cached
                batch_report["totals"][key] += result.report["totals"][key]
        elif i not in batch.failures:
            result = batch.attempt(i, "link", lambda: _assemble(planned[i], results, cache, keys[i], eo, ex_name,
                                                                workers, compile_s, t_start))
            if result is not None and cluster:
                result.report["cluster"] = cluster
        if result is None:
            failure = batch.failures[i]
            batch_report["models"].append({**failure.to_dict(),
                                           **({"kernels": kernel_rows[i]} if i in kernel_rows else {})})
        else:
            batch_report["models"].append({"model": result.report["model"], "status": "built",
                                           "target": result.target.name, "totals": result.report["totals"],
                                           **({"whole_model_hit": True} if i in whole else {})})
        out.append(result)
    batch_report["totals"].update(models=len(entries), models_failed=len(batch.failures))
    batch_report["timing"].update(total_s=round(time.time() - t_start, 3), driver_peak_rss_mb=report.peak_rss_mb())
    return BatchResult(out, batch_report, [batch.failures[i] for i in sorted(batch.failures)])


def _record_compile_failures(planned: dict, results: dict, mismatched: list, names: dict, batch: _Batch) -> dict:
    """Fail each model whose kernels did not all compile (or recompiled to other bytes under
    --verify-cache), alone; {its index: its kernels' report rows}."""
    rows = {}
    for i, p in planned.items():
        own = unique_jobs(p.jobs)
        bad = [j for j in own if not results[j.key].ok]
        differ = [j.key for j in own if j.key in mismatched]
        if bad or differ:
            rows[i] = report.kernel_rows(p, results)
            batch.record(i, "compile", BuildError(report.failure_message(bad, differ, results, names, len(own))))
    return rows


def build(model, target=None, options: BuildOptions | None = None, **overrides) -> BuildResult:
    """Build one ONNX model (path, bytes or ModelProto) into a bundle for `target` (default:
    the options' target, "llvm": this machine). The other settings as in build_many;
    extra_passes run after the built-in passes, before fusion."""
    o = BuildOptions.of(options, overrides)
    return build_many([(model, o.target if target is None else target)], o, fail_fast=True).results[0]
