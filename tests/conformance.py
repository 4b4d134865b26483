"""ONNX backend node conformance: onnx ships generators for its own node test cases
(`onnx.backend.test.case.node`); this runs those whose ops Kiln claims.

Each case ends in one of four outcomes:
  pass     - built, ran, and matched the case's expected outputs
  frozen   - passed once its integer inputs (axes, shapes, pads fed at run time) were made
             constants with the case's values: Kiln compiles static shapes, so a shape
             parameter must be known at compile time, as it is in an exported model
  rejected - Kiln refused it before codegen with a KilnError naming what is unsupported
             (e.g. a float16 input, a Resize mode Kiln does not implement)
  fail     - anything else: a wrong result, a crash, an error that is not a clear rejection
"""
from __future__ import annotations

import collections
import functools
import json
import os
import sys
import warnings

import numpy as np

from modelkiln.ir.errors import KilnError
from modelkiln.ir.ops import SUPPORTED_OPS

# Expected outputs are compared with the case's own tolerances, loosened to Kiln's
# float32 contract (exp/erf are polynomial approximations, reductions reassociate).
RTOL, ATOL = 1e-3, 1e-4


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


def _freeze_integer_inputs(model, values: dict):
    """A copy of `model` whose integer inputs, and the inputs of compile-time-only ops
    (Range, ConstantOfShape), are initializers holding `values`."""
    import onnx
    from onnx import numpy_helper
    frozen = onnx.ModelProto()
    frozen.CopyFrom(model)
    compile_time = {i for n in frozen.graph.node if n.op_type in ("Range", "ConstantOfShape") for i in n.input}
    keep = []
    for vi in frozen.graph.input:
        if (vi.type.tensor_type.elem_type in (6, 7, 9) or vi.name in compile_time) and vi.name in values:
            frozen.graph.initializer.append(numpy_helper.from_array(values[vi.name], vi.name))
        else:
            keep.append(vi)
    del frozen.graph.input[:]
    frozen.graph.input.extend(keep)
    return frozen


def _build(model, executor):
    from modelkiln.ir.errors import InternalError
    from modelkiln.orchestrator.api import BuildError, build
    try:
        return build(model, cache=None, executor=executor, progress=False).load(), None
    except (BuildError, InternalError) as e:  # Kiln's own failures are bugs, not rejections
        return None, ("fail", str(e))
    except KilnError as e:
        return None, ("rejected", str(e).splitlines()[0])
    except Exception as e:  # noqa: BLE001 - a crash is a failure, reported as such
        return None, ("fail", f"build crashed: {type(e).__name__}: {e}")


def _check(module, inputs: dict, expected: list, case) -> str:
    try:
        outs = module.run({s["name"]: inputs[s["name"]] for s in module.inputs})
    except KilnError as e:
        return f"run: {e}"
    for spec, want in zip(module.outputs, expected):
        got = outs[spec["name"]]
        if got.shape != want.shape:
            return f"output {spec['name']}: shape {got.shape}, expected {want.shape}"
        if want.dtype.kind == "f":
            ok = np.allclose(got, want.astype(np.float32), rtol=max(RTOL, case.rtol), atol=max(ATOL, case.atol),
                             equal_nan=True)
        else:
            ok = np.array_equal(got, want.astype(got.dtype))
        if not ok:
            err = np.max(np.abs(got.astype(np.float64) - want.astype(np.float64))) if got.size else 0
            return f"output {spec['name']}: max abs error {err:.3g}"
    return ""


def run_case(case, executor) -> tuple[str, str]:
    """(outcome, detail) for one case."""
    names = [vi.name for vi in case.model.graph.input
             if vi.name not in {i.name for i in case.model.graph.initializer}]
    data = [({n: _array(v) for n, v in zip(names, ins)}, [_array(v) for v in outs]) for ins, outs in case.data_sets]
    module, failure = _build(case.model, executor)
    outcome = "pass"
    if failure and failure[0] == "rejected" and "known at compile time" in failure[1]:
        outcome, module = "frozen", None
        for inputs, expected in data:  # one build per data set: each has its own constants
            module, failure = _build(_freeze_integer_inputs(case.model, inputs), executor)
            if failure:
                return failure
            if problem := _check(module, inputs, expected, case):
                return "fail", problem
        return outcome, ""
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
    """Print pass / rejected / fail counts, overall and per op; --write-expected rewrites
    the committed table of outcomes."""
    from modelkiln.orchestrator.executor_local import LocalExecutor
    per_op = collections.defaultdict(collections.Counter)
    totals = collections.Counter()
    outcomes = {}
    with LocalExecutor() as ex:
        for name, case in claimed_cases().items():
            outcome, detail = run_case(case, ex)
            outcomes[name] = outcome
            totals[outcome] += 1
            op = case.model.graph.node[0].op_type if len(case.model.graph.node) == 1 else "(multi-node)"
            per_op[op][outcome] += 1
            if outcome == "fail":
                print(f"FAIL {name}: {detail}")
    print(f"{len(claimed_cases())} cases: {totals['pass']} pass, {totals['frozen']} pass with integer inputs frozen, "
          f"{totals['rejected']} rejected, {totals['fail']} fail")
    for op in sorted(per_op):
        c = per_op[op]
        print(f"  {op:20s} {c['pass']:4d} pass {c['frozen']:4d} frozen {c['rejected']:4d} rejected {c['fail']:4d} fail")
    if "--write-expected" in sys.argv[1:]:
        with open(EXPECTED_FILE, "w") as f:
            json.dump(outcomes, f, indent=1, sort_keys=True)
            f.write("\n")
        print(f"wrote {EXPECTED_FILE}")


if __name__ == "__main__":
    main()
