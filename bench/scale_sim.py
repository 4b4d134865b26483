"""A batch's measured tasks replayed on simulated workers (bench/bench_scale.py).

The batch is what one real build recorded (its trace: orchestrator/report.py): each model's
plan and link, and each compile job with the seconds a worker spent on it. The replay runs
them as Kiln's scheduler does (orchestrator/batch_schedule.py): every model's plan is
ready at the start; a plan's end makes its jobs ready, those whose key no earlier model sent
(a shared kernel compiles once); a model's link is ready once its last object exists.
Plans and links run before compile jobs where they share a slot (they unblock more work).

Where the tasks run:
  - `workers` compile slots;
  - plans and links on `hosts`: "driver" (one at a time, in the driver, as on a machine
    whose cores the workers take), a number of host slots of their own, or "workers" (the
    same slots as the compile jobs);
  - before any task starts the driver spends `dispatch_s` on it, one task at a time;
  - `cores`: where every slot, host and the driver share one machine of that many cores
    (each busy one runs at cores / busy when more are busy); None gives each its own core
    (a cluster).
Time advances in steps of `dt` seconds.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class Batch:
    order: list  # models, in the order their plans are asked for
    plans: dict  # model -> seconds
    links: dict  # model -> seconds
    jobs: dict = field(default_factory=dict)  # model -> [(key, seconds)], in the order its plan sends them


@dataclass
class _Task:
    kind: str  # "plan", "compile", "link"
    ref: object  # the model, or the job's key
    left: float  # seconds of work left


def simulate(batch: Batch, workers: int, hosts="workers", cores: int | None = None, dispatch_s: float = 0.0,
             dt: float = 0.002) -> float:
    """Seconds from the start to the last link's end."""
    host_slots = workers if hosts == "workers" else 0 if hosts == "driver" else int(hosts)
    missing: dict = {}  # model -> keys it still waits for
    waiting: dict = {}  # key -> models waiting for it
    known: set = set()
    # The driver's work, one item at a time: a task's dispatch, or (hosts="driver") a plan
    # or link run there, dispatch included; dispatches first (a plan's jobs are sent before
    # the driver plans the next model).
    dispatches: deque = deque()
    driver_runs: deque = deque()
    doing: _Task | None = None
    host_ready: deque = deque()
    compile_ready: deque = deque()
    on_hosts: list = []
    on_workers: list = []
    links_left, t = len(batch.order), 0.0

    def ready(kind: str, ref, seconds: float) -> None:
        if hosts == "driver" and kind != "compile":
            driver_runs.append(_Task(kind, ref, dispatch_s + seconds))
        else:
            dispatches.append(_Task(f"dispatch {kind}", (kind, ref, seconds), dispatch_s))

    for i in batch.order:
        ready("plan", i, batch.plans[i])

    def finish(task: _Task) -> None:
        nonlocal links_left
        if task.kind == "link":
            links_left -= 1
        elif task.kind == "plan":
            i = task.ref
            missing[i] = set()
            for key, seconds in dict(batch.jobs[i]).items():  # (a kernel a model calls twice: one job)
                if key in known and key not in waiting:
                    continue  # (compiled already)
                missing[i].add(key)
                waiting.setdefault(key, []).append(i)
                if key not in known:
                    known.add(key)
                    ready("compile", key, seconds)
            if not missing[i]:
                ready("link", i, batch.links[i])
        else:
            for i in waiting.pop(task.ref, []):
                missing[i].discard(task.ref)
                if not missing[i]:
                    ready("link", i, batch.links[i])

    while links_left:
        if doing is None and (dispatches or driver_runs):
            doing = (dispatches or driver_runs).popleft()
        if doing is not None and doing.left <= 0:  # (done: a dispatch hands its task on)
            task, doing = doing, None
            if task.kind.startswith("dispatch "):
                kind, ref, seconds = task.ref
                (compile_ready if kind == "compile" else host_ready).append(_Task(kind, ref, seconds))
            else:
                finish(task)
            continue
        while host_ready and len(on_hosts) < host_slots and (
                hosts != "workers" or len(on_hosts) + len(on_workers) < workers):
            on_hosts.append(host_ready.popleft())
        while compile_ready and len(on_workers) + (len(on_hosts) if hosts == "workers" else 0) < workers:
            on_workers.append(compile_ready.popleft())
        busy = len(on_workers) + len(on_hosts) + (doing is not None)
        if not busy:
            raise AssertionError("the simulated batch stalled: a model waits for a job nobody sends")
        t += dt
        step = dt * (1.0 if cores is None else min(1.0, cores / busy))
        if doing is not None:
            doing.left -= step
        for running in (on_hosts, on_workers):
            for task in list(running):
                task.left -= step
                if task.left <= 0:
                    running.remove(task)
                    finish(task)
    return t

