"""A batch's models through their stages, streamed: each model is planned (by a model host,
orchestrator/model_hosts.py), its new compile jobs go to the executor as soon as its plan
arrives (orchestrator/compile_stage.py), and it is linked as soon as its last object exists,
while other models are still planning or compiling. The driver only schedules and records.
"""
from __future__ import annotations

import select
import time

from ..codegen_worker.zygote_client import SIGNAL_POLL_S

from . import report
from .build_result import BuildError, BuildResult
from .compile_stage import CompileStage
from .plan import kernel_id, unique_jobs


class ModelWork:
    """What a host does for model i of the batch: plan it, and link it from its objects."""

    def __init__(self, entries: list, targets: dict, o, cache, keys: dict, t_start: float):
        self.entries, self.targets, self.o, self.cache, self.keys = entries, targets, o, cache, keys
        self.t_start = t_start

    def plan(self, i: int):
        from .pipeline import plan_model  # (the heavy imports: only where something is planned)
        model, spec, eo = self.entries[i]
        o = self.o
        records = self.cache.records(self.targets[spec]) if o.tuning and self.cache.store else None
        return plan_model(model, self.targets[spec], eo.opt_level, eo.shapes, o.pass_context, o.extra_passes,
                          o.salt, o.inject, eo.dims, records, eo.precision, eo.fp32_nodes)

    def _manifest(self, i: int, p) -> dict:
        eo = self.entries[i][2]
        return {"model": p.graph.name, "target": p.target.to_dict(), "opt_level": eo.opt_level,
                "cpu_features": p.target.cpu_flags(), **({"accuracy": eo.accuracy} if eo.accuracy else {})}

    def prepare(self, i: int, p) -> None:
        """What of model i's bundle needs no object (its weights packed, its entry written),
        made while its kernels compile."""
        from .bundle import prepare
        if p.prepared is None:
            p.prepared = prepare(p.lowered, p.target, self._manifest(i, p))

    def link(self, i: int, p, results: dict, compile_s: float, executor: str, workers: int):
        """Link one planned model from its compiled kernels; store the bundle for next time."""
        from .bundle import assemble
        eo, cache = self.entries[i][2], self.cache
        model_results = [results[k] for k in dict.fromkeys(j.key for j in p.jobs)]
        cache.log(p.graph.name, [{"id": kernel_id(c), "key": j.key, "parts": j.parts}
                                 for c, j in zip(p.lowered.calls, p.jobs)],
                  hits=sum(r.cached for r in model_results), lookups=len(model_results))
        degraded = any(r.fallback for r in model_results)
        files = assemble(p.lowered, {j.symbol: results[j.key].object for j in p.jobs}, p.target,
                         self._manifest(i, p), cache.link_store(degraded), [j.key for j in p.jobs], p.prepared)
        model_report = {"model": p.graph.name, "target": p.target.to_dict(), "opt_level": eo.opt_level,
                        "precision": eo.precision, **({"accuracy": eo.accuracy} if eo.accuracy else {}),
                        "executor": executor, "workers": workers,
                        "totals": report.totals(model_results, len(p.jobs)),
                        "kernels": report.kernel_rows(p, results),
                        "passes": [{"name": n, "ms": round(ms, 3)} for n, ms in p.timings],
                        "tuning": report.tuning_summary(p, eo),
                        "timing": {"total_s": round(time.time() - self.t_start, 3), "compile_s": round(compile_s, 3),
                                   "driver_peak_rss_mb": report.peak_rss_mb()}}
        cache.keep_bundle(self.keys[i], files, model_report, degraded)
        return BuildResult(p.target, p.graph, p.lowered, files, model_report, p.timings)


