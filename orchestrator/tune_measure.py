"""Measuring a kernel's schedules: one-kernel bundles, timed in a pinned child process.

A candidate is measured in isolation, as AutoTVM measures: its kernel call alone is linked into
a bundle of its own (the call's tensors become the bundle's inputs and outputs, its weights
the packed ones its schedule needs), with the same entry, arena and thread pool as a model's.
The bundle of the rules' schedule (A) and a candidate's (B) run in a child process pinned to
the measuring cores:

- first on the same random inputs: a candidate whose outputs differ from A's beyond float
  reassociation is *wrong* and never chosen (integers must match exactly);
- then timed A/B/A, interleaved, several rounds: each time is the median of the kernel's own
  wall time over many calls (`kiln_run_profiled`, timed inside the module), each round's
  ratio B / mean(A before, A after), and the candidate's ratio the median of its rounds.

A candidate that crashes the child, or takes past its deadline, is failed likewise; the
child is replaced and measures the rest.
"""
from __future__ import annotations

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

ROUND_MS = 4.0  # each A, B timing of a round lasts about this long
ROUNDS = 5  # interleaved A/B/A rounds a candidate is timed over
CONFIRM_ROUNDS = 11  # rounds for the best few, measured again before a record is written
LOAD_DEADLINE_S = 30.0  # a candidate's load, check and timing past this much: hung
PROFILE_DEADLINE_S = 600.0  # a whole model's profiled runs


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
