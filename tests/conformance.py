"""ONNX backend node conformance: onnx ships generators for its own node test cases
(`onnx.backend.test.case.node`); this runs those whose ops Kiln claims.

Each case ends in one of five outcomes:
  pass     - built, ran, and matched the case's expected outputs
  bounded  - passed once built with bounds for the values of integer inputs it feeds at run
             time (a Pad's pads, a Tile's repeats, `--dim pads=0..3`): the module reads them
             each call (ir/value_symbols.py), as a user gives bounds for a dynamic dim
  frozen   - passed once built as Kiln compiles such a model: its shape parameters (axes,
             shapes, pads, scales fed at run time) made constants with the case's values,
             and symbolic input shapes given (the `shapes` build option). Kiln compiles
             static shapes, so these must be known at compile time, as they are in an
             exported model
  rejected - Kiln refused it before codegen with a KilnError naming what is unsupported
             (e.g. a float16 input, a Resize mode Kiln does not implement)
  fail     - anything else: a wrong result, a crash, an error that is not a clear rejection
"""
from __future__ import annotations

import collections
import functools
import json
import os
import re
import sys
import tempfile
import warnings

import numpy as np

from modelkiln.artifacts.element_types import kind
from modelkiln.ir.errors import KilnError
from modelkiln.ir.ops import SUPPORTED_OPS
from tests.cast_definition import INTEGER_TYPES, defined
from tests.fenced import FencedOutputs

# Expected outputs are compared with the case's own tolerances, loosened to Kiln's
# float32 contract (exp/erf are polynomial approximations, reductions reassociate).
RTOL, ATOL = 1e-3, 1e-4
# 16-bit floats: Kiln computes in float32 and rounds once at the store, where the reference
# rounds after every op; a few units in the last place apart (eps: 2**-10 and 2**-7).
HALF_TOL = {"float16": 4 * 2.0 ** -10, "bfloat16": 4 * 2.0 ** -7}


@functools.lru_cache(maxsize=1)
def claimed_cases() -> dict:
    """name -> TestCase for every node case whose graph uses only ops Kiln claims."""
    from onnx.backend.test.case.node import collect_testcases
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = collect_testcases(None)
    claimed = set(SUPPORTED_OPS)
    out = {}
    for case in cases:
        ops = {n.op_type for n in case.model.graph.node}
        domains = {n.domain for n in case.model.graph.node}
        if ops and ops <= claimed and domains <= {"", "ai.onnx"}:
            out[case.name] = case
    return dict(sorted(out.items()))


def _array(value) -> np.ndarray:
    from onnx import TensorProto, numpy_helper
    return numpy_helper.to_array(value) if isinstance(value, TensorProto) else np.asarray(value)


def _freeze_inputs(model, values: dict, names: set):
    """A copy of `model` whose inputs `names` are initializers holding `values`."""
    import onnx
    from onnx import numpy_helper
    frozen = onnx.ModelProto()
    frozen.CopyFrom(model)
    keep = []
    for vi in frozen.graph.input:
        if vi.name in names and vi.name in values:
            frozen.graph.initializer.append(numpy_helper.from_array(values[vi.name], vi.name))
        else:
            keep.append(vi)
    del frozen.graph.input[:]
    frozen.graph.input.extend(keep)
    return frozen


def _parameters(model) -> set:
    """The inputs a case feeds that are parameters where Kiln compiles: integer inputs (axes,
    shapes, pads, indices) and the inputs of compile-time-only ops (Range, ConstantOfShape)."""
    compile_time = {i for n in model.graph.node if n.op_type in ("Range", "ConstantOfShape") for i in n.input}
    return {vi.name for vi in model.graph.input if vi.type.tensor_type.elem_type in (6, 7, 9)} | compile_time


def _needs_static(detail: str) -> bool:
    return any(s in detail for s in ("known at compile time", "unknown shape", "symbolic dims without bounds"))


_NAMED_PARAMETER = re.compile(r"input '([^']+)' \([^)]*\) must be known at compile time")


def _build_static(case, inputs: dict, executor, cache=None):
    """Build the case as a user compiles such a model: shape parameters as constants (the
    integer inputs, then any other input Kiln names as needed at compile time) and the data
    inputs' shapes given. Returns (module, failure) like _build."""
    # (An empty input carries a type only, as CastLike's `like` does: a constant by nature.)
    frozen = _parameters(case.model) | {n for n, v in inputs.items() if v.size == 0}
    for _ in range(8):
        model = _freeze_inputs(case.model, inputs, frozen)
        shapes = {n: list(v.shape) for n, v in inputs.items() if n not in frozen}
        module, failure = _build(model, executor, shapes, cache=cache)
        named = _NAMED_PARAMETER.search(failure[1]) if failure and failure[0] == "rejected" else None
        if named is None or named.group(1) not in inputs or named.group(1) in frozen:
            return module, failure
        frozen.add(named.group(1))
    return module, failure


