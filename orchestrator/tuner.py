"""`kiln tune`: search the kernels' schedules on this machine, keep the best as records.

    result = kiln.tune(["resnet50.onnx"], budget_s=600)     # or trials=200
    kiln.build("resnet50.onnx")                              # follows the records, measures nothing

1. Each model is planned as a build plans it (rules only) and built; a profiled run on the
   measuring cores says how long each kernel takes. Kernels are deduplicated across the
   models by their digest (one shared by several models is tuned once, in the first) and
   weighted by their time in all of them. Kernels under MIN_SHARE of the time are left be.
2. Rounds until the budget is spent or every search has run its course: every kernel still
   searching gives its next point (tune_search; one whose expected gain fell far below the
   best's, by its time and its fruitless trials, every fourth round), lowered at each of its call sites
   (ir.lower.relower), compiled as build jobs are, on the executor and into the store;
   then each model's *variant* (every such kernel swapped for its candidate) is checked and
   timed A/B/A against the rules' model on cores that compile nothing meanwhile (compiling
   and measuring alternate): tune_measure. A variant that fails has its candidates checked
   alone to find the one at fault; the others go back in their queues.
3. At the end each kernel's best few points are measured again, together (the k-th best of
   every kernel in one variant); the best, if faster than the rules beyond noise, is its
   record's schedule, else the rules are (a record of {} says so). Kernels that improved are
   filed provisionally after every round, so an interrupted tune keeps what it measured,
   and a new tune goes on from there; a kernel whose search ran its course is skipped by
   later tunes (`retune` searches it again, from its record).
4. Each model's summary (the records of its kernels) enters its whole-model key.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from ..ir.errors import InternalError, KilnError
from ..ir.lower.group import relower
from ..ir.schedule import THREAD_KNOBS, ScheduleError, canonical
from ..ir.verify import verify_kernel

from .api import _executor
from .cache_key import key_of
from .cache_policy import CachePolicy
from .compile_stage import compile_all
from .options import BuildOptions
from .pipeline import plan_model, schedule_for
from .plan import make_job, unique_jobs
from .target import parse_target
from .tune_measure import (CONFIRM_ROUNDS, ROUNDS, Workspace, check_alone, measure_variant, profile_calls, ratios_of,
                           variant, variant_deadline, write_kernel_bundle, write_model)
from .tune_knowledge import MAX_LOG, Knowledge, kernel_features
from .tune_search import IMPROVES, KernelSearch
from .tuning_records import Records, make_record, record_parts, usable_cores

MIN_SHARE = 0.002  # kernels taking less of the models' time than this are not tuned
CONFIRM_BEST = 3  # points per kernel measured again before its record is written
# Expected gain steers the trials: a kernel's priority is its time, falling by FRUITLESS_DECAY
# with each trial that found nothing; one under LOW_PRIORITY of the highest takes part in one
# round of EVERY_NTH_ROUND only.
FRUITLESS_DECAY = 0.8
LOW_PRIORITY = 0.05
EVERY_NTH_ROUND = 4


@dataclass
class Task:
    """One kernel to tune (the same kernel at several call sites, or in several models, is one)."""
    digest: str
    model: int  # the model it is measured in: the first it appears in
    sites: list = field(default_factory=list)  # its KernelCalls in that model (rules' schedule)
    ms: float = 0.0  # its time in all the models, per run
    search: KernelSearch | None = None
    kernels: set = field(default_factory=set)  # digests of the kernels tried (equal kernels: one trial)
    trials: int = 0
    failed: list = field(default_factory=list)  # (point, why)
    record: dict | None = None
    done: bool = False  # has a complete record: not searched
    features: dict = field(default_factory=dict)  # orchestrator/tune_knowledge.py
    fruitless: int = 0  # trials since its best point last improved

    @property
    def priority(self) -> float:
        return self.ms * FRUITLESS_DECAY ** self.fruitless

    @property
    def name(self) -> str:
        return self.sites[0].name


@dataclass
class ModelState:
    """A model being tuned: its plan, a graph the candidates are lowered in, its objects, and
    the rules' bundles variants are measured against."""
    plan: object
    graph: object
    objects: dict  # symbol -> object bytes
    exposed: list  # tensors the checked bundles output: every tuned kernel's
    a_timed: str = ""
    a_checked: str = ""
    ms: float = 0.0  # one run (at each size), measured
    sizes: list = field(default_factory=lambda: [{}])  # symbol values it is measured at ({}: static)


