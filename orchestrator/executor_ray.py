"""RayExecutor: codegen jobs sharded to long-lived Ray actors, each owning a zygote.

A Ray task or actor per job costs 0.7-1 s here; a fork from the actor's zygote costs
~15 ms, so actors live for the whole build (and across builds of one executor) and each
forks a fresh child per job, exactly as the local executor does. The driver ships kernels
as bytes and receives object bytes: plain data both ways.

Small jobs travel in batches so Ray round trips do not dominate; GEMM kernels (the slow
ones) go alone. An actor that dies is replaced and never handed work again; its batch
counts as a failed attempt and is retried under the common policy. Jobs are idempotent,
so a batch that ran twice is harmless.
"""
from __future__ import annotations

import itertools
import os
import shutil
import socket
import tempfile
import time
from collections import deque

from ..codegen_worker import faults
from ..ir.errors import KilnError

from .executor import ATTEMPTS, Executor, default_workers, settle
from .plan import JobResult

SMALL_BATCH = 4  # non-GEMM jobs per round trip
ACTOR_START_TIMEOUT = 120.0  # seconds for at least one actor to come up (an autoscaler may add nodes)
ANSWER_MARGIN = 15.0  # seconds an actor may take beyond its jobs' deadlines before it counts as dead


class _Actor:
    """The actor body (wrapped by ray.remote at first use, so importing this module
    does not import Ray)."""

    def __init__(self):
        from ..codegen_worker.zygote_client import ZygoteClient
        self.zygote = ZygoteClient()
        self.name = f"ray:{socket.gethostname()}:{os.getpid()}"

    def compile(self, requests: list) -> list:
        out = []
        for header, blob in requests:
            faults.in_actor(header)
            t0 = time.time()
            try:
                self.zygote.send(header, blob)
                msg = self.zygote.receive()
            except OSError:  # a broken pipe: the zygote died
                msg = None
            if msg is None:
                from ..codegen_worker.zygote_client import ZygoteClient
                self.zygote.close()
                self.zygote = ZygoteClient()
                msg = ({"id": header["id"], "ok": False, "kind": "crash", "message": "the zygote process died"}, b"")
            out.append((msg[0], msg[1], t0, time.time(), self.name))
        return out

    def ping(self) -> str:
        return self.name


