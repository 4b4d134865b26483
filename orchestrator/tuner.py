"""`kiln tune`: search the kernels' schedules on this machine, keep the best as records.

    result = kiln.tune(["resnet50.onnx"], budget_s=600)     # or trials=200
    kiln.build("resnet50.onnx")                              # follows the records, measures nothing

1. Each model is planned as a build plans it (rules only) and built; one profiled run on the
   measuring cores says how long each kernel takes. Kernels are deduplicated across the
   models by their digest (shared ones are tuned once) and weighted by their time in all.
2. Rounds until the budget is spent: the kernels with the most expected gain (their time, less
   for each trial that found nothing) each give their search's next point (tune_search);
   the points are lowered (ir.lower.relower) and compiled as build jobs are, on the executor,
   into the store; then each kernel's candidates are measured against its rules' kernel
   (tune_measure): checked on random inputs, timed A/B/A on cores that compile nothing
   meanwhile (compiling and measuring alternate).
3. A kernel whose search is done (or the whole tune, at the end) has its best few points
   measured again; the best, if faster than the rules by more than noise, is its record's
   schedule, else the rules are (a record of {} says so). Records are written as kernels
   finish, so an interrupted tune loses only the kernels in progress, and a new tune skips
   every kernel that has a record (`retune` does them again, starting from their schedules).
4. Each model's summary (the records of its kernels) enters its whole-model key.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass, field

from ..ir.errors import InternalError, KilnError
from ..ir.lower.group import relower
from ..ir.schedule import ScheduleError, canonical
from ..ir.verify import verify_kernel

from .api import _compile, _executor
from .bundle import assemble, write_bundle
from .cache_key import key_of
from .cache_policy import CachePolicy
from .options import BuildOptions
from .pipeline import plan_model, schedule_for
from .plan import make_job, unique_jobs
from .target import parse_target
from .tune_measure import CONFIRM_ROUNDS, Workspace, measure, profile_calls, write_kernel_bundle
from .tune_search import IMPROVES, KernelSearch
from .tuning_records import Records, make_record, record_parts, usable_cores

MIN_SHARE = 0.002  # kernels taking less of the models' time than this are not tuned
CONFIRM_BEST = 3  # points measured again before a record is written
FRUITLESS_DECAY = 0.8  # a kernel's priority falls by this much with each trial that found nothing


@dataclass
class Task:
    """One kernel to tune (the same kernel in several models is one task)."""
    digest: str
    call: object  # its KernelCall under the rules
    model: int  # the planned model it is lowered from
    ms: float = 0.0  # its time in all the models, per run
    search: KernelSearch | None = None
    default_dir: str = ""
    folders: dict = field(default_factory=dict)  # canonical point -> its bundle folder
    kernels: set = field(default_factory=set)  # digests of the kernels tried (equal kernels: one trial)
    trials: int = 0
    failed: list = field(default_factory=list)  # (point, why)
    fruitless: int = 0
    done: bool = False
    record: dict | None = None

    @property
    def priority(self) -> float:
        return self.ms * FRUITLESS_DECAY ** self.fruitless


@dataclass
class TuneResult:
    report: dict


def _planned_models(models, target, o: BuildOptions, cache, ex):
    """Each model planned under the rules and built, with its bundle's folder in `work`."""
    plans = [plan_model(m, target, o.opt_level, o.shapes, None, (), o.salt, None, o.dims) for m in models]
    jobs = unique_jobs([j for p in plans for j in p.jobs])
    results, _ = _compile(jobs, cache, ex, o)
    failed = [j.name for j in jobs if not results[j.key].ok]
    if failed:
        raise KilnError(f"tune: the models do not build under the rules ({', '.join(failed[:5])} failed to compile)")
    objects = {j.key: results[j.key].object for j in jobs}
    return plans, objects