@dataclass
class TuneResult:
    report: dict


class Tuner:
    def __init__(self, models, o: BuildOptions, threads: int, budget_s: float | None, trials: int | None,
                 retune: bool, progress: bool, learn: bool = True, tune_dims: dict | None = None):
        self.models, self.o = list(models), o
        self.target = parse_target(o.target)
        if not self.target.runnable:
            raise KilnError(f"tune: target {self.target.name} does not run on this machine, and tuning measures here")
        cpus = sorted(os.sched_getaffinity(0))
        if threads > len(cpus):
            raise KilnError(f"tune: {threads} threads, but this process may use {len(cpus)} cores")
        self.threads, self.measure_cpus = threads, cpus[-threads:]
        self.budget_s, self.max_trials = budget_s, trials
        self.retune, self.progress, self.tune_dims = retune, progress, tune_dims
        self.cache = CachePolicy(o)
        if self.cache.store is None or not self.cache.writable:
            raise KilnError("tune: records are kept in the store; give a writable --cache")
        self.records = Records(self.cache.store, self.target, threads)
        self.knowledge = Knowledge(self.cache.store, self.target, threads) if learn else None
        self.config = schedule_for(self.target)
        self.work = Workspace()
        self.tasks: dict[str, Task] = {}
        self.states: list[ModelState] = []
        self.trials = self.failed = self.resumed = self.rounds = 0
        self.t0 = time.monotonic()

    # -- the whole tune --------------------------------------------------------------------------
    def run(self) -> dict:
        try:
            with _executor(True, self.o) as ex:
                self.ex = ex
                self._prepare()
                try:
                    while not self._out_of_budget() and self._round():
                        pass
                except KeyboardInterrupt:  # (keep what was measured: a second interrupt ends it all)
                    sys.stderr.write("\nkiln tune: interrupted; confirming what was found\n")
                self._confirm()
                self._write_summaries()
                return self._report()
        finally:
            self.work.close()
            self._line(final=True)

    def _out_of_budget(self) -> bool:
        if self.max_trials is not None and self.trials >= self.max_trials:
            return True
        return self.budget_s is not None and time.monotonic() - self.t0 >= self.budget_s

    def _prepare(self) -> None:
        """Plan and build every model under the rules; profile it; make the tasks."""
        o = self.o
        plans = [plan_model(m, self.target, o.opt_level, o.shapes, None, (), o.salt, o.inject, o.dims,
                            precision=o.precision)
                 for m in self.models]
        jobs = unique_jobs([j for p in plans for j in p.jobs])
        results, _ = compile_all(jobs, self.cache, self.ex, o)
        failed = [j.name for j in jobs if not results[j.key].ok]
        if failed:
            raise KilnError(f"tune: the models do not build under the rules ({', '.join(failed[:5])} failed "
                            "to compile)")
        for index, p in enumerate(plans):
            graph = p.graph.copy()
            graph.types.update({t: v for t, v in p.lowered.types.items() if t not in graph.types})  # (names taken)
            objects = {j.symbol: results[j.key].object for j in p.jobs}
            state = ModelState(p, graph, objects, [])
            self.states.append(state)
            state.a_timed = write_model(p.lowered, objects, self.target, self.work.folder())
            state.sizes = tune_sizes(p.graph, self.tune_dims)
            times = profile_calls(state.a_timed, self.threads, self.measure_cpus, state.sizes)
            state.ms = sum(times)
            for call, ms in zip(p.lowered.calls, times):
                if not _tunable(call, p, self.threads):
                    continue
                task = self.tasks.setdefault(call.default_digest, Task(call.default_digest, index))
                task.ms += ms
                if task.model == index:
                    task.sites.append(call)
        total = sum(s.ms for s in self.states) or 1.0
        self.tasks = {d: t for d, t in self.tasks.items() if t.ms >= MIN_SHARE * total}
        for state in self.states:
            state.exposed = [o for c in state.plan.lowered.calls if c.default_digest in self.tasks
                             for o in c.outputs]
            state.a_checked = write_model(variant(state.plan.lowered, {}, state.graph, state.exposed), state.objects,
                                          self.target, self.work.folder())
        for task in self.tasks.values():
            self._start(task)

    def _start(self, task: Task) -> None:
        record = self.records.find(task.digest)
        task.record = record
        if record is not None and record.get("complete", True) and not self.retune:
            task.done = True
            self.resumed += 1
            return
        starts = [record["schedule"]] if record and record["schedule"] else []  # (resuming, or retuning)
        seed = self.records.seed(task.digest)  # (a record from another toolchain: a start, never applied)
        if seed and seed["schedule"]:
            starts.append(seed["schedule"])
        task.features = kernel_features(task.sites[0])
        predict = None
        if self.knowledge is not None:
            starts += self.knowledge.starts(task.features, task.digest)
            predict = self.knowledge.predictor(task.features, task.digest)
        unique = list({canonical(s): s for s in starts}.values())
        task.search = KernelSearch(_space(task.sites[0], self.threads), unique, predict)
        task.kernels.add(task.sites[0].kernel.digest)

    # -- one round: a point for every kernel still searching ----------------------------------------
    def _round(self) -> bool:
        """Try the next point of every searching kernel; False when no kernel has one."""
        swaps: dict[int, dict] = {}  # model -> {task digest: (point, candidate calls)}
        budget = None if self.max_trials is None else self.max_trials - self.trials
        searching = sorted((t for t in self.tasks.values() if not t.done), key=lambda t: -t.priority)
        top = searching[0].priority if searching else 0.0
        self.rounds += 1
        waiting = False  # (kernels left out of this round for their low priority)
        for task in searching:
            if budget is not None and sum(len(s) for s in swaps.values()) >= budget:
                break
            if task.priority < LOW_PRIORITY * top and self.rounds % EVERY_NTH_ROUND:
                waiting = True
                continue
            found = self._next_candidate(task)
            if found is not None:
                swaps.setdefault(task.model, {})[task.digest] = found
        if not swaps:
            return waiting
        chosen = [(d, point, calls) for by_task in swaps.values() for d, (point, calls) in by_task.items()]
        jobs = {id(c): make_job(c, self.target, self.o.opt_level, self.o.salt, self.o.inject)
                for _, _, calls in chosen for c in calls}
        results, _ = compile_all(unique_jobs(list(jobs.values())), self.cache, self.ex,
                              dataclasses.replace(self.o, progress=False))
        for model, by_task in swaps.items():
            state, live = self.states[model], {}
            for digest, (point, calls) in by_task.items():
                r = results[jobs[id(calls[0])].key]
                if not r.ok or r.fallback:  # (an object of the fallback schedule: codegen failed twice)
                    self._failed(self.tasks[digest], point, f"codegen failed: {r.kind or r.attempts[0]['kind']}")
                else:
                    live[digest] = (point, calls, r.object)
            if live:
                self._measure(state, live)
        self._line()
        return True

    def _next_candidate(self, task: Task):
        """(point, its call at every site) for the task's next point, or None."""
        while True:
            point = task.search.next()
            if point is None:
                return None
            graph = self.states[task.model].graph
            try:
                calls = [relower(graph, site, self.config, point) for site in task.sites]
            except ScheduleError:
                task.search.skip(point)
                continue
            if calls[0].kernel.digest in task.kernels:  # (the same kernel as a point tried: no trial)
                task.search.skip(point)
                continue
            task.kernels.add(calls[0].kernel.digest)
            try:
                verify_kernel(calls[0].kernel, calls[0].name, calls[0].ops)
            except InternalError as e:
                self._failed(task, point, f"malformed kernel: {e}")
                continue
            return point, calls

    def _variant_dirs(self, state: ModelState, live: dict) -> tuple[str, str]:
        """The timed and the checked bundle of the model with `live`'s candidates swapped in."""
        lowered = state.plan.lowered
        sites = {id(site): call for d, (_, calls, _) in live.items() for site, call in zip(self.tasks[d].sites, calls)}
        objects = {**state.objects, **{calls[0].kernel.symbol: obj for _, calls, obj in live.values()}}
        timed = write_model(variant(lowered, sites, state.graph), objects, self.target, self.work.folder())
        checked = write_model(variant(lowered, sites, state.graph, state.exposed), objects, self.target,
                              self.work.folder())
        return timed, checked

    def _run_variant(self, state: ModelState, live: dict, rounds: int):
        """The variant with `live`'s candidates, checked and timed against the rules' model:
        (its VariantResult, digest -> that kernel's ratio in each round)."""
        timed, checked = self._variant_dirs(state, live)
        r = measure_variant(state.a_timed, state.a_checked, timed, checked, self.threads, self.measure_cpus,
                            variant_deadline(rounds, len(state.sizes), state.ms), rounds, state.sizes)
        self.work.remove(timed)
        self.work.remove(checked)
        calls = state.plan.lowered.calls
        return r, {digest: ratios_of(r, [i for i, c in enumerate(calls) if c.default_digest == digest])
                   for digest in live} if r.ok else {}

    def _measure(self, state: ModelState, live: dict) -> None:
        """Measure one variant; record each candidate's ratio (or failure)."""
        r, ratios = self._run_variant(state, live, ROUNDS)
        if r.why:
            self._isolate(state, live)
        elif r.differing:
            self._blame(state, live, r.differing)
        else:
            for digest, (point, _, _) in live.items():
                per_round = ratios[digest]
                task = self.tasks[digest]
                before = task.search.best
                task.search.result(point, float(np.median(per_round)))
                task.trials += 1
                self.trials += 1
                task.fruitless = 0 if task.search.best != before else task.fruitless + 1
                if task.search.best != before:
                    self._keep(task, task.search.best, task.search.best_ratio, per_round, complete=False)

    def _blame(self, state: ModelState, live: dict, differing: list) -> None:
        """The first candidate (in run order) at or before the first differing tensor is wrong;
        the others are tried again in a later round (they read its output)."""
        calls = state.plan.lowered.calls
        producer = {o: i for i, c in enumerate(calls) for o in c.outputs}
        first = min(producer.get(t, len(calls)) for t in differing)
        swapped = sorted((i, c.default_digest) for i, c in enumerate(calls) if c.default_digest in live and i <= first)
        culprit = swapped[-1][1] if swapped else min(live, key=lambda d: producer.get(live[d][1][0].outputs[0], 0))
        for digest, (point, calls, _) in live.items():
            if digest == culprit:
                self._failed(self.tasks[digest], point, f"differs from the rules' schedule ({differing[0]})")
            else:
                _requeue(self.tasks[digest], point, calls)

    def _isolate(self, state: ModelState, live: dict) -> None:
        """A variant crashed or hung: check each candidate alone; fail those at fault, requeue the rest."""
        lowered = state.plan.lowered
        for digest, (point, calls, obj) in live.items():
            task = self.tasks[digest]
            site = task.sites[0]
            default_dir = write_kernel_bundle(site, lowered, state.objects[site.kernel.symbol], self.target,
                                              self.work.folder())
            cand_dir = write_kernel_bundle(calls[0], lowered, obj, self.target, self.work.folder(), state.graph)
            wrong = check_alone(default_dir, cand_dir, self.threads, self.measure_cpus, state.sizes)
            self.work.remove(default_dir)
            self.work.remove(cand_dir)
            if wrong:
                self._failed(task, point, wrong)
            else:
                _requeue(task, point, calls)

    def _failed(self, task: Task, point: dict, why: str) -> None:
        task.search.result(point, None)
        task.failed.append((point, why))
        task.fruitless += 1
        task.trials += 1
        self.trials += 1
        self.failed += 1

    # -- the end: the best points measured again, records written ------------------------------
    def _confirm(self) -> None:
        for model, state in enumerate(self.states):
            tasks = [t for t in self.tasks.values() if t.model == model and t.search and t.trials]
            confirmed: dict[str, list] = {t.digest: [] for t in tasks}
            for k in range(CONFIRM_BEST):
                live = {}
                for t in tasks:
                    ranked = [(p, r) for p, r in t.search.ranked(CONFIRM_BEST) if r < IMPROVES]
                    if k < len(ranked):
                        calls = [relower(state.graph, site, self.config, ranked[k][0]) for site in t.sites]
                        obj = self.cache.find_object(make_job(calls[0], self.target, self.o.opt_level,
                                                              self.o.salt).key)
                        if obj is not None:
                            live[t.digest] = (ranked[k][0], calls, obj)
                if not live:
                    break
                _, ratios = self._run_variant(state, live, CONFIRM_ROUNDS)
                for digest, rounds in ratios.items():
                    confirmed[digest].append((float(np.median(rounds)), live[digest][0], rounds))
            for t in tasks:
                best = min(confirmed[t.digest], key=lambda c: c[0], default=None)
                if best is not None and best[0] < IMPROVES:
                    self._keep(t, best[1], best[0], best[2], t.search.exhausted)
                else:
                    self._keep(t, {}, 1.0, best[2] if best else [], t.search.exhausted)

    def _keep(self, task: Task, schedule: dict, ratio: float, ratios: list, complete: bool) -> None:
        parts = record_parts(task.digest, self.target, self.threads)
        sizes = self.states[task.model].sizes
        task.record = make_record(parts, schedule, ratio, ratios, task.ms, task.trials, len(task.failed), task.name,
                                  complete, {"measured_at": sizes} if sizes != [{}] else None, task.features,
                                  task.search.log()[-MAX_LOG:])
        self.records.keep(task.record)

    def _write_summaries(self) -> None:
        for model, state in zip(self.models, self.states):
            key = self.cache.untuned_model_key(model, self.target)
            found = {c.default_digest: key_of(record_parts(c.default_digest, self.target, self.threads))
                     for c in state.plan.lowered.calls
                     if c.default_digest in self.tasks and self.tasks[c.default_digest].record}
            if key is not None and found:
                self.records.keep_summary(key, found)

    # -- what the user sees -------------------------------------------------------------------
    def _ratio(self, t: Task) -> float:
        if t.record and t.record["schedule"]:
            return t.record["ratio"]
        return t.search.best_ratio if t.search and not t.record else 1.0

    def _gain(self) -> float:
        """The expected fraction of the models' time saved by the best points found so far."""
        total = sum(s.ms for s in self.states)
        return sum(t.ms * (1 - self._ratio(t)) for t in self.tasks.values()) / total if total else 0.0

    def _line(self, final: bool = False) -> None:
        if not self.progress or not self.states:
            return
        elapsed = time.monotonic() - self.t0
        left = f", {max(0, self.budget_s - elapsed):.0f} s left" if self.budget_s else ""
        best = sorted((t for t in self.tasks.values() if self._ratio(t) < 1), key=self._ratio)[:3]
        shown = ", ".join(f"{t.name[6:28]} {self._ratio(t):.2f}x" for t in best)
        searching = sum(1 for t in self.tasks.values() if t.search and not t.search.exhausted)
        sys.stderr.write(f"\r\x1b[Ktune: {self.trials} trials ({self.failed} failed), {searching} of "
                         f"{len(self.tasks)} kernels searching, expected gain {100 * self._gain():.1f}%{left}"
                         + (f"; best {shown}" if shown else ""))
        if final:
            sys.stderr.write("\n")
        sys.stderr.flush()

    def _report(self) -> dict:
        kernels = []
        for t in sorted(self.tasks.values(), key=lambda t: -t.ms):
            row = {"name": t.name, "digest": t.digest, "ms": round(t.ms, 4), "trials": t.trials,
                   "failed": [{"schedule": p, "why": w} for p, w in t.failed]}
            if t.record:
                row.update(schedule=t.record["schedule"], ratio=t.record["ratio"] if t.record["schedule"] else 1.0,
                           complete=t.record.get("complete", True))
            kernels.append(row)
        return {"target": self.target.to_dict(), "threads": self.threads,
                "models": [s.plan.graph.name for s in self.states], "trials": self.trials, "failed": self.failed,
                "seconds": round(time.monotonic() - self.t0, 1),
                "kernels_tuned": sum(1 for t in self.tasks.values() if t.record), "kernels_resumed": self.resumed,
                "expected_gain": round(self._gain(), 4), "model_ms": round(sum(s.ms for s in self.states), 4),
                "kernels": kernels}


