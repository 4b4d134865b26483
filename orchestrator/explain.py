"""`kiln explain`: the passes run, the fused kernels, and each kernel's cache key parts,
with, for a kernel that would miss, the parts that changed since the last build, what its
schedule follows (the rules, or `kiln tune`'s record and the gain it measured) and, in a
reduced-precision build, its precision (and with an accuracy budget a build measured, the
error the kernel alone in bf16 made)."""
from __future__ import annotations

import json
from dataclasses import replace

from ..artifacts.manifest import COUNTED
from ..ir.lower import lower

from .pipeline import optimize, schedule_for
from .build_log import previous_parts
from .cache_key import explain_difference
from .plan import kernel_id, make_job
from .cache_policy import open_store
from .target import parse_target
from .tuning_records import Records


HUGE_ARENA_BYTES = 1 << 30  # an arena planned at the bounds past this gets a warning


def _symbols(g, lowered) -> list[str]:
    """What a build with symbolic dims runs: the bounds, the shapes, the arena they need."""
    from .bundle import plan_memory
    _, arena, _ = plan_memory(lowered)
    given = ", ".join(f"{s} = {lo}..{hi}" for s, (lo, hi) in g.symbols.items() if s not in g.derived)
    lines = ["symbols (one build runs every size within these bounds):", f"  {given or '(none the caller gives)'}"]
    lines += [f"  derived {s} = {_definition(d)}, {lo}..{hi}"
              for s, d in g.derived.items() for lo, hi in [g.symbols[s]]]
    lines += [f"  input  {n}: {g.types[n]}" for n in g.inputs]
    lines += [f"  output {n}: {g.types[n]}" for n in g.outputs]
    lines += [f"  KV cache in place: {c.past} -> {c.present}, appended along axis {c.axis} in one buffer of "
              f"{c.capacity} entries" for c in g.caches]
    lines.append(f"  arena at the bounds: {arena / 2**20:.1f} MiB (a call touches what its sizes need)")
    if arena > HUGE_ARENA_BYTES:
        lines.append(f"  warning: the bounds make the arena {arena / 2**30:.1f} GiB; tighter --dim bounds shrink it")
    return lines + [""]


def _definition(d) -> str:
    """A derived symbol's definition as people read it."""
    if isinstance(d, tuple):
        return f"floor(({d[0]}) / {d[1]})"
    if d.expr[0] == COUNTED:
        return f"counted while the model runs: {d.what} (outputs it sizes are allocated at its greatest)"
    return f"read at run time: {d.what}"


def _tuning(call) -> str:
    """What a kernel's schedule follows: the rules, or a record (and what it measured)."""
    if not call.space:
        return ""
    if not call.tuned:
        return "    schedule: the rules (no tuning record)"
    r = call.tuned
    if not r["schedule"]:
        return f"    schedule: the rules, measured best by kiln tune at {r['parts']['threads']} threads"
    return (f"    schedule: tuned at {r['parts']['threads']} threads, x{r['ratio']:.2f} of the rules' time: "
            f"{json.dumps(r['schedule'])}")


def explain(model, target="llvm", opt_level: int = 3, shapes=None, cache=None, dims=None, tuning: bool = True,
            tuning_threads: int | None = None, precision: str = "fp32", max_error: float | None = None,
            calibration=None) -> str:
    tgt = parse_target(target)
    g, timings = optimize(model, shapes, opt_level, dims=dims)
    store = open_store(cache, readonly=True) if cache is not None else None
    records = Records(store, tgt, tuning_threads) if store is not None and tuning else None
    budget, budget_lines = _budget(model, target, opt_level, shapes, dims, cache, store, precision, max_error,
                                   calibration)
    config = replace(schedule_for(tgt), precision=precision,
                     fp32_nodes=frozenset(budget["fp32_nodes"] if budget else ()))
    lowered = lower(g, config, records.lookup if records is not None else None)
    alone = {key: k["error_alone"] for k in (budget or {}).get("kernel_errors", []) for key in k["bf16_nodes"]}
    before = previous_parts(store.root, g.name) if store else {}
    lines = [f"model {g.name}: {len(g.nodes)} nodes after passes; target {tgt.describe()}",
             f"  {tgt.feature_summary()}", ""]
    if g.symbols:
        lines += _symbols(g, lowered)
    lines += budget_lines
    lines += ["passes:"]
    lines += [f"  {name:28s} {ms:8.2f} ms" for name, ms in timings]
    lines += ["", f"kernels ({len(lowered.calls)} calls):"]
    for call in lowered.calls:
        job = make_job(call, tgt, opt_level)
        hit = store is not None and store.get(job.key) is not None
        state = "cached" if hit else ("miss" if store else "no cache")
        lines.append(f"  {call.name}  [{' -> '.join(call.ops)}]  {call.kernel.symbol}  {state}")
        if precision != "fp32":
            error = next((alone[key] for key in call.node_keys if key in alone), None)
            lines.append(f"    precision {call.precision}" + (f" (alone in {precision}: error {error:.3g})"
                                                              if error is not None else ""))
        if _tuning(call):
            lines.append(_tuning(call))
        if records is not None and call.name in records.stale:
            lines.append("    its tuning record is from another Kiln or LLVM: not applied (`kiln tune` starts from it)")
        lines.append(f"    key {job.key}")
        for part, value in job.parts.items():
            lines.append(f"      {part:18s} {value}")
        old = before.get(kernel_id(call))
        if not hit and old:
            for change in explain_difference(old, job.parts) or ["no key part changed: the entry was evicted "
                                                                 "or never written"]:
                lines.append(f"    changed since the last build: {change}")
    return "\n".join(lines)


def _budget(model, target, opt_level, shapes, dims, cache, store, precision, max_error, calibration):
    """(the accuracy budget's record a build filed in the store, or None; lines saying so)."""
    if max_error is None:
        return None, []
    from .accuracy_budget import budget_key, calibration_inputs, find_record
    from .options import BuildOptions
    o = BuildOptions(target=target, opt_level=opt_level, shapes=shapes, dims=dims, cache=cache, precision=precision,
                     max_error=max_error, calibration=calibration)
    record = find_record(store, budget_key(model, target, o, calibration_inputs(calibration)))
    if record is None:
        return None, [f"accuracy budget {max_error:g}: not measured yet (`kiln build` with the same --precision, "
                      "--max-error and --calibration measures it and files it in the store)", ""]
    kept = len(record["fp32_kernels"])
    return record, [f"accuracy budget {max_error:g}: {record['bf16_kernels'] - kept} of {record['bf16_kernels']} "
                    f"kernels in {precision}, {kept} kept in float32; error {record['error']:.3g} on "
                    f"{record['samples']} calibration input(s)", ""]

