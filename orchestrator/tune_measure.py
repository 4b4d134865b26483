"""Measuring schedules: model variants timed in context, one-kernel bundles to isolate faults.

Kernels are timed where they run: in the model. A *variant* is the model's bundle with some
of its kernels swapped for candidates (one candidate per kernel, many kernels at once), and
each kernel's time is its own wall time inside the module (`kiln_run_profiled`). Measured
alone, with its weights left in cache by the run before, a kernel misleads: turning off the
prefetch of weights that stream from memory in the model looked 7% faster alone and was 37%
slower in ResNet-50.

Both the rules' model (A) and a variant (B) are linked twice: as the model is (timed), and
with every tuned kernel's output made a model output (checked, so each candidate's own output
is compared, not only the model's). In a child process pinned to the measuring cores:

- the checked bundles run on the same random inputs: a kernel whose output differs from A's
  beyond float reassociation (integers: at all) is *wrong*; the first such in run order is
  blamed (the ones after it read its wrong output);
- the timed bundles run A/B/A, interleaved, for several rounds; each kernel's ratio is the
  median over rounds of its time in B over the mean of its times in the two A runs.

A variant that crashes the child or passes its deadline is taken apart: each of its
candidates is checked alone, in a one-kernel bundle of its own (its call's tensors the
bundle's inputs and outputs), which names the one at fault.
"""
from __future__ import annotations

import dataclasses
import faulthandler
import multiprocessing
import os
import shutil
import tempfile
from dataclasses import dataclass, field

import numpy as np

from ..artifacts.element_types import numpy_dtype
from ..ir.errors import KilnError
from ..ir.lower.group import LoweredModel

from .bundle import assemble, write_bundle

ROUND_MS = 4.0  # each A, B timing of a round lasts about this long (a one-kernel bundle)
MODEL_ROUND_MS = 20.0  # ... and at least this long for a model variant
ROUNDS = 5  # interleaved A/B/A rounds a candidate is timed over
CONFIRM_ROUNDS = 11  # rounds for the best few, measured again before a record is written
LOAD_DEADLINE_S = 30.0  # a candidate's load, check and timing past this much: hung
PROFILE_DEADLINE_S = 600.0  # a whole model's profiled runs, or a variant's check and timing


def variant(lowered, swaps: dict, graph, exposed: list = ()) -> LoweredModel:
    """The lowered model with calls swapped (id of a top-level call -> its candidate, lowered
    in `graph`, which holds the candidates' packed weights) and the tensors `exposed` made
    outputs too."""
    steps = [swaps.get(id(s), s) for s in lowered.steps]
    constants = dict(lowered.constants)
    for call in swaps.values():
        constants.update({t: graph.constants[t] for t in call.inputs if t in graph.constants})
    outputs = list(lowered.outputs) + [t for t in exposed if t not in lowered.outputs]
    return dataclasses.replace(lowered, steps=steps, outputs=outputs, constants=constants,
                               types={**graph.types, **lowered.types})


def write_model(model: LoweredModel, objects: dict, target, folder: str) -> str:
    """objects: symbol -> object bytes, for every call of the model."""
    files = assemble(model, {c.kernel.symbol: objects[c.kernel.symbol] for c in model.calls}, target,
                     {"model": "tune", "target": target.to_dict(), "opt_level": 3, "cpu_features": []})
    return write_bundle(files, folder)


@dataclass
class VariantResult:
    """A variant's measurement: the exposed tensors whose values differ from A's (in run
    order), or per round each call's time in A (mean of before and after) and in B, in ms.
    None of either: the variant crashed or hung (`why`)."""
    differing: list = field(default_factory=list)
    a_ms: list = field(default_factory=list)  # rounds x calls
    b_ms: list = field(default_factory=list)
    why: str = ""

    @property
    def ok(self) -> bool:
        return not self.why and not self.differing