_NEEDS_BOUNDS = re.compile(r"to read its values at run time, bound them: --dim ([^=\s]+)=")


def _build_bounded(case, data: list, executor, cache=None):
    """Build the case with bounds for the values of the integer inputs Kiln asks bounds for:
    from 0 to the most any data set feeds. Returns (module, failure) like _build."""
    dims = {}
    for _ in range(8):
        module, failure = _build(case.model, executor, dims=dims, cache=cache)
        named = _NEEDS_BOUNDS.search(failure[1]) if failure and failure[0] == "rejected" else None
        if named is None or named.group(1) in dims or named.group(1) not in data[0][0]:
            return module, failure
        dims[named.group(1)] = (0, max(0, max(int(inputs[named.group(1)].max(initial=0)) for inputs, _ in data)))
    return module, failure


def _build(model, executor, shapes=None, dims=None, cache=None):
    from modelkiln.ir.errors import InternalError
    from modelkiln.orchestrator.api import BuildError, build
    try:
        return build(model, cache=cache, executor=executor, progress=False, shapes=shapes, dims=dims).load(), None
    except (BuildError, InternalError) as e:  # Kiln's own failures are bugs, not rejections
        return None, ("fail", str(e))
    except KilnError as e:
        return None, ("rejected", str(e).splitlines()[0])
    except Exception as e:  # noqa: BLE001 - a crash is a failure, reported as such
        return None, ("fail", f"build crashed: {type(e).__name__}: {e}")


def _check(module, inputs: dict, expected: list, case) -> str:
    """'' if the module's outputs match, returned and written into the caller's arrays
    (fenced: a kernel writing outside an output's bytes fails the case)."""
    feeds = {s["name"]: inputs[s["name"]] for s in module.inputs}
    names = [s["name"] for s in module.outputs]
    try:
        outs = module.run(feeds)
        fenced = FencedOutputs({n: np.empty(shape, outs[n].dtype) for n, shape in module.out_shapes(feeds).items()})
        outs_in_place = module.run(feeds, out=fenced.arrays)
    except KilnError as e:
        return f"run: {e}"
    if trespassed := fenced.trespassed():
        return f"outputs {trespassed}: bytes written outside the caller's array"
    given = list(inputs.values())
    return _compare([outs[n] for n in names], names, expected, case, given) or \
        _compare([outs_in_place[n] for n in names], names, expected, case, given)


def _undefined_elements(case, inputs: list):
    """The elements of a Cast case's output that ONNX leaves undefined (a float out of an
    integer type's range: tests/cast_definition.py), or None. The case's expected values
    there are whatever its generator's ml_dtypes or numpy gave, which moves between releases
    (ml_dtypes 0.7 made them 0); Kiln's own answer there is tested in test_undefined_casts."""
    from onnx import TensorProto
    if not inputs or {n.op_type for n in case.model.graph.node} - {"Cast", "CastLike"}:
        return None
    out_type = TensorProto.DataType.Name(case.model.graph.output[0].type.tensor_type.elem_type).lower()
    if out_type not in INTEGER_TYPES or kind(inputs[0].dtype) != "f":
        return None
    return ~defined(inputs[0], out_type)


def _compare(outputs: list, names: list, expected: list, case, inputs: list = ()) -> str:
    """'' if every output matches the case's expected one (shape, dtype, values), else why not.
    Elements ONNX leaves undefined are not compared."""
    for name, got, want in zip(names, outputs, expected):
        if got.shape != want.shape:
            return f"output {name}: shape {got.shape}, expected {want.shape}"
        if got.dtype != want.dtype:
            return f"output {name}: dtype {got.dtype}, expected {want.dtype}"
        if (undefined := _undefined_elements(case, list(inputs))) is not None:
            got, want = got[~undefined], want[~undefined]
        if kind(want.dtype) == "f":
            tol = max(RTOL, case.rtol, HALF_TOL.get(want.dtype.name, 0))
            ok = np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol,
                             atol=max(ATOL, case.atol, HALF_TOL.get(want.dtype.name, 0)), equal_nan=True)
        else:
            ok = np.array_equal(got, want.astype(got.dtype))
        if not ok:
            with np.errstate(invalid="ignore"):
                err = np.max(np.abs(got.astype(np.float64) - want.astype(np.float64))) if got.size else 0
            return f"output {name}: max abs error {err:.3g}"
    return ""


