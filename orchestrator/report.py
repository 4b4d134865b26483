"""The build report: per-kernel rows, totals, the Chrome trace of the compile."""
from __future__ import annotations

import resource

from .plan import JobResult


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, MiB: for a `kiln build` process, its build's
    (the memory a model's weights cost the driver; compile workers are separate processes).
    Linux's VmHWM where there is one: ru_maxrss would carry over the peak of the process that
    forked this one."""
    try:
        with open("/proc/self/status") as f:
            return round(next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024, 1)
    except (OSError, StopIteration, ValueError, IndexError):
        return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def kernel_rows(planned, results: dict[str, JobResult]) -> list[dict]:
    """planned: a PlannedModel or its PlanSummary (orchestrator/pipeline.py)."""
    rows = []
    for call, job in zip(planned.calls, planned.jobs):
        r = results[job.key]
        rows.append({"name": call.name, "symbol": job.symbol, "key": job.key, "ops": call.ops,
                     "nodes": call.nodes, "precision": call.precision, "bf16_nodes": list(call.bf16_nodes),
                     "cache_hit": r.cached, "worker": r.worker,
                     "toolchain": r.toolchain,
                     "attempts": len(r.attempts), "attempt_log": r.attempts,
                     "compile_ms": round(r.compile_ms, 2), "fallback": r.fallback, "ok": r.ok,
                     **({"tuned": tuned_row(call.tuned)} if call.tuned else {})})
    return rows


def tuned_row(record: dict) -> dict:
    """What a kernel's tuning record says, for the report: its schedule and measured ratio
    (tuned time / the rules' time; 1.0 where the rules measured best)."""
    return {"schedule": record["schedule"], "ratio": record["ratio"] if record["schedule"] else 1.0,
            "threads": record["parts"]["threads"], "measured_at": record.get("measured_at", "")}


def tuning_summary(planned, options) -> dict:
    """The model's tuning: off, or how many kernels follow records (and whose records are stale)."""
    if not options.tuning:
        return {"enabled": False}
    calls = planned.calls
    tuned = [c for c in calls if c.tuned]
    from .tuning_records import usable_cores
    return {"enabled": True, "threads": options.tuning_threads or usable_cores(),
            "tunable_kernels": sum(1 for c in calls if c.space), "tuned_kernels": len(tuned),
            "changed_kernels": sum(1 for c in tuned if c.tuned["schedule"]),
            "stale_records": list(planned.stale_records)}


def totals(results: list[JobResult], calls: int) -> dict:
    return {"kernels": len(results), "kernel_calls": calls,
            "compiled": sum(1 for r in results if r.ok and not r.cached),
            "cached": sum(1 for r in results if r.cached),
            "failed": sum(1 for r in results if not r.ok),
            "retried": sum(1 for r in results if len(r.attempts) > 1),
            "fallback": sum(1 for r in results if r.fallback)}


def trace_events(results: dict[str, JobResult], names: dict[str, str], t0: float) -> list[dict]:
    """Chrome trace-event format: one complete event per attempt, one row per worker."""
    events = []
    for key, r in results.items():
        for a in r.attempts:
            if "t_start" in a:
                events.append({"name": names.get(key, key[:12]), "cat": "fallback" if a["fallback"] else "compile",
                               "ph": "X", "ts": round((a["t_start"] - t0) * 1e6), "pid": "kiln",
                               "dur": max(1, round((a["t_end"] - a["t_start"]) * 1e6)), "tid": a["worker"],
                               "args": {"key": key, "attempt": a["attempt"], "ok": a["ok"], "kind": a["kind"]}})
    return sorted(events, key=lambda e: e["ts"])


def stage_events(stages: list, labels: list, plans: dict, t0: float) -> list[dict]:
    """The models' plan and link spans (orchestrator/batch_schedule.py: (model, stage, start,
    end, where)) as trace events, on the rows of the processes that ran them; a plan's
    event lists its jobs' keys in the order they were sent (bench/bench_scale.py replays them)."""
    return [{"name": f"{stage} {labels[i]}", "cat": stage, "ph": "X", "ts": round((start - t0) * 1e6), "pid": "kiln",
             "dur": max(1, round((end - start) * 1e6)), "tid": where,
             "args": {"model": i, **({"jobs": [j.key for j in plans[i].jobs]} if stage == "plan" and i in plans
                                     else {})}}
            for i, stage, start, end, where in stages]


def as_whole_hit(report: dict, elapsed: float) -> dict:
    """The stored report of a bundle, restated for a build that reused it whole."""
    kernels = [{**k, "cache_hit": True, "worker": "cache", "attempts": 0, "attempt_log": [], "compile_ms": 0.0,
                "fallback": False} for k in report["kernels"]]
    sums = {**report["totals"], "compiled": 0, "cached": report["totals"]["kernels"], "failed": 0, "retried": 0,
            "fallback": 0}
    return {**report, "kernels": kernels, "totals": sums, "whole_model_hit": True,
            "timing": {"total_s": round(elapsed, 3), "compile_s": 0.0}, "executor": "cache"}


def failure_message(failed: list, mismatched: list, results: dict, names: dict, n_jobs: int) -> str:
    lines = [f"  kernel {j.name} ({j.symbol}; ops {', '.join(j.ops)}): {results[j.key].kind}: "
             f"{(results[j.key].message.strip().splitlines() or [''])[-1]}" for j in failed]
    lines += [f"  kernel {names[k]}: recompiling gave different bytes than the cached object "
              "(non-deterministic codegen, or a stale entry)" for k in mismatched]
    head = (f"{len(failed)} of {n_jobs} kernels failed to compile after all attempts (a retry in a fresh "
            f"process, then the safe fallback schedule)" if failed else "cache verification failed")
    return head + ":\n" + "\n".join(lines)
