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
import sys
import time
from dataclasses import dataclass, field, replace

from ..codegen_worker.llvm_options import check_options
from ..ir.errors import KilnError

from . import report
from .batch_manifest import BatchEntry
from .batch_schedule import ModelWork, Schedule
from .build_result import BuildError, BuildResult  # noqa: F401 - the API's names
from .cache_policy import CachePolicy
from .executors import make_executor
from .options import BuildOptions
from .plan import unique_jobs
from .target import parse_target


def optimize(*args, **kwargs):
    """Frontend + graph passes: see orchestrator.pipeline.optimize."""
    from .pipeline import optimize as _optimize
    return _optimize(*args, **kwargs)


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
                                 ("dims", m.dims), ("precision", m.precision)) if v is not None}
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
        ex.start()
        try:
            yield ex
        finally:
            ex.close()


def model_host_count(todo: int, o: BuildOptions) -> int:
    """How many processes plan and link a batch's `todo` models: the usable cores that codegen
    workers on this machine leave (all of them when the executor is Ray's: its workers are
    elsewhere), at least the driver itself; KILN_MODEL_HOSTS sets it. 1 (the driver) where
    this process already joined Ray: hosts fork before a build's executor starts."""
    from .executor import default_workers
    from .executor_local import InProcessExecutor, LocalExecutor
    if o.executor == "inprocess" or isinstance(o.executor, InProcessExecutor):
        return 1
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():  # (a process connected to Ray is not forked: gRPC's threads)
        return 1
    if "KILN_MODEL_HOSTS" in os.environ:
        return max(1, min(todo, int(os.environ["KILN_MODEL_HOSTS"])))
    local = o.executor == "local" or isinstance(o.executor, LocalExecutor)
    here = (o.workers or default_workers()) if local else 0
    return max(1, min(todo, default_workers() - here))


@contextlib.contextmanager
def _model_hosts(work, todo: list, o: BuildOptions):
    """Where the batch's models are planned and linked (orchestrator/model_hosts.py): forked
    hosts where model_host_count gives more than one, else the driver itself."""
    from .model_hosts import ForkedHosts, InDriverHosts
    count = model_host_count(len(todo), o)
    if count > 1:  # (imported once here, not again in every host)
        from . import bundle, pipeline  # noqa: F401 - imported for the forks
    hosts = ForkedHosts(work, count) if count > 1 else InDriverHosts(work)
    try:
        yield hosts
    finally:
        hosts.close()


def build_many(models, options: BuildOptions | None = None, **overrides) -> BatchResult:
    """Build several models in one batch: every kernel they share (same key) compiles once.

    Each entry of `models` is a model (path, bytes, ModelProto), a (model, target) pair, or a
    BatchEntry (or a dict of its fields) with settings of its own: target, opt_level, shapes,
    dims, precision (orchestrator/batch_manifest.py reads them from a manifest file).
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
    if o.max_error is not None:  # (its search builds one model many times over)
        raise KilnError("build_many: an accuracy budget (max_error) is per model: build each with build()")
    targets = _targets(entries)
    cache = CachePolicy(o)
    batch = _Batch(entries, o.fail_fast)
    keys = {i: batch.attempt(i, "read", lambda m=m, spec=spec, eo=eo: cache.model_key(m, targets[spec], eo))
            for i, (m, spec, eo) in enumerate(entries)}
    cache.prefetch(keys[i] for i in batch.alive(range(len(entries))))
    whole = {i: hit for i in batch.alive(range(len(entries))) if (hit := cache.find_bundle(keys[i])) is not None}
    todo = [i for i in batch.alive(range(len(entries))) if i not in whole]

    work = ModelWork(entries, targets, o, cache, keys, t_start)
    # (hosts first: they fork before any executor thread or Ray connection exists)
    with _model_hosts(work, todo, o) as hosts, _executor(bool(todo), o) as ex:
        schedule = Schedule(hosts, ex, cache, o, batch)
        schedule.run(todo)
        results, mismatched = schedule.compile.results, schedule.compile.mismatched
        compile_s = schedule.compile.seconds
        ex_name, workers = (ex.name, ex.workers) if ex else ("cache", 0)
        cluster = ex.describe() if hasattr(ex, "describe") else None
    planned = schedule.plans
    all_jobs = [j for p in planned.values() for j in p.jobs]
    jobs = unique_jobs(all_jobs)

    names = {j.key: j.name for j in jobs}
    batch_report = {"target": [targets[spec].to_dict() for _, spec, _ in entries], "opt_level": o.opt_level,
                    "executor": ex_name, "workers": workers,
                    "totals": {**report.totals([results[j.key] for j in jobs], len(all_jobs)),
                               "verify_mismatches": len(mismatched)},
                    "models": [], "timing": {"compile_s": round(compile_s, 3),
                                             "driver_s": round(schedule.driver_s, 3),
                                             "model_hosts": hosts.count},
                    **({"cluster": cluster} if cluster else {})}
    if o.trace:
        events = report.trace_events(results, names, t_start) + report.stage_events(
            schedule.stages, batch.labels, schedule.plans, t_start)
        with open(o.trace, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    failed = [j for j in jobs if not results[j.key].ok]
    if (failed or mismatched) and o.fail_fast:
        batch_report["kernels"] = [row for p in planned.values() for row in report.kernel_rows(p, results)]
        raise BuildError(report.failure_message(failed, mismatched, results, names, len(jobs)), batch_report)
    kernel_rows = schedule.failed_models(names)

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
            result = schedule.built[i]
            if cluster:
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


def build(model, target=None, options: BuildOptions | None = None, **overrides) -> BuildResult:
    """Build one ONNX model (path, bytes or ModelProto) into a bundle for `target` (default:
    the options' target, "llvm": this machine). The other settings as in build_many;
    extra_passes run after the built-in passes, before fusion."""
    o = BuildOptions.of(options, overrides)
    target = o.target if target is None else target
    if o.max_error is not None:
        from .accuracy_budget import build_within_budget
        return build_within_budget(build, model, target, o)
    return build_many([(model, target)], o, fail_fast=True).results[0]
