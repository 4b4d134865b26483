"""Local executors.

- LocalExecutor: a zygote process (codegen_worker.zygote) forks a fresh child per job;
  up to `workers` children at a time. The default.
- InProcessExecutor: compiles in the caller's process. A debug mode only: LLVM options set
  by one job leak into every later job in the process (the isolation test shows it).
"""
from __future__ import annotations

import itertools
import os
import time
from collections import deque

from ..codegen_worker.zygote_client import WOKEN, ZygoteClient

from .executor import ATTEMPTS, Executor, default_workers, settle
from .job_feed import JobFeed
from .plan import CompileJob, JobResult


class LocalExecutor(Executor):
    name = "local"

    def __init__(self, workers: int | None = None, kernel_timeout: float = 300.0):
        self.workers = workers or default_workers()
        self.kernel_timeout = kernel_timeout
        # Started by start() (a build with models to plan: it boots while they plan) or by the
        # first job; a build the store answers whole never starts it.
        self._zygote: ZygoteClient | None = None
        self._ids = itertools.count()

    @property
    def zygote(self) -> ZygoteClient:
        if self._zygote is None:
            self._zygote = ZygoteClient()
        return self._zygote

    def start(self) -> None:
        self.zygote  # noqa: B018 - (its process imports LLVM while the driver plans)

    def run(self, jobs, on_result=None):
        feed = JobFeed(jobs, closed=True)
        try:
            return self.run_stream(feed, on_result)
        finally:
            feed.release()

    def run_stream(self, feed, on_result=None):
        results: dict[str, JobResult] = {}
        pending: deque = deque()
        inflight: dict[int, tuple[CompileJob, int, float]] = {}
        while True:
            if feed.cancelled:
                if inflight:  # (killed with their zygote: a result must not reach a later run)
                    self.close()
                break
            jobs, finished = feed.take()  # (which also drains its wake-ups: a closed feed wakes no one twice)
            for job in jobs:
                results[job.key] = JobResult(job.key, False)
                pending.append((job, 0))
            if not pending and not inflight:
                if finished:
                    break
                feed.wait()
                continue
            msg = None
            try:
                while pending and len(inflight) < self.workers:
                    job, attempt = pending.popleft()
                    jid = next(self._ids)
                    inflight[jid] = (job, attempt, time.time())
                    self.zygote.send(job.request(jid, ATTEMPTS[attempt], self.kernel_timeout, attempt + 1),
                                     job.kernel_bytes)
                # (new jobs for a free worker, and a cancel, wake it too)
                msg = self.zygote.receive(feed)
            except OSError:  # a broken pipe: the zygote is gone (handled below)
                pass
            if msg is WOKEN:
                continue
            if msg is None:  # the zygote itself died: every job in flight failed this attempt
                self._zygote.close()
                self._zygote = None
                lost = list(inflight.values())
                inflight.clear()
                for job, attempt, t_sent in lost:
                    header = {"ok": False, "kind": "crash", "message": "the zygote process died"}
                    if not settle(job, results[job.key], header, b"", attempt, "zygote", t_sent, time.time()):
                        pending.append((job, attempt + 1))
                    elif on_result:
                        on_result(results[job.key])
                continue
            header, blob = msg
            job, attempt, t_sent = inflight.pop(header["id"])
            if settle(job, results[job.key], header, blob, attempt, f"local:{header.get('pid', '?')}", t_sent,
                      time.time()):
                if on_result:
                    on_result(results[job.key])
            else:
                pending.appendleft((job, attempt + 1))
        return results

    def close(self):
        if self._zygote is not None:
            self._zygote.close()
            self._zygote = None


class InProcessExecutor(Executor):
    """Debug only: compiles in this process, so LLVM options leak between jobs."""
    name = "inprocess"

    def run(self, jobs, on_result=None):
        import traceback

        from ..codegen_worker.compile import compile_kernel
        results = {}
        for job in jobs:
            result = JobResult(job.key, False)
            for attempt, fallback in enumerate(ATTEMPTS):
                t0, wall = time.perf_counter(), time.time()
                try:
                    res = compile_kernel(job.kernel_bytes, job.symbol, job.target.to_dict(),
                                         job.target.llvm_options, job.opt_level, fallback)
                    header = {"ok": True, "ms": (time.perf_counter() - t0) * 1e3, "log": res["log"]}
                    blob = res["object"]
                except Exception as e:  # noqa: BLE001
                    header, blob = {"ok": False, "kind": "llvm_error", "message": str(e),
                                    "log": traceback.format_exc()}, b""
                if settle(job, result, header, blob, attempt, f"inprocess:{os.getpid()}", wall, time.time()):
                    break
            results[job.key] = result
            if on_result:
                on_result(result)
        return results
