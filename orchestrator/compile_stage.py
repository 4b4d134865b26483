"""A batch's compile jobs: found in the store, waited for from another builder, or compiled.

Jobs are offered as the batch's models are planned, deduplicated by key against every job
already known (found, in flight or done); the executor compiles them in a thread of its
own (Executor.run_stream over a JobFeed) while the driver goes on planning, linking and
scheduling. Its results come back through a queue the driver reads when the stage's file
descriptor is readable, so every decision (store writes, leases, progress) is taken in the
driver's thread.
"""
from __future__ import annotations

import queue
import select
import threading
import time

from ..codegen_worker.zygote_client import SIGNAL_POLL_S

from .job_feed import JobFeed, Waker
from .plan import JobResult
from .progress import Progress


class CompileStage:
    def __init__(self, cache, ex, o):
        self.cache, self.ex, self.o = cache, ex, o
        self.results: dict[str, JobResult] = {}
        self.mismatched: list[str] = []  # --verify-cache: keys whose recompiled bytes differ from the store's
        self.leased: list = []  # jobs another builder on this store is compiling (artifacts/leases.py)
        self.answered: set[str] = set()  # keys whose results are final (a recompiled hit's: once compared)
        self.inflight = 0
        self.first_sent: float | None = None  # (perf_counter: the compile stage's span, for the report)
        self.last_answer: float | None = None
        self.leases = cache.leases()
        self.bar = Progress(0, ex.workers if ex else 0, enabled=o.progress if ex else False)
        self._known: set[str] = set()
        self._feed = JobFeed()
        self._answers: queue.SimpleQueue = queue.SimpleQueue()
        self._waker = Waker()  # (readable while answers wait)
        self._thread: threading.Thread | None = None

    def fileno(self) -> int:
        return self._waker.fileno()

    def offer(self, jobs) -> None:
        """Take the jobs not known yet: the store's answers are final at once (`answered`)
        unless --verify-cache compiles them again."""
        new = [j for j in dict((j.key, j) for j in jobs if j.key not in self._known).values()]
        self._known.update(j.key for j in new)
        self.cache.prefetch([j.key for j in new])
        found, to_compile = [], []
        for job in new:
            obj = self.cache.find_object(job.key)
            if obj is not None:
                self.results[job.key] = JobResult(job.key, True, obj, cached=True, worker="cache")
                found.append(job.key)
            if obj is not None and not self.o.verify_cache:
                self.answered.add(job.key)
                continue
            if obj is not None or self.leases is None or self.leases.take(job.key):
                to_compile.append(job)
            else:
                self.leased.append(job)
        self.bar.total += len(new)
        self.bar.update(cached=len(found))
        self._send(to_compile)

    def _send(self, jobs) -> None:
        if not jobs:
            return
        if self._thread is None:
            self.first_sent = time.perf_counter()
            self._thread = threading.Thread(target=self._run_executor, name="kiln-compile", daemon=True)
            self._thread.start()
        self.inflight += len(jobs)
        self._feed.put(jobs)

    def _run_executor(self) -> None:
        try:
            self.ex.run_stream(self._feed, self._answer)
        except BaseException as e:  # noqa: BLE001 - raised again in the driver's thread
            self._answer(e)

    def _answer(self, r) -> None:
        self._answers.put(r)
        self._waker.wake()

    def take(self) -> list[str]:
        """The keys answered since the last call (each new object stored, its lease released);
        raises what the executor's thread raised."""
        self._waker.drain()
        done = []
        while True:
            try:
                r = self._answers.get_nowait()
            except queue.Empty:
                return done
            if isinstance(r, BaseException):
                raise r
            self.inflight -= 1
            self.last_answer = time.perf_counter()
            self.answered.add(r.key)
            done.append(r.key)
            hit = self.results.get(r.key)
            if hit is not None and hit.cached:  # --verify-cache: a recompiled hit
                if r.ok and r.object != hit.object:
                    self.mismatched.append(r.key)
                hit.attempts = r.attempts
                continue
            self.results[r.key] = r
            self.cache.keep_object(r)
            if self.leases is not None:  # (after the object is stored: a waiter that sees neither compiles it)
                self.leases.release(r.key)
            self.bar.update(compiled=int(r.ok), failed=int(not r.ok))

    def wait_for_leased(self) -> list[str]:
        """Once this builder's own jobs are done: wait for the objects other builders hold
        leases on; compile those whose holder died or gave up. The keys found."""
        jobs, self.leased = self.leased, []
        found, ours = self.leases.wait_for([j.key for j in jobs], self.cache.find_object)
        for key, obj in found.items():
            self.results[key] = JobResult(key, True, obj, cached=True, worker="another builder")
            self.answered.add(key)
        self.bar.update(cached=len(found))
        self._send([j for j in jobs if j.key in set(ours)])
        return list(found)

    @property
    def seconds(self) -> float:
        """From the first job sent to the last answer."""
        return (self.last_answer or self.first_sent or 0.0) - (self.first_sent or 0.0)

    @property
    def idle(self) -> bool:
        """Nothing in flight and nothing waited for."""
        return self.inflight == 0 and not self.leased

    def close(self, cancel: bool = False) -> None:
        """Stop the executor's loop (at once with cancel, else once its jobs are done)."""
        if cancel:
            self._feed.cancel()
        else:
            self._feed.close()
        if self._thread is not None:
            self._thread.join()
        if self.leases is not None:
            self.leases.release_all()
        self.bar.close()
        self._feed.release()
        self._waker.close()


def compile_all(jobs, cache, ex, o) -> tuple[dict, list]:
    """Every job's result (from the store, another builder or the executor) and the
    --verify-cache mismatches: the stage run to the end for one list of jobs."""
    stage = CompileStage(cache, ex, o)
    try:
        stage.offer(jobs)
        while not stage.idle:
            if stage.inflight:
                select.select([stage], [], [], SIGNAL_POLL_S)  # (see batch_schedule: a Ctrl-C elsewhere)
                stage.take()
            else:
                stage.wait_for_leased()
    except BaseException:
        stage.close(cancel=True)
        raise
    stage.close()
    return stage.results, stage.mismatched