class Schedule:
    """Runs the models `todo` of a batch to their bundles. After run(): `built` (model ->
    BuildResult), `plans` (model -> PlannedModel or PlanSummary), the compile stage's
    results, and `stages` (model, stage, start, end, where: the trace's plan and link spans)."""

    def __init__(self, hosts, ex, cache, o, batch):
        self.hosts, self.ex, self.o, self.batch = hosts, ex, o, batch
        self.compile = CompileStage(cache, ex, o)
        self.built: dict = {}
        self.plans: dict = {}
        self.stages: list = []
        self.compile_failed = False  # (with fail_fast: no more links; the batch fails once its compiles end)
        self._missing: dict[int, set] = {}  # model -> keys it still waits for
        self._waiting: dict[str, list] = {}  # key -> models waiting for it
        self._linking: set = set()
        self.waited_s = 0.0  # in select: for the hosts or the executor
        self.driver_s = 0.0

    def run(self, todo: list) -> None:
        t0 = time.perf_counter()
        try:
            self._run(todo)
        except BaseException:
            self.compile.close(cancel=True)
            raise
        self.compile.close()
        # (the driver's own work: neither waiting nor planning or linking in its own process)
        in_driver = sum(end - start for _, _, start, end, where in self.stages if where == "driver")
        self.driver_s = time.perf_counter() - t0 - self.waited_s - in_driver

    def _run(self, todo: list) -> None:
        planning = set(todo)
        for i in todo:
            self.hosts.plan(i)
        while True:
            events = self.hosts.events()
            if not events and self.compile.idle and not planning and not self._linking:
                return
            if not events:
                if not planning and self.compile.inflight == 0 and self.compile.leased:
                    self._objects_done(self.compile.wait_for_leased())
                    continue
                t_wait = time.perf_counter()
                # (a timeout: a Ctrl-C the kernel hands to another thread interrupts no select
                # here, and Python raises it only once this returns)
                ready, _, _ = select.select(self.hosts.waitables() + [self.compile], [], [], SIGNAL_POLL_S)
                self.waited_s += time.perf_counter() - t_wait
                if self.compile in ready:
                    self._objects_done(self.compile.take())
                events = self.hosts.events(ready)
            for kind, i, value, span in events:
                if kind == "replanned":  # (its host died: planned again by another)
                    planning.add(i)
                    self._linking.discard(i)
                    continue
                self.stages.append((i, "plan" if kind == "planned" else "link" if kind == "linked" else value[0],
                                    *span))
                if kind == "planned":
                    planning.discard(i)
                    self._planned(i, value)
                elif kind == "linked":
                    self._linking.discard(i)
                    self.built[i] = value
                else:
                    stage, error = value
                    planning.discard(i)
                    self._linking.discard(i)
                    self._fail(i, stage, error)

    def _fail(self, i: int, stage: str, error: Exception) -> None:
        if self.o.fail_fast:
            raise error
        self.batch.record(i, stage, error)

    def _planned(self, i: int, p) -> None:
        self.plans[i] = p
        self.compile.offer(p.jobs)
        self._missing[i] = {j.key for j in p.jobs} - self.compile.answered
        for k in self._missing[i]:
            if i not in self._waiting.setdefault(k, []):
                self._waiting[k].append(i)
        if not self._missing[i]:
            self._link(i)

    def _objects_done(self, keys: list) -> None:
        for k in keys:
            if not self.compile.results[k].ok:
                self.compile_failed = True
            for i in self._waiting.pop(k, ()):
                self._missing[i].discard(k)
                if not self._missing[i]:
                    self._link(i)

    def _link(self, i: int) -> None:
        """Model i's objects all exist: link it, unless one failed (its failure is recorded
        with the batch's, after the compiles)."""
        p, results = self.plans[i], self.compile.results
        if i in self._linking or i in self.built:  # (a model planned again: already on its way)
            return
        if any(not results[j.key].ok or j.key in self.compile.mismatched for j in p.jobs):
            return
        if self.o.fail_fast and self.compile_failed:
            return
        self._linking.add(i)
        compile_s = self.compile.seconds
        self.hosts.link(i, {"results": {j.key: results[j.key] for j in p.jobs}, "compile_s": compile_s,
                            "executor": self.ex.name if self.ex else "cache",
                            "workers": self.ex.workers if self.ex else 0})

    def failed_models(self, names: dict) -> dict:
        """Record each planned model whose kernels did not all compile (or recompiled to other
        bytes under --verify-cache) as failed at "compile"; {model: its kernels' report rows}."""
        results, mismatched, rows = self.compile.results, self.compile.mismatched, {}
        for i, p in self.plans.items():
            if i in self.built:
                continue
            own = unique_jobs(p.jobs)
            bad = [j for j in own if not results[j.key].ok]
            differ = [j.key for j in own if j.key in mismatched]
            if bad or differ:
                rows[i] = report.kernel_rows(p, results)
                self.batch.record(i, "compile", BuildError(report.failure_message(bad, differ, results, names,
                                                                                  len(own))))
        return rows
