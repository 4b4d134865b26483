"""ONNX backend node conformance: onnx ships generators for its own node test cases
(`onnx.backend.test.case.node`); this runs those whose ops Kiln claims.

Each case ends in one of three outcomes:
  pass     - built, ran, and matched the case's expected outputs
  rejected - Kiln refused it before codegen with a KilnError naming what is unsupported
             (e.g. a float16 input, a Resize mode Kiln does not implement)
  fail     - anything else: a wrong result, a crash, an error that is not a clear rejection
"""
from __future__ import annotations

import functools
import warnings

import numpy as np

from ir.errors import KilnError
from ir.op_types import SUPPORTED_OPS

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


def run_case(case, executor) -> tuple[str, str]:
    """(outcome, detail) for one case."""
    from orchestrator.build import BuildError, build
    try:
        result = build(case.model, cache=None, executor=executor, progress=False)
        module = result.load()
    except BuildError as e:  # a kernel Kiln lowered but could not compile is a bug, not a rejection
        return "fail", str(e)
    except KilnError as e:
        return "rejected", str(e).splitlines()[0]
    except Exception as e:  # noqa: BLE001 - a crash is a failure, reported as such
        return "fail", f"build crashed: {type(e).__name__}: {e}"
    names = [s["name"] for s in module.inputs]
    for inputs, expected in case.data_sets:
        inputs, expected = [_array(v) for v in inputs], [_array(v) for v in expected]
        try:
            outs = module.run(dict(zip(names, inputs)))
        except KilnError as e:
            return "fail", f"run: {e}"
        for spec, want in zip(module.outputs, expected):
            got = outs[spec["name"]]
            want = np.asarray(want)
            if got.shape != want.shape:
                return "fail", f"output {spec['name']}: shape {got.shape}, expected {want.shape}"
            if want.dtype.kind == "f":
                ok = np.allclose(got, want.astype(np.float32), rtol=max(RTOL, case.rtol), atol=max(ATOL, case.atol),
                                 equal_nan=True)
            else:
                ok = np.array_equal(got, want.astype(got.dtype))
            if not ok:
                err = np.max(np.abs(got.astype(np.float64) - want.astype(np.float64))) if got.size else 0
                return "fail", f"output {spec['name']}: max abs error {err:.3g}"
    return "pass", ""
