"""An accuracy budget for a reduced-precision build: `build(..., precision="bf16", max_error=E)`
(`kiln build --precision bf16 --max-error E [--calibration inputs.npz]`).

The error of a build is the largest difference of its float outputs from the float32 build's
on the calibration inputs, relative to each output's largest magnitude (random inputs of the
declared shapes where none are given). Where the whole bf16 build is within E, that is the
build. Otherwise each bf16 kernel's own effect is measured (a build with that kernel alone in
bf16), the kernels are ranked by it, and the fewest of the most harmful are kept in float32
that bring the error within E (a bisection over the ranking, each step measured). Every trial
compiles nothing new: a kernel's code does not depend on the others' precision, so the
float32 and bf16 builds' objects serve them all from the store; a trial costs a plan and a
link.

The choice and its measurements (the budget, the error reached, the kernels kept in float32,
each kernel's own error) are filed in the store under the model, its settings and the
calibration inputs, so an unchanged rebuild goes straight to its bundle; the report and the
bundle's manifest carry them as `accuracy`.
"""
from __future__ import annotations

import hashlib
import json
import math
import sys
from dataclasses import replace

from .options import BudgetError, BuildOptions


def calibration_inputs(calibration) -> list[dict] | None:
    """The calibration samples: a dict of arrays, a list of them, an .npz path or a list of
    paths; None for random inputs."""
    if calibration is None:
        return None
    items = calibration if isinstance(calibration, (list, tuple)) else [calibration]
    samples = []
    for item in items:
        if isinstance(item, dict):
            samples.append(item)
            continue
        import numpy as np
        try:
            with np.load(item) as data:
                samples.append({k: data[k] for k in data.files})
        except (OSError, ValueError) as e:
            raise BudgetError(f"calibration inputs '{item}' cannot be read as an .npz file: {e}") from None
    if not samples:
        raise BudgetError("calibration inputs: an empty list (give at least one set of inputs)")
    return samples


def _digest(samples: list[dict] | None) -> str:
    h = hashlib.sha256(b"kiln-calibration-v1\0")
    for sample in samples or []:
        for name in sorted(sample):
            a = sample[name]
            h.update(f"{name}:{a.dtype.str}:{list(a.shape)}\0".encode())
            h.update(a.tobytes())
    return h.hexdigest() if samples else "random"


def relative_error(got: dict, want: dict, model: str) -> float:
    """The largest |got - want| over the float outputs, relative to each output's largest |want|."""
    import numpy as np
    worst, floats = 0.0, 0
    for name, w in want.items():
        w = np.asarray(w)
        if w.dtype.kind != "f" and "float" not in str(w.dtype):
            continue  # (indices, masks: no relative difference; the float outputs bound them)
        floats += 1
        w64, g64 = w.astype(np.float64), np.asarray(got[name]).astype(np.float64)
        if not np.isfinite(w64).all():
            raise BudgetError(f"model '{model}': output '{name}' of the float32 build is not finite on the "
                              "calibration inputs, so no difference from it can be measured (give other inputs)")
        scale = float(np.abs(w64).max()) if w64.size else 0.0
        diff = np.abs(g64 - w64)
        if not np.isfinite(diff).all():
            return math.inf
        if diff.size:
            worst = max(worst, float(diff.max()) / scale if scale > 0 else (math.inf if diff.max() > 0 else 0.0))
    if not floats:
        raise BudgetError(f"model '{model}' has no float outputs: an accuracy budget measures float outputs")
    return worst


class _Trials:
    """Builds of the model with a set of kernels kept in float32, each measured once. The
    float32 and the whole-bf16 builds write to the store; the trials between only read it
    (their objects are those two builds'; their bundles, a mix of weights packed either way,
    would fill the store)."""

    def __init__(self, build, model, target, o: BuildOptions, samples):
        self.build, self.model, self.target = build, model, target
        self.base = replace(o, max_error=None, calibration=None, progress=False)
        self.trial = replace(self.base, cache_readonly=True)
        reference = self.build(model, target, replace(self.base, precision="fp32"))
        self.name = reference.report["model"]
        module = reference.load()
        self.samples = samples or [module.random_inputs()]
        self.want = [module.run(s) for s in self.samples]
        self.errors: dict[tuple, float] = {}
        whole = self.build(model, target, self.base)
        self.kernels = [row for row in whole.report["kernels"] if row.get("precision") == "bf16"]
        self.errors[()] = self._measure(whole)

    def error(self, kept_keys: frozenset) -> float:
        key = tuple(sorted(kept_keys))
        if key not in self.errors:
            self.errors[key] = self._measure(self.build(self.model, self.target, replace(self.trial, fp32_nodes=key)))
        return self.errors[key]

    def _measure(self, result) -> float:
        module = result.load()
        return max(relative_error(module.run(s), w, self.name) for s, w in zip(self.samples, self.want))


