"""Executors: where codegen jobs run. All share one retry policy and one result type.

- LocalExecutor: a zygote process (codegen_worker.zygote) forks a fresh child per job;
  up to `workers` children at a time. The default.
- InProcessExecutor: compiles in the caller's process. A debug mode only: LLVM options set
  by one job leak into every later job in the process (the isolation test shows it).

Every job ends as a JobResult. A failed attempt (LLVM error, crash, timeout, an object that
is not one) is retried once in a fresh process, then once with the safe fallback schedule
(no vectorize, no unroll); only then is it a failure.
"""
from __future__ import annotations

import itertools
import os
import select
import subprocess
import sys
import time
from collections import deque

from codegen_worker.protocol import FrameReader, OutBuffer, encode

from .plan import CompileJob, JobResult

# attempt number -> use the fallback schedule?
ATTEMPTS = (False, False, True)


def default_workers() -> int:
    return max(1, len(os.sched_getaffinity(0)))


def looks_like_object(blob: bytes, symbol: str) -> bool:
    """A cheap check that a worker's output is an object file defining the kernel."""
    return len(blob) > 64 and (blob[:4] == b"\x7fELF") and symbol.encode() in blob


class ZygoteClient:
    """One zygote subprocess and the pipes to it. Requests are queued and written only as
    fast as the zygote reads them, while its results are read: neither side ever blocks on
    a full pipe (a large request and a large result in flight at once would deadlock)."""

    def __init__(self):
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen([sys.executable, "-m", "codegen_worker.zygote"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, close_fds=True)
        self.pid = self.proc.pid
        self._out = OutBuffer(self.proc.stdin.fileno())
        self._in = FrameReader()
        self._frames: deque = deque()

    def send(self, header: dict, blob: bytes) -> None:
        """Queue a request; it is written while waiting in receive()."""
        self._out.push(encode(header, blob))
        self._out.flush()

    def receive(self):
        """The next result frame, or None once the zygote has died. Raises OSError (a broken
        pipe) if the zygote is gone while requests are still unsent."""
        out_fd, in_fd = self._out.fd, self.proc.stdout.fileno()
        while not self._frames:
            readable, writable, _ = select.select([in_fd], [out_fd] if self._out else [], [])
            if writable:
                self._out.flush()
            if readable:
                data = os.read(in_fd, 1 << 20)
                if not data:
                    return None
                self._frames.extend(self._in.feed(data))
        return self._frames.popleft()

    def close(self) -> None:
        # Each job runs in its own process group, so a job still running (a hung one, or
        # the jobs of a build being torn down) would outlive its zygote: reap them too.
        import psutil  # here, not at the top: a build served from the store never needs it
        try:
            jobs = psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            jobs = []
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except Exception:  # noqa: BLE001 - a zygote that will not go quietly is killed
            self.proc.kill()
            self.proc.wait()
        for job in jobs:
            try:
                job.kill()
            except psutil.Error:
                pass


class Executor:
    name = "executor"
    workers = 1

    def run(self, jobs: list[CompileJob], on_result=None) -> dict[str, JobResult]:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def settle(job: CompileJob, result: JobResult, header: dict, blob: bytes, attempt: int, worker: str,
           t_start: float, t_end: float) -> bool:
    """Record one attempt on `result`; True if the job is done (success or out of attempts).
    Times are wall-clock (time.time()), for the build trace."""
    ok = bool(header.get("ok"))
    kind = "" if ok else header.get("kind", "crash")
    if ok and not looks_like_object(blob, job.symbol):
        ok, kind = False, "bad_output"
        header = {**header, "message": f"worker returned {len(blob)} bytes that are not an object defining "
                                       f"{job.symbol}"}
    result.attempts.append({"attempt": attempt + 1, "ok": ok, "kind": kind, "worker": worker,
                            "fallback": ATTEMPTS[attempt], "ms": round(header.get("ms", 0.0), 2),
                            "peak_rss_mb": header.get("peak_rss_mb"),
                            "message": header.get("message", ""), "t_start": t_start, "t_end": t_end})
    if ok:
        result.ok, result.object, result.worker = True, blob, worker
        result.compile_ms, result.fallback = header.get("ms", 0.0), ATTEMPTS[attempt]
        return True
    result.kind, result.message, result.log = kind, header.get("message", ""), header.get("log", "")
    return attempt + 1 >= len(ATTEMPTS)


class LocalExecutor(Executor):
    name = "local"

    def __init__(self, workers: int | None = None, kernel_timeout: float = 300.0):
        self.workers = workers or default_workers()
        self.kernel_timeout = kernel_timeout
        # Started on the first job: a build whose kernels are all cached never pays for it.
        self._zygote: ZygoteClient | None = None
        self._ids = itertools.count()

    @property
    def zygote(self) -> ZygoteClient:
        if self._zygote is None:
            self._zygote = ZygoteClient()
        return self._zygote

    def run(self, jobs, on_result=None):
        results = {j.key: JobResult(j.key, False) for j in jobs}
        pending = deque((j, 0) for j in jobs)
        inflight: dict[int, tuple[CompileJob, int, float]] = {}
        while pending or inflight:
            msg = None
            try:
                while pending and len(inflight) < self.workers:
                    job, attempt = pending.popleft()
                    jid = next(self._ids)
                    inflight[jid] = (job, attempt, time.time())
                    self.zygote.send(job.request(jid, ATTEMPTS[attempt], self.kernel_timeout, attempt + 1),
                                     job.kernel_bytes)
                msg = self.zygote.receive()
            except OSError:  # a broken pipe: the zygote is gone (handled below)
                pass
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

        from codegen_worker.compile import compile_kernel
        results = {}
        for job in jobs:
            result = JobResult(job.key, False)
            for attempt, fallback in enumerate(ATTEMPTS):
                t0, wall = time.perf_counter(), time.time()
                try:
                    res = compile_kernel(job.kernel_bytes, job.symbol, job.target.to_dict(),
                                         job.target.llvm_options, job.opt_level, fallback)
                    header, blob = {"ok": True, "ms": (time.perf_counter() - t0) * 1e3}, res["object"]
                except Exception as e:  # noqa: BLE001
                    header, blob = {"ok": False, "kind": "llvm_error", "message": str(e),
                                    "log": traceback.format_exc()}, b""
                if settle(job, result, header, blob, attempt, f"inprocess:{os.getpid()}", wall, time.time()):
                    break
            results[job.key] = result
            if on_result:
                on_result(result)
        return results


def make_executor(kind: str = "local", workers: int | None = None, kernel_timeout: float = 300.0,
                  ray_address: str | None = None) -> Executor:
    if kind == "local":
        return LocalExecutor(workers, kernel_timeout)
    if kind == "inprocess":
        return InProcessExecutor()
    if kind == "ray":
        from .executor_ray import RayExecutor
        return RayExecutor(workers, kernel_timeout, ray_address)
    from ir.graph import KilnError
    raise KilnError(f"unknown executor '{kind}' (local, ray, inprocess)")