def run_case_onnxruntime(case) -> str:
    """'pass' if onnxruntime runs the case and matches its expected outputs under the same
    comparison as Kiln's, else 'fail'. A model whose IR version is newer than onnxruntime reads
    is given onnxruntime's newest first: only what its kernels do counts."""
    import onnx
    import onnxruntime as ort
    model = onnx.ModelProto()
    model.CopyFrom(case.model)
    model.ir_version = min(model.ir_version, ORT_MAX_IR_VERSION)
    names = [vi.name for vi in model.graph.input if vi.name not in {i.name for i in model.graph.initializer}]
    options = ort.SessionOptions()
    options.log_severity_level = 4
    try:
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        for ins, outs in case.data_sets:
            got = session.run(None, {n: _array(v) for n, v in zip(names, ins)})
            if _compare(got, [o.name for o in model.graph.output], [_array(v) for v in outs], case,
                        [_array(v) for v in ins]):
                return "fail"
    except Exception:  # noqa: BLE001 - a refusal or a crash of the peer: not a pass
        return "fail"
    return "pass"


ORT_MAX_IR_VERSION = 13  # onnxruntime 1.31 reads IR versions up to 13


def run_case(case, executor, cache=None) -> tuple[str, str]:
    """(outcome, detail) for one case. `cache`, a store folder shared by the cases of one run,
    compiles a kernel that several cases share once (what a case asserts is its module's
    outputs, the same bytes from the store as from a compile)."""
    names = [vi.name for vi in case.model.graph.input
             if vi.name not in {i.name for i in case.model.graph.initializer}]
    module, failure = _build(case.model, executor, cache=cache)
    try:
        data = [({n: _array(v) for n, v in zip(names, ins)}, [_array(v) for v in outs]) for ins, outs in case.data_sets]
    except ValueError:  # sequences: Kiln refuses their inputs or outputs by name
        return failure or ("fail", "sequence data, yet the model built")
    outcome = "pass"
    if failure and failure[0] == "rejected" and _NEEDS_BOUNDS.search(failure[1]):
        module, bounded_failure = _build_bounded(case, data, executor, cache)
        if not bounded_failure and not any(_check(module, inputs, expected, case) for inputs, expected in data):
            return "bounded", ""
    if failure and failure[0] == "rejected" and _needs_static(failure[1]):
        for inputs, expected in data:  # one build per data set: each has its own constants
            module, failure = _build_static(case, inputs, executor, cache)
            if failure:
                return failure
            if problem := _check(module, inputs, expected, case):
                return "fail", problem
        return "frozen", ""
    if failure:
        return failure
    for inputs, expected in data:
        if problem := _check(module, inputs, expected, case):
            return "fail", problem
    return outcome, ""

EXPECTED_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conformance_expected.json")


def expected_outcomes() -> dict:
    """The committed outcome of every case: a change of outcome fails the suite until this
    table is updated in the same commit (`python -m tests.conformance --write-expected`)."""
    with open(EXPECTED_FILE) as f:
        return json.load(f)


def main() -> None:
    """Print pass / rejected / fail counts, overall and per op; --onnxruntime also runs every
    case through onnxruntime and prints both counts; --write-expected rewrites the committed
    table of outcomes."""
    from modelkiln.orchestrator.executor_local import LocalExecutor
    per_op = collections.defaultdict(collections.Counter)
    totals = collections.Counter()
    outcomes = {}
    with LocalExecutor() as ex, tempfile.TemporaryDirectory(prefix="kiln-conformance-") as store:
        for name, case in claimed_cases().items():
            outcome, detail = run_case(case, ex, store)
            outcomes[name] = outcome
            totals[outcome] += 1
            op = case.model.graph.node[0].op_type if len(case.model.graph.node) == 1 else "(multi-node)"
            per_op[op][outcome] += 1
            if outcome == "fail":
                print(f"FAIL {name}: {detail}")
    print(f"{len(claimed_cases())} cases: {totals['pass']} pass, {totals['bounded']} pass with bounds for values "
          f"read at run time, {totals['frozen']} pass built with static shapes, "
          f"{totals['rejected']} rejected, {totals['fail']} fail")
    for op in sorted(per_op):
        c = per_op[op]
        print(f"  {op:20s} {c['pass']:4d} pass {c['bounded']:4d} bounded {c['frozen']:4d} frozen {c['rejected']:4d} rejected "
              f"{c['fail']:4d} fail")
    if "--onnxruntime" in sys.argv[1:]:
        ort_pass = sum(run_case_onnxruntime(case) == "pass" for case in claimed_cases().values())
        kiln_pass = totals["pass"] + totals["bounded"] + totals["frozen"]
        print(f"onnxruntime passes {ort_pass} of the {len(claimed_cases())} cases; Kiln {kiln_pass} "
              f"({totals['pass']} as given, {totals['bounded']} with bounds for values read at run time, "
              f"{totals['frozen']} built with static shapes)")
    if "--write-expected" in sys.argv[1:]:
        with open(EXPECTED_FILE, "w") as f:
            json.dump(outcomes, f, indent=1, sort_keys=True)
            f.write("\n")
        print(f"wrote {EXPECTED_FILE}")


if __name__ == "__main__":
    main()
