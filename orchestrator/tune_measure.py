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

A model with symbolic dims is run at each of the tune's sizes (symbol values): checked at
each, and a round's ratio is the geometric mean of its ratios at the sizes.

A variant that crashes the child or passes its deadline is taken apart: each of its
candidates is checked alone, in a one-kernel bundle of its own (its call's tensors the
bundle's inputs and outputs), in a child of its own, which names the one at fault.
"""
from __future__ import annotations

import dataclasses
import faulthandler
import math
import multiprocessing
import os
import shutil
import tempfile
from dataclasses import dataclass, field

import numpy as np

from ..ir.errors import KilnError
from ..ir.lower.group import LoweredModel

from .bundle import assemble, write_bundle

MODEL_ROUND_MS = 20.0  # each A, B timing of a round lasts at least this long
ROUNDS = 5  # interleaved A/B/A rounds a candidate is timed over
CONFIRM_ROUNDS = 11  # rounds for the best few, measured again before a record is written
LOAD_DEADLINE_S = 30.0  # a one-kernel check past this much, or a variant past this plus its timing: hung
PROFILE_DEADLINE_S = 600.0  # a whole model's profiled runs


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
    a_ms: list = field(default_factory=list)  # rounds x sizes x calls
    b_ms: list = field(default_factory=list)
    why: str = ""

    @property
    def ok(self) -> bool:
        return not self.why and not self.differing


def _variant_in_child(conn, a_timed: str, a_checked: str, b_timed: str, b_checked: str, threads: int, cpus: list,
                      sizes: list, rounds: int) -> None:
    from ..artifacts.module import Module
    faulthandler.disable()  # (a candidate that crashes is an expected outcome, not a traceback to print)
    os.sched_setaffinity(0, cpus)
    a, b = Module(a_checked, threads), Module(b_checked, threads)
    feeds = [random_inputs(a, 1, dims) for dims in sizes]
    for inputs in feeds:
        reference = {k: np.array(v) for k, v in a.run(inputs).items()}
        got = b.run(inputs)
        differing = [name for name, want in reference.items() if _mismatch(name, want, got[name])]
        if differing:
            conn.send(VariantResult(differing=differing))
            return
    a, b = Module(a_timed, threads), Module(b_timed, threads)
    repeats = [int(min(50, max(1, MODEL_ROUND_MS / max(sum(row["ms"] for row in a.profile(inputs, 3)), 1e-3))))
               for inputs in feeds]
    a_ms, b_ms = [], []
    for _ in range(rounds):
        a_ms.append([]), b_ms.append([])
        for inputs, repeat in zip(feeds, repeats):
            first = [row["ms"] for row in a.profile(inputs, repeat)]
            mid = [row["ms"] for row in b.profile(inputs, repeat)]
            last = [row["ms"] for row in a.profile(inputs, repeat)]
            a_ms[-1].append([(x + y) / 2 for x, y in zip(first, last)])
            b_ms[-1].append(mid)
    conn.send(VariantResult(a_ms=a_ms, b_ms=b_ms))


def ratios_of(result: VariantResult, calls: list[int]) -> list[float]:
    """Per round, the time of `calls` (indices) in B over their time in A: the geometric mean
    over the sizes measured."""
    out = []
    for a_sizes, b_sizes in zip(result.a_ms, result.b_ms):
        logs = [math.log(sum(b[i] for i in calls) / max(sum(a[i] for i in calls), 1e-9))
                for a, b in zip(a_sizes, b_sizes)]
        out.append(math.exp(sum(logs) / len(logs)))
    return out


def variant_deadline(rounds: int, sizes: int, model_ms: float) -> float:
    """Seconds a variant's check and timing may take before it counts as hung: each round runs
    three profiled runs of at least MODEL_ROUND_MS at each size; a wide margin."""
    return LOAD_DEADLINE_S + 30 * rounds * sizes * max(MODEL_ROUND_MS, model_ms) / 1000


def measure_variant(a_timed: str, a_checked: str, b_timed: str, b_checked: str, threads: int, cpus: list,
                    deadline_s: float, rounds: int = ROUNDS, sizes: list = ({},)) -> VariantResult:
    """Check the variant against the rules' model, then time both A/B/A at every size (a dict
    of symbol values; {} for a static model): see the module's docstring."""
    result, why = _in_child(_variant_in_child, (a_timed, a_checked, b_timed, b_checked, threads, cpus, list(sizes),
                                                rounds), deadline_s)
    return result if result is not None else VariantResult(why=why)