def _variant_in_child(conn, a_timed: str, a_checked: str, b_timed: str, b_checked: str, threads: int, cpus: list,
                      rounds: int) -> None:
    from ..artifacts.module import Module
    faulthandler.disable()  # (a candidate that crashes is an expected outcome, not a traceback to print)
    os.sched_setaffinity(0, cpus)
    a = Module(a_checked, threads)
    inputs = random_inputs(a, seed=1)
    reference = {k: np.array(v) for k, v in a.run(inputs).items()}
    del a
    got = Module(b_checked, threads).run(inputs)
    differing = [name for name in reference if differs({name: reference[name]}, {name: got[name]})]
    if differing:
        conn.send(VariantResult(differing=differing))
        return
    a, b = Module(a_timed, threads), Module(b_timed, threads)
    one = sum(row["ms"] for row in a.profile(inputs, 3))
    repeat = int(min(50, max(1, MODEL_ROUND_MS / max(one, 1e-3))))
    a_ms, b_ms = [], []
    for _ in range(rounds):
        first = [row["ms"] for row in a.profile(inputs, repeat)]
        mid = [row["ms"] for row in b.profile(inputs, repeat)]
        last = [row["ms"] for row in a.profile(inputs, repeat)]
        a_ms.append([(x + y) / 2 for x, y in zip(first, last)])
        b_ms.append(mid)
    conn.send(VariantResult(a_ms=a_ms, b_ms=b_ms))


def measure_variant(a_timed: str, a_checked: str, b_timed: str, b_checked: str, threads: int, cpus: list,
                    deadline_s: float, rounds: int = ROUNDS) -> VariantResult:
    """Check the variant against the rules' model, then time both A/B/A: see the module's docstring."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_variant_in_child,
                       args=(child, a_timed, a_checked, b_timed, b_checked, threads, cpus, rounds), daemon=True)
    proc.start()
    child.close()
    try:
        result = _received(parent) if parent.poll(deadline_s) else VariantResult(why="hung")
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
        parent.close()
    return result if result is not None else VariantResult(why=f"crashed (exit {proc.exitcode})")


def kernel_model(call, types: dict, constants: dict) -> LoweredModel:
    """The kernel call alone as a model: its tensors read from outside are inputs, except
    constants (weights, packed or not); its outputs are the model's."""
    inputs = [t for t in dict.fromkeys(call.inputs) if t not in constants]
    used = {t: constants[t] for t in call.inputs if t in constants}
    return LoweredModel([call], inputs, list(call.outputs), types, used)


def write_kernel_bundle(call, types: dict, constants: dict, obj: bytes, target, folder: str) -> str:
    files = assemble(kernel_model(call, types, constants), {call.kernel.symbol: obj}, target,
                     {"model": call.name, "target": target.to_dict(), "opt_level": 3, "cpu_features": []})
    return write_bundle(files, folder)


@dataclass
class Trial:
    """One candidate's measurement: ok with its ratio to the rules' schedule, or failed."""
    ok: bool
    ratio: float = float("nan")
    ratios: list = field(default_factory=list)
    default_ms: float = 0.0
    why: str = ""  # a failure: "differs ...", "crashed", "hung", "load failed: ..."


def random_inputs(module, seed: int) -> dict:
    """Normal floats, random bytes for 8-bit integers; wider integers zero (they may be indices)."""
    rng = np.random.default_rng(seed)
    out = {}
    for spec in module.inputs:
        name, dt = spec["name"], np.dtype(numpy_dtype(spec["dtype"]))
        shape = [int(d) for d in spec["shape"]]
        if dt.kind == "f":
            out[name] = rng.standard_normal(shape).astype(dt)
        elif dt.itemsize == 1 and dt.kind in "iu":
            out[name] = rng.integers(np.iinfo(dt).min, np.iinfo(dt).max + 1, shape).astype(dt)
        else:
            out[name] = np.zeros(shape, dt)
    return out


def differs(reference: dict, got: dict) -> str:
    """'' if every output matches the reference (floats within reassociation's error)."""
    for name, want in reference.items():
        have = got[name]
        if want.dtype.kind != "f":
            bad = int(np.count_nonzero(want != have))
            if bad:
                return f"{name}: {bad} of {want.size} integers differ"
            continue
        finite = np.isfinite(want)
        if not np.array_equal(finite, np.isfinite(have)) or not np.array_equal(want[~finite], have[~finite]):
            return f"{name}: non-finite values differ"
        scale = float(np.max(np.abs(want[finite]))) if finite.any() else 0.0
        err = float(np.max(np.abs(want[finite].astype(np.float64) - have[finite]))) if finite.any() else 0.0
        if err > 1e-3 * scale + 1e-5:
            return f"{name}: off by {err:.3g} (values up to {scale:.3g})"
    return ""


def _kernel_ms(module, inputs, repeat: int) -> float:
    return module.profile(inputs, repeat)[0]["ms"]