def _requeue(task: Task, point: dict, calls: list) -> None:
    task.kernels.discard(calls[0].kernel.digest)
    task.search.requeue(point)


def _space(call, threads: int) -> dict:
    """The knobs tuned: all, but those that only divide work between threads for one thread."""
    return {k: v for k, v in call.space.items() if threads > 1 or k not in THREAD_KNOBS}


def _tunable(call, plan, threads: int) -> bool:
    """A kernel tuned here: it has knobs, no KV cache tensor, and always runs."""
    caches = {t for c in plan.graph.caches for t in (c.past, c.present)}
    return bool(_space(call, threads)) and not call.guard and not caches & set(call.inputs + call.outputs)


def tune_sizes(graph, tune_dims: dict | None) -> list[dict]:
    """The symbol values a model is measured at: each symbol the caller gives (not a derived
    one) at the values `tune_dims` names, else at the midpoint and the top of its bounds; the
    k-th size takes each symbol's k-th value (a shorter list repeats its last)."""
    given = [s for s in graph.symbols if s not in graph.derived and not s.endswith("]")]
    if not given:
        return [{}]
    values = {}
    for s in given:
        lo, hi = graph.symbols[s]
        chosen = list((tune_dims or {}).get(s) or dict.fromkeys([(lo + hi) // 2, hi]))
        bad = [v for v in chosen if not lo <= v <= hi]
        if bad:
            raise KilnError(f"tune: --tune-dims {s}={bad[0]} is outside its bounds {lo}..{hi}")
        values[s] = chosen
    unknown = sorted(set(tune_dims or {}) - set(given))
    if unknown:
        raise KilnError(f"tune: --tune-dims names {', '.join(unknown)}, not a symbol of {graph.name} "
                        f"({', '.join(given)})")
    count = max(len(v) for v in values.values())
    return [{s: v[min(k, len(v) - 1)] for s, v in values.items()} for k in range(count)]


def tune(models, budget_s: float | None = None, trials: int | None = None, threads: int | None = None,
         retune: bool = False, learn: bool = True, tune_dims: dict | None = None, options: BuildOptions | None = None,
         **overrides) -> TuneResult:
    """Tune the kernels of `models` (paths, bytes or ModelProtos) on this machine for
    `threads` threads (default: the usable cores), for `budget_s` seconds or `trials` trials
    (default: 10 minutes), keeping the records in the store. learn: start and steer the
    searches from the store's records of similar kernels (tune_knowledge). tune_dims: symbol ->
    values a model with symbolic dims is measured at (tune_sizes). Build settings (target,
    executor, cache, shapes, dims, ...) as for build()."""
    o = BuildOptions.of(options, overrides)
    if budget_s is None and trials is None:
        budget_s = 600.0
    if isinstance(models, (str, bytes, os.PathLike)) or hasattr(models, "SerializeToString"):
        models = [models]
    progress = o.progress if o.progress is not None else sys.stderr.isatty()
    tuner = Tuner(models, o, threads or usable_cores(), budget_s, trials, retune, progress, learn, tune_dims)
    return TuneResult(tuner.run())