def _tasks(plans, objects, profiles, records: Records, retune: bool) -> tuple[dict, int]:
    """The tunable kernels by digest with their time in all models; and how many already have records."""
    tasks: dict[str, Task] = {}
    for index, (p, times) in enumerate(zip(plans, profiles)):
        caches = {t for c in p.graph.caches for t in (c.past, c.present)}
        for call, ms in zip(p.lowered.calls, times):
            static = not any(b.name == "SYMBOLS" for b in call.kernel.buffers)
            if not call.space or not static or caches & set(call.inputs + call.outputs):
                continue
            task = tasks.setdefault(call.default_digest, Task(call.default_digest, call, index))
            task.ms += ms
    total = sum(sum(t) for t in profiles) or 1.0
    tasks = {d: t for d, t in tasks.items() if t.ms >= MIN_SHARE * total}
    resumed = 0
    for digest in list(tasks):
        existing = records.find(digest)
        tasks[digest].record = existing
        if existing is not None and existing.get("complete", True) and not retune:
            tasks[digest].done = True
            resumed += 1
    return tasks, resumed


class Tuner:
    def __init__(self, models, o: BuildOptions, threads: int, budget_s: float | None, trials: int | None,
                 retune: bool, progress: bool):
        self.models, self.o = list(models), o
        self.target = parse_target(o.target)
        if not self.target.runnable:
            raise KilnError(f"tune: target {self.target.name} does not run on this machine, and tuning measures here")
        cpus = sorted(os.sched_getaffinity(0))
        if threads > len(cpus):
            raise KilnError(f"tune: {threads} threads, but this process may use {len(cpus)} cores")
        self.threads, self.measure_cpus = threads, cpus[-threads:]
        self.budget_s, self.max_trials = budget_s, trials
        self.retune, self.progress = retune, progress
        self.cache = CachePolicy(o)
        if self.cache.store is None or not self.cache.writable:
            raise KilnError("tune: records are kept in the store; give a writable --cache")
        self.records = Records(self.cache.store, self.target, threads)
        self.config = schedule_for(self.target)
        self.work = Workspace()
        self.trials = self.failed = 0
        self.t0 = time.monotonic()

    # -- the loop -------------------------------------------------------------------------------
    def run(self) -> dict:
        try:
            with _executor(True, self.o) as ex:
                self.ex = ex
                plans, objects = _planned_models(self.models, self.target, self.o, self.cache, ex)
                self.plans, self.objects = plans, objects
                self.graphs = [p.graph.copy() for p in plans]
                profiles = [self._profile(p) for p in plans]
                self.tasks, resumed = _tasks(plans, objects, profiles, self.records, self.retune)
                self.total_ms = sum(sum(t) for t in profiles)
                for task in self.tasks.values():
                    if not task.done:
                        self._start(task)
                while not self._out_of_budget():
                    batch = self._next_batch()
                    if not batch:
                        break
                    self._run_batch(batch)
                for task in self.tasks.values():
                    if not task.done:
                        self._finish(task)
                self._write_summaries()
                return self._report(resumed)
        finally:
            self.work.close()
            self._line(final=True)

    def _out_of_budget(self) -> bool:
        if self.max_trials is not None and self.trials >= self.max_trials:
            return True
        return self.budget_s is not None and time.monotonic() - self.t0 >= self.budget_s

    def _profile(self, p) -> list[float]:
        """Each kernel call's time in the model built under the rules, on the measuring cores."""
        folder = self.work.folder()
        files = assemble(p.lowered, {j.symbol: self.objects[j.key] for j in p.jobs}, self.target,
                         {"model": p.graph.name, "target": self.target.to_dict(), "opt_level": self.o.opt_level,
                          "cpu_features": []})
        write_bundle(files, folder)
        times = profile_calls(folder, self.threads, self.measure_cpus)
        self.work.remove(folder)
        return times

    def _start(self, task: Task) -> None:
        p = self.plans[task.model]
        job = next(j for c, j in zip(p.lowered.calls, p.jobs) if c is task.call)
        task.default_dir = self.work.folder()
        write_kernel_bundle(task.call, p.lowered.types, p.lowered.constants, self.objects[job.key], self.target,
                            task.default_dir)
        seed = self.records.seed(task.digest)
        starts = [seed["schedule"]] if seed and seed["schedule"] else []
        if task.record and task.record["schedule"]:  # (retuning, or resuming: from where the last tune ended)
            starts.insert(0, task.record["schedule"])
        task.search = KernelSearch(task.call.space, starts)
        task.kernels.add(task.call.kernel.digest)

    def _next_batch(self) -> list:
        """(task, point, candidate call) for the next round: the highest-priority kernels' next points."""
        size = max(4, 2 * self.ex.workers)
        if self.max_trials is not None:
            size = min(size, self.max_trials - self.trials)
        batch, idle = [], set()
        while len(batch) < size:
            live = [t for t in self.tasks.values() if not t.done and t.digest not in idle]
            if not live:
                break
            task = max(live, key=lambda t: t.priority / (1 + sum(1 for b in batch if b[0] is t)))
            point = task.search.next()
            if point is None:
                idle.add(task.digest)
                if task.search.exhausted:
                    self._finish(task)
                continue
            try:
                call = relower(self.graphs[task.model], task.call, self.config, point)
            except ScheduleError:
                task.search.skip(point)
                continue
            if call.kernel.digest in task.kernels:  # (the same kernel as a point tried: no trial)
                task.search.skip(point)
                continue
            task.kernels.add(call.kernel.digest)
            try:
                verify_kernel(call.kernel, call.name, call.ops)
            except InternalError as e:
                self._failed(task, point, f"malformed kernel: {e}")
                continue
            batch.append((task, point, call))
        return batch

    def _run_batch(self, batch: list) -> None:
        jobs = [make_job(call, self.target, self.o.opt_level, self.o.salt) for _, _, call in batch]
        results, _ = _compile(unique_jobs(jobs), self.cache, self.ex, dataclasses.replace(self.o, progress=False))
        by_task: dict[str, list] = {}
        for (task, point, call), job in zip(batch, jobs):
            r = results[job.key]
            if not r.ok or r.fallback:  # (an object of the fallback schedule: codegen failed twice)
                self._failed(task, point, f"codegen failed: {r.kind or r.attempts[0]['kind']}")
                continue
            folder = self.work.folder()
            graph = self.graphs[task.model]
            write_kernel_bundle(call, {**self.plans[task.model].lowered.types, **graph.types}, graph.constants,
                                r.object, self.target, folder)
            by_task.setdefault(task.digest, []).append((point, folder))
        for digest, points in by_task.items():
            task = self.tasks[digest]
            trials = measure(task.default_dir, [f for _, f in points], self.threads, self.measure_cpus)
            for (point, folder), trial in zip(points, trials):
                self.trials += 1
                task.trials += 1
                if not trial.ok:
                    self._failed(task, point, trial.why)
                    self.work.remove(folder)
                    continue
                before = task.search.best_ratio
                task.search.result(point, trial.ratio)
                task.fruitless = 0 if task.search.best_ratio < before else task.fruitless + 1
                task.folders[canonical(point)] = folder
            self._line()

    def _failed(self, task: Task, point: dict, why: str) -> None:
        task.search.result(point, None)
        task.failed.append((point, why))
        task.fruitless += 1
        self.failed += 1

    def _finish(self, task: Task) -> None:
        """Measure the best few points again; keep the best as the kernel's record."""
        task.done = True
        if task.search is None or task.trials == 0:
            return
        best = task.search.ranked(CONFIRM_BEST)
        schedule, ratio, ratios, default_ms = {}, 1.0, [], 0.0
        if best and best[0][1] < IMPROVES:
            folders = [task.folders[canonical(point)] for point, _ in best]
            confirmed = measure(task.default_dir, folders, self.threads, self.measure_cpus, CONFIRM_ROUNDS)
            good = [(t.ratio, point, t) for (point, _), t in zip(best, confirmed) if t.ok]
            if good:
                r, point, t = min(good, key=lambda g: g[0])
                default_ms, ratios = t.default_ms, t.ratios
                if r < IMPROVES:
                    schedule, ratio = point, r
        parts = record_parts(task.digest, self.target, self.threads)
        task.record = make_record(parts, schedule, ratio, ratios, default_ms, task.trials, len(task.failed),
                                  task.call.name, task.search.exhausted)
        self.records.keep(task.record)
        for folder in task.folders.values():
            self.work.remove(folder)
        task.folders.clear()
        self.work.remove(task.default_dir)

    def _write_summaries(self) -> None:
        for model, p in zip(self.models, self.plans):
            key = self.cache.untuned_model_key(model, self.target)
            found = {c.default_digest: key_of(record_parts(c.default_digest, self.target, self.threads))
                     for c in p.lowered.calls if c.default_digest in self.tasks and self.tasks[c.default_digest].record}
            if key is not None and found:
                self.records.keep_summary(key, found)

    # -- what the user sees -------------------------------------------------------------------
    def _gain(self) -> float:
        """The expected fraction of the models' time saved by the best points found so far."""
        saved = sum(t.ms * (1 - (t.record["ratio"] if t.record else t.search.best_ratio if t.search else 1.0))
                    for t in self.tasks.values())
        return saved / self.total_ms if getattr(self, "total_ms", 0) else 0.0

    def _line(self, final: bool = False) -> None:
        if not self.progress or not hasattr(self, "tasks"):
            return
        elapsed = time.monotonic() - self.t0
        left = f", {max(0, self.budget_s - elapsed):.0f} s left" if self.budget_s else ""
        best = sorted((t for t in self.tasks.values() if t.search and t.search.best_ratio < 1),
                      key=lambda t: t.search.best_ratio)[:3]
        shown = ", ".join(f"{t.call.name[6:30]} {t.search.best_ratio:.2f}x" for t in best)
        done = sum(t.done for t in self.tasks.values())
        sys.stderr.write(f"\r\x1b[Ktune: {self.trials} trials ({self.failed} failed), {done}/{len(self.tasks)} kernels "
                         f"done, expected gain {100 * self._gain():.1f}%{left}" + (f"; best {shown}" if shown else ""))
        if final:
            sys.stderr.write("\n")
        sys.stderr.flush()

    def _report(self, resumed: int) -> dict:
        kernels = []
        for t in sorted(self.tasks.values(), key=lambda t: -t.ms):
            row = {"name": t.call.name, "digest": t.digest, "ms": round(t.ms, 4), "trials": t.trials,
                   "failed": [{"schedule": p, "why": w} for p, w in t.failed]}
            if t.record:
                row.update(schedule=t.record["schedule"], ratio=t.record["ratio"] if t.record["schedule"] else 1.0)
            kernels.append(row)
        return {"target": self.target.to_dict(), "threads": self.threads, "models": [p.graph.name for p in self.plans],
                "trials": self.trials, "failed": self.failed, "seconds": round(time.monotonic() - self.t0, 1),
                "kernels_tuned": sum(1 for t in self.tasks.values() if t.record), "kernels_resumed": resumed,
                "expected_gain": round(self._gain(), 4), "model_ms": round(self.total_ms, 4), "kernels": kernels}


def tune(models, budget_s: float | None = None, trials: int | None = None, threads: int | None = None,
         retune: bool = False, options: BuildOptions | None = None, **overrides) -> TuneResult:
    """Tune the kernels of `models` (paths, bytes or ModelProtos) on this machine for
    `threads` threads (default: the usable cores), for `budget_s` seconds or `trials` trials
    (default: 10 minutes), keeping the records in the store. Build settings (target,
    executor, cache, shapes, ...) as for build()."""
    o = BuildOptions.of(options, overrides)
    if budget_s is None and trials is None:
        budget_s = 600.0
    if isinstance(models, (str, bytes, os.PathLike)) or hasattr(models, "SerializeToString"):
        models = [models]
    progress = o.progress if o.progress is not None else sys.stderr.isatty()
    tuner = Tuner(models, o, threads or usable_cores(), budget_s, trials, retune, progress)
    return TuneResult(tuner.run())