class RayExecutor(Executor):
    name = "ray"

    def __init__(self, workers: int | None = None, kernel_timeout: float = 300.0, address: str | None = None,
                 start_timeout: float = ACTOR_START_TIMEOUT):
        try:
            import ray
        except ImportError:
            raise KilnError("the ray executor needs Ray: pip install ray") from None
        self.ray = ray
        address = address or os.environ.get("RAY_ADDRESS")
        self._started_ray = False
        self._ray_tmp = None
        if not ray.is_initialized():
            from .. import IMPORT_ROOT  # workers import Kiln from where this process did
            kwargs = {"include_dashboard": False, "log_to_driver": False,
                      "runtime_env": {"env_vars": {"PYTHONPATH": IMPORT_ROOT}}}
            if address:
                ray.init(address=address, **kwargs)
            else:
                # Ray keeps a session folder (logs, sockets) after shutdown; one Kiln started
                # is Kiln's to remove.
                self._ray_tmp = tempfile.mkdtemp(prefix="kiln-ray-")
                ray.init(num_cpus=workers or default_workers(), _temp_dir=self._ray_tmp, **kwargs)
            self._started_ray = True
        cluster_cpus = int(ray.cluster_resources().get("CPU", 1))
        self.workers = workers or cluster_cpus
        self.kernel_timeout = kernel_timeout
        self.start_timeout = start_timeout
        self._checked = False
        self._remote = ray.remote(num_cpus=1, max_restarts=0, max_concurrency=1)(_Actor)
        self._actors: list = []
        self._booting: dict = {}
        self._ids = itertools.count()
        self.replaced = 0
        self._pool()  # actor creation is asynchronous: they boot while the caller plans

    def _spawn(self):
        return self._remote.options(scheduling_strategy="SPREAD").remote()

    def _pool(self) -> list:
        while len(self._actors) < self.workers:
            self._actors.append(self._spawn())
        return self._actors

    def _ready_pool(self) -> list:
        """The actors, once at least one is known to be up. Actors that cannot be placed (the
        cluster's CPUs are taken) would otherwise leave a build waiting forever."""
        actors = self._pool()
        if self._checked:
            return actors
        ray = self.ray
        pings = {a.ping.remote(): a for a in actors}
        ready, waiting = ray.wait(list(pings), num_returns=len(pings), timeout=self.start_timeout)
        if not ready:
            for a in actors:
                ray.kill(a)
            self._actors = []
            raise KilnError(f"no Kiln codegen actor started on the Ray cluster within {self.start_timeout:.0f} s "
                            f"(each needs 1 CPU; available now: {ray.available_resources().get('CPU', 0)} of "
                            f"{ray.cluster_resources().get('CPU', 0)})")
        for ref in waiting:  # run with the ones that came up; do not hold CPUs we cannot use
            ray.kill(pings[ref])
            self._actors.remove(pings[ref])
        self.workers = len(self._actors)
        self._checked = True
        return self._actors

    @staticmethod
    def _take_batch(items: deque) -> list:
        """Take one batch off the queue: a GEMM job alone, else up to SMALL_BATCH small jobs."""
        batch = [items.popleft()]
        if batch[0][0].travels_alone:
            return batch
        while items and len(batch) < SMALL_BATCH and not items[0][0].travels_alone:
            batch.append(items.popleft())
        return batch

    def _answer_deadline(self, batch: list) -> float:
        """When a batch's answer is overdue: its jobs' own deadlines (the zygote enforces
        those) plus a margin for the round trip. An actor silent past it is taken for dead."""
        return time.monotonic() + self.kernel_timeout * len(batch) + ANSWER_MARGIN

    def run(self, jobs, on_result=None):
        ray = self.ray
        results = {j.key: JobResult(j.key, False) for j in jobs}
        pending = deque((j, 0) for j in jobs)
        busy: dict = {}  # future -> (actor, [(job, attempt, t_sent)], answer deadline)
        booting = self._booting  # ping future -> (replacement actor, start deadline); kept across runs
        starting = {id(a) for a, _ in booting.values()}
        idle = [a for a in self._ready_pool() if id(a) not in starting]

        def finish(job, attempt, header, blob, worker, t0, t1):
            if settle(job, results[job.key], header, blob, attempt, worker, t0, t1):
                if on_result:
                    on_result(results[job.key])
            else:
                pending.appendleft((job, attempt + 1))

        def lose(actor, batch, why: str, kind: str):
            """The actor is dead or silent: never use it again, start a replacement (which must
            answer a ping before it gets work), and fail its batch's attempt."""
            self._actors.remove(actor)
            self._kill(actor)
            self.replaced += 1
            fresh = self._spawn()
            self._actors.append(fresh)
            booting[fresh.ping.remote()] = (fresh, time.monotonic() + self.start_timeout)
            worker = "ray:dead-actor" if kind == "crash" else "ray:silent-actor"
            for job, attempt, t_sent in batch:
                finish(job, attempt, {"ok": False, "kind": kind, "message": why}, b"", worker, t_sent, time.time())

        while pending or busy:
            while pending and idle:
                actor = idle.pop()
                batch = [(job, attempt, time.time()) for job, attempt in self._take_batch(pending)]
                requests = []
                for job, attempt, _ in batch:
                    req = job.request(next(self._ids), ATTEMPTS[attempt], self.kernel_timeout, attempt + 1)
                    requests.append((req, job.kernel_bytes))
                busy[actor.compile.remote(requests)] = (actor, batch, self._answer_deadline(batch))
            if not busy and not booting:
                raise KilnError(f"no Kiln codegen actor is left on the Ray cluster ({self.replaced} replaced; "
                                f"replacements did not start within {self.start_timeout:.0f} s); "
                                f"{len(pending)} jobs were not compiled")
            deadlines = [d for _, _, d in busy.values()] + [d for _, d in booting.values()]
            wait = max(0.0, min(deadlines) - time.monotonic())
            ready, _ = ray.wait(list(busy) + list(booting), num_returns=1, timeout=wait)
            now = time.monotonic()
            for ref, (actor, deadline) in list(booting.items()):
                if ref in ready:
                    del booting[ref]
                    try:
                        ray.get(ref)
                        idle.append(actor)
                    except ray.exceptions.RayError:
                        self._actors.remove(actor)  # died while starting: not replaced again
                elif now >= deadline:
                    del booting[ref]
                    self._actors.remove(actor)
                    self._kill(actor)
            for ref, (actor, batch, deadline) in list(busy.items()):
                if ref in ready:
                    del busy[ref]
                    try:
                        outs = ray.get(ref)
                    except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError) as e:
                        lose(actor, batch, f"Ray actor died: {type(e).__name__}", "crash")
                        continue
                    idle.append(actor)
                    for (job, attempt, _), (header, blob, t0, t1, worker) in zip(batch, outs):
                        finish(job, attempt, header, blob, f"{worker}:{header.get('pid', '?')}", t0, t1)
                elif now >= deadline:
                    del busy[ref]
                    waited = self.kernel_timeout * len(batch) + ANSWER_MARGIN
                    lose(actor, batch, f"Ray actor did not answer within {waited:.0f} s (taken for dead)", "timeout")
        return results

    def _kill(self, actor) -> None:
        try:
            self.ray.kill(actor)
        except Exception:  # noqa: BLE001 - already dead is fine
            pass

    def close(self):
        for actor in self._actors:
            self._kill(actor)
        self._actors = []
        self._booting = {}
        self._checked = False
        if self._started_ray:
            self.ray.shutdown()
            self._started_ray = False
        if self._ray_tmp:
            shutil.rmtree(self._ray_tmp, ignore_errors=True)
            self._ray_tmp = None
