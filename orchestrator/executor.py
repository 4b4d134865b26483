"""What every executor is: the interface, the one retry policy, and how an attempt's answer
becomes part of a JobResult. Executors: executor_local (a zygote, the default; and the
in-process debug mode), executor_ray (actors on a Ray cluster); `executors.make_executor`
picks one by name.

Every job ends as a JobResult. A failed attempt (LLVM error, crash, timeout, an object that
is not one) is retried once in a fresh process, then once with the safe fallback schedule
(no vectorize, no unroll); only then is it a failure.
"""
from __future__ import annotations

import os

from .plan import CompileJob, JobResult
from .toolchain_identity import local_identity

# attempt number -> use the fallback schedule?
ATTEMPTS = (False, False, True)


def default_workers() -> int:
    return max(1, len(os.sched_getaffinity(0)))


def looks_like_object(blob: bytes, symbol: str) -> bool:
    """A cheap check that a worker's output is an object file defining the kernel."""
    return len(blob) > 64 and (blob[:4] == b"\x7fELF") and symbol.encode() in blob


class Executor:
    name = "executor"
    workers = 1

    def run(self, jobs: list[CompileJob], on_result=None) -> dict[str, JobResult]:
        raise NotImplementedError

    def run_stream(self, feed, on_result=None) -> dict[str, JobResult]:
        """Compile the jobs of a JobFeed (orchestrator/job_feed.py) as they arrive, until it is
        finished or cancelled; on_result(r) as each job is done, from this thread. Here each
        arrival is run as a batch of its own; an executor that can take jobs while others
        are in flight (the local one) does better."""
        results = {}
        while not feed.cancelled:
            jobs, finished = feed.take()
            if jobs:
                results.update(self.run(jobs, on_result))
            elif finished:
                break
            else:
                feed.wait()
        return results

    def start(self) -> None:
        """Begin booting workers now (a build calls it before planning: they boot meanwhile)."""

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def settle(job: CompileJob, result: JobResult, header: dict, blob: bytes, attempt: int, worker: str,
           t_start: float, t_end: float, toolchain: str | None = None) -> bool:
    """Record one attempt on `result`; True if the job is done (success or out of attempts).
    Times are wall-clock (time.time()), for the build trace. toolchain: the digest of the
    toolchain that made the object (default: this process's, for local workers)."""
    ok = bool(header.get("ok"))
    kind = "" if ok else header.get("kind", "crash")
    if ok and not looks_like_object(blob, job.symbol):
        ok, kind = False, "bad_output"
        header = {**header, "message": f"worker returned {len(blob)} bytes that are not an object defining "
                                       f"{job.symbol}"}
    result.attempts.append({"attempt": attempt + 1, "ok": ok, "kind": kind, "worker": worker,
                            "fallback": ATTEMPTS[attempt], "ms": round(header.get("ms", 0.0), 2),
                            "peak_rss_mb": header.get("peak_rss_mb"), "log": header.get("log", ""),
                            "message": header.get("message", ""), "t_start": t_start, "t_end": t_end})
    if ok:
        result.ok, result.object, result.worker = True, blob, worker
        result.compile_ms, result.fallback = header.get("ms", 0.0), ATTEMPTS[attempt]
        result.toolchain = toolchain or local_identity()["digest"]
        return True
    result.kind, result.message, result.log = kind, header.get("message", ""), header.get("log", "")
    return attempt + 1 >= len(ATTEMPTS)