def choose(build, model, target, o: BuildOptions, samples, say) -> dict:
    """Search for the fewest kernels to keep in float32 (see the module's docstring); the record."""
    trials = _Trials(build, model, target, o, samples)
    kernels = trials.kernels
    keys = [frozenset(row["bf16_nodes"]) for row in kernels]

    def kept(indices) -> frozenset:
        return frozenset().union(*(keys[i] for i in indices))
    record = {"precision": o.precision, "max_error": o.max_error, "calibration": _digest(samples),
              "samples": len(trials.samples), "bf16_kernels": len(kernels)}
    whole = trials.error(frozenset())
    if whole <= o.max_error:
        return {**record, "error": whole, "fp32_kernels": [], "fp32_nodes": [], "kernel_errors": {},
                "trial_builds": len(trials.errors)}
    say(f"bf16 everywhere: error {whole:.3g} > {o.max_error:g}; measuring each of {len(kernels)} kernels alone")
    own = []
    for i in range(len(kernels)):
        own.append(trials.error(kept(j for j in range(len(kernels)) if j != i)))
        say(f"kernel {i + 1}/{len(kernels)} ({kernels[i]['name']}): error {own[-1]:.3g} alone")
    ranked = sorted(range(len(kernels)), key=lambda i: -own[i])
    lo, hi = 0, len(ranked)  # keeping ranked[:hi] meets the budget (all of them: the float32 build's error, 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        error = trials.error(kept(ranked[:mid]))
        say(f"the {mid} most harmful kept in float32: error {error:.3g}")
        lo, hi = (lo, mid) if error <= o.max_error else (mid, hi)
    chosen = ranked[:hi]
    return {**record, "error": trials.error(kept(chosen)), "fp32_kernels": [kernels[i]["name"] for i in chosen],
            "fp32_nodes": sorted(kept(chosen)),
            "kernel_errors": [{"kernel": kernels[i]["name"], "nodes": kernels[i]["nodes"],
                               "bf16_nodes": kernels[i]["bf16_nodes"], "error_alone": own[i],
                               "precision": "fp32" if i in chosen else o.precision} for i in range(len(kernels))],
            "trial_builds": len(trials.errors)}


def budget_key(model, target, o: BuildOptions, samples) -> str | None:
    """Where the store files the budget's record for this model, its settings, the budget
    and the calibration inputs (None without a store, or for a model that cannot be read)."""
    from .cache_policy import CachePolicy
    from .target import parse_target
    cache = CachePolicy(o)
    plain = replace(o, max_error=None, calibration=None)
    key = cache.untuned_model_key(model, parse_target(target), plain) if cache.store is not None else None
    return key and hashlib.sha256(f"kiln-budget-v1\0{key}\0{o.max_error!r}\0{_digest(samples)}".encode()).hexdigest()


def find_record(store, key: str | None) -> dict | None:
    """The budget's record filed under `key`, or None (a damaged one is a miss)."""
    found = store.get(key) if store is not None and key else None
    try:
        record = json.loads(found) if found else None
    except ValueError:
        return None
    fields = ("precision", "max_error", "error", "samples", "bf16_kernels", "fp32_kernels", "fp32_nodes",
              "kernel_errors")
    return record if isinstance(record, dict) and all(f in record for f in fields) else None


def build_within_budget(build, model, target, o: BuildOptions):
    """The bf16 build of `model` within o.max_error (see the module's docstring); `build` is
    orchestrator.api's, which calls this."""
    from .cache_policy import open_store
    samples = calibration_inputs(o.calibration)
    say = _sayer(o)
    if o.cache is None:  # (the trials need a store to share the two builds' objects: a scratch one)
        import tempfile
        with tempfile.TemporaryDirectory(prefix="kiln-budget-") as scratch:
            o = replace(o, cache=scratch)
            return _final(build, model, target, o, choose(build, model, target, o, samples, say), say)
    store = open_store(o.cache, readonly=o.cache_readonly)
    key = budget_key(model, target, o, samples)
    record = find_record(store, key)
    if record is None:
        record = choose(build, model, target, o, samples, say)
        if key and store is not None and not store.readonly:
            store.put(key, json.dumps(record, sort_keys=True).encode())
    return _final(build, model, target, o, record, say)


def _final(build, model, target, o: BuildOptions, record: dict, say):
    say(f"{record['bf16_kernels'] - len(record['fp32_kernels'])} of {record['bf16_kernels']} kernels in "
        f"{o.precision}, {len(record['fp32_kernels'])} kept in float32: error {record['error']:.3g} "
        f"<= {o.max_error:g}")
    plain = replace(o, max_error=None, calibration=None)
    return build(model, target, replace(plain, fp32_nodes=tuple(record["fp32_nodes"]), accuracy=record))


def _sayer(o: BuildOptions):
    on = o.progress if o.progress is not None else sys.stderr.isatty()
    return (lambda text: print(f"kiln: accuracy budget: {text}", file=sys.stderr, flush=True)) if on else \
        (lambda text: None)