def _measure_in_child(conn, default_dir: str, candidates: list, threads: int, cpus: list, rounds: int) -> None:
    """The measuring child: pinned, A loaded once, each candidate checked then timed A/B/A."""
    from ..artifacts.module import Module
    faulthandler.disable()  # (a candidate that crashes is an expected outcome, not a traceback to print)
    os.sched_setaffinity(0, cpus)
    a = Module(default_dir, threads)
    inputs = random_inputs(a, seed=1)
    reference = {k: np.array(v) for k, v in a.run(inputs).items()}
    one = _kernel_ms(a, inputs, 20)
    repeat = int(min(200, max(3, ROUND_MS / max(one, 1e-4))))
    conn.send("ready")
    for index, folder in candidates:
        try:
            b = Module(folder, threads)
        except Exception as e:  # (a bundle that does not load: its own failure, not the child's)
            conn.send((index, Trial(False, why=f"load failed: {e}")))
            continue
        wrong = differs(reference, b.run(inputs))
        if wrong:
            conn.send((index, Trial(False, why=f"differs from the rules' schedule: {wrong}")))
            continue
        ratios, a_ms = [], []
        for _ in range(rounds):
            first = _kernel_ms(a, inputs, repeat)
            mid = _kernel_ms(b, inputs, repeat)
            last = _kernel_ms(a, inputs, repeat)
            ratios.append(mid / ((first + last) / 2))
            a_ms += [first, last]
        conn.send((index, Trial(True, float(np.median(ratios)), ratios, float(np.median(a_ms)))))
        del b
    conn.send(None)


def _profile_in_child(conn, folder: str, threads: int, cpus: list) -> None:
    from ..artifacts.module import Module
    os.sched_setaffinity(0, cpus)
    module = Module(folder, threads)
    conn.send([row["ms"] for row in module.profile(random_inputs(module, seed=1), repeat=20)])


def profile_calls(folder: str, threads: int, cpus: list) -> list[float]:
    """Each kernel call's median time (ms) in a model's bundle, run in a child pinned to `cpus`."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_profile_in_child, args=(child, folder, threads, cpus), daemon=True)
    proc.start()
    child.close()
    try:
        times = _received(parent) if parent.poll(PROFILE_DEADLINE_S) else None
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
        parent.close()
    if times is None:
        raise KilnError(f"tune: the model built under the rules did not run (its process exited {proc.exitcode})")
    return times


def measure(default_dir: str, candidate_dirs: list[str], threads: int, cpus: list,
            rounds: int = ROUNDS) -> list[Trial]:
    """Each candidate bundle against the rules' one, in order: see the module's docstring."""
    trials: list[Trial | None] = [None] * len(candidate_dirs)
    ctx = multiprocessing.get_context("fork")
    while any(t is None for t in trials):
        todo = [(i, d) for i, d in enumerate(candidate_dirs) if trials[i] is None]
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_measure_in_child, args=(child, default_dir, todo, threads, cpus, rounds),
                           daemon=True)
        proc.start()
        child.close()
        pending = [i for i, _ in todo]
        try:
            if not parent.poll(LOAD_DEADLINE_S) or _received(parent) != "ready":
                for i in pending:
                    trials[i] = Trial(False, why="the rules' kernel could not be measured "
                                                 f"(its process {'hung' if proc.is_alive() else 'died'})")
                pending = []
            while pending:
                if not parent.poll(LOAD_DEADLINE_S):
                    trials[pending[0]] = Trial(False, why="hung: no answer within its deadline")
                    break
                try:
                    message = parent.recv()
                except EOFError:  # the child died on this candidate
                    trials[pending[0]] = Trial(False, why=f"crashed the measuring process (exit {proc.exitcode})")
                    break
                if message is None:
                    break
                index, trial = message
                trials[index] = trial
                pending.remove(index)
        finally:
            if proc.is_alive():
                proc.kill()
            proc.join()
            parent.close()
    return trials


def _received(conn):
    try:
        return conn.recv()
    except EOFError:
        return None


class Workspace:
    """A temporary folder for one tune's kernel bundles, removed at the end."""

    def __init__(self):
        self.root = tempfile.mkdtemp(prefix="kiln-tune-")
        self._n = 0

    def folder(self) -> str:
        self._n += 1
        return os.path.join(self.root, f"b{self._n}")

    def remove(self, folder: str) -> None:
        shutil.rmtree(folder, ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