def _in_child(target, args: tuple, deadline_s: float):
    """(the one message `target(conn, *args)` sends from a forked child, "") or, where it
    sent none, (None, "hung" or "crashed (exit N)"). The child is gone when this returns."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    child.close()
    try:
        answered = parent.poll(deadline_s)  # (True too when the child died: its end of the pipe closed)
        message = _received(parent) if answered else None
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
        parent.close()
    return message, "" if message is not None else f"crashed (exit {proc.exitcode})" if answered else "hung"


def kernel_model(call, lowered, graph=None) -> LoweredModel:
    """The kernel call alone as a model: its tensors read from outside are inputs, except
    constants (weights, packed or not: the lowered model's, or for a candidate those of the
    graph it was lowered in); its outputs are the model's; the model's symbols are its own."""
    constants = {**lowered.constants, **(graph.constants if graph is not None else {})}
    types = {**(graph.types if graph is not None else {}), **lowered.types}
    inputs = [t for t in dict.fromkeys(call.inputs) if t not in constants]
    used = {t: constants[t] for t in call.inputs if t in constants}
    return LoweredModel([call], inputs, list(call.outputs), types, used, symbols=dict(lowered.symbols),
                        derived=dict(lowered.derived))


def write_kernel_bundle(call, lowered, obj: bytes, target, folder: str, graph=None) -> str:
    files = assemble(kernel_model(call, lowered, graph), {call.kernel.symbol: obj}, target,
                     {"model": call.name, "target": target.to_dict(), "opt_level": 3, "cpu_features": []})
    return write_bundle(files, folder)


def random_inputs(module, seed: int, dims: dict | None = None) -> dict:
    """The module's random inputs at these symbol values (normal floats; integers zero, as
    they may be indices or sizes), with random bytes for 8-bit integers."""
    rng = np.random.default_rng(seed)
    out = module.random_inputs(seed, dims or None)
    for name, value in out.items():
        if value.dtype.itemsize == 1 and value.dtype.kind in "iu":
            info = np.iinfo(value.dtype)
            out[name] = rng.integers(info.min, info.max + 1, value.shape).astype(value.dtype)
    return out


def _mismatch(name: str, want: np.ndarray, have: np.ndarray) -> str:
    """'' if `have` matches `want` (floats within reassociation's error, integers exactly)."""
    if want.dtype.kind != "f":
        bad = int(np.count_nonzero(want != have))
        return f"{name}: {bad} of {want.size} integers differ" if bad else ""
    finite = np.isfinite(want)
    if not np.array_equal(finite, np.isfinite(have)) or not np.array_equal(want[~finite], have[~finite]):
        return f"{name}: non-finite values differ"
    if not finite.any():
        return ""
    scale = float(np.max(np.abs(want[finite])))
    err = float(np.max(np.abs(want[finite].astype(np.float64) - have[finite])))
    return f"{name}: off by {err:.3g} (values up to {scale:.3g})" if err > 1e-3 * scale + 1e-5 else ""


def _check_in_child(conn, default_dir: str, candidate_dir: str, threads: int, cpus: list, sizes: list) -> None:
    """The checking child: both one-kernel bundles run on the same inputs at every size."""
    from ..artifacts.module import Module
    faulthandler.disable()  # (a candidate that crashes is an expected outcome, not a traceback to print)
    os.sched_setaffinity(0, cpus)
    a, b = Module(default_dir, threads), Module(candidate_dir, threads)
    for dims in sizes:
        inputs = random_inputs(a, 1, dims)
        want, got = a.run(inputs), b.run(inputs)
        wrong = next((w for name in want if (w := _mismatch(name, np.array(want[name]), got[name]))), "")
        if wrong:
            conn.send(f"differs from the rules' schedule: {wrong}")
            return
    conn.send("")


def _profile_in_child(conn, folder: str, threads: int, cpus: list, sizes: list) -> None:
    from ..artifacts.module import Module
    os.sched_setaffinity(0, cpus)
    module = Module(folder, threads)
    times = [[row["ms"] for row in module.profile(random_inputs(module, 1, dims), repeat=20)] for dims in sizes]
    conn.send([sum(column) for column in zip(*times)])


def profile_calls(folder: str, threads: int, cpus: list, sizes: list = ({},)) -> list[float]:
    """Each kernel call's median time (ms) in a model's bundle, summed over the sizes, run in a
    child pinned to `cpus`."""
    times, why = _in_child(_profile_in_child, (folder, threads, cpus, list(sizes)), PROFILE_DEADLINE_S)
    if times is None:
        raise KilnError(f"tune: the model built under the rules did not run (its process {why})")
    return times


def check_alone(default_dir: str, candidate_dir: str, threads: int, cpus: list, sizes: list = ({},)) -> str:
    """A candidate's one-kernel bundle against the rules' one, in a child of its own: '' if it
    computes what the rules do, else what went wrong (it differs, crashed or hung)."""
    why, failed = _in_child(_check_in_child, (default_dir, candidate_dir, threads, cpus, list(sizes)),
                            LOAD_DEADLINE_S)
    return why if why is not None else f"the measuring process {failed}"


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
