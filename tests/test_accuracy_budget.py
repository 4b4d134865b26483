"""An accuracy budget for a bf16 build (`max_error`, orchestrator/accuracy_budget.py): the
error a built module makes is measured here, by the test, against the float32 build of the
same model on the calibration inputs, and the kernels the report says are kept in float32
are the ones the module computes in float32.
"""
import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from modelkiln.ir.errors import KilnError
from modelkiln.orchestrator.api import build, build_many

WIDTHS = (48, 96, 96, 96, 32)


def _mlp():
    """Four float32 layers whose weights differ in scale, so some kernels rounded to bf16 move
    the output more than others."""
    rng = np.random.default_rng(5)
    nodes, inits, x = [], [], "x"
    for i, (a, b) in enumerate(zip(WIDTHS, WIDTHS[1:])):
        w = (rng.standard_normal((a, b)) / np.sqrt(a) * (1 + 2 * i)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"]))
        nodes.append(helper.make_node("Tanh", [f"m{i}"], [f"h{i}"]))
        x = f"h{i}"
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16, WIDTHS[0]])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _calibration():
    return [{"x": np.random.default_rng(s).standard_normal((16, WIDTHS[0])).astype(np.float32)} for s in (1, 2)]


def _error(module, reference, samples) -> float:
    """Largest |output - float32 build's| / largest |float32 build's|, over the samples."""
    worst = 0.0
    for s in samples:
        want, got = reference.run(s), module.run(s)
        for name, w in want.items():
            worst = max(worst, float(np.abs(got[name].astype(np.float64) - w).max() / np.abs(w).max()))
    return worst


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return str(tmp_path_factory.mktemp("budget-store"))


@pytest.fixture(scope="module")
def errors(store):
    """The float32 module and the error of the whole bf16 build."""
    reference = build(_mlp(), cache=store, executor="inprocess", progress=False).load()
    whole = build(_mlp(), cache=store, executor="inprocess", progress=False, precision="bf16").load()
    return reference, _error(whole, reference, _calibration())


def test_the_budget_holds_with_the_fewest_kernels_kept(store, errors):
    reference, whole = errors
    budget = whole / 3
    result = build(_mlp(), cache=store, executor="inprocess", progress=False, precision="bf16", max_error=budget,
                   calibration=_calibration())
    record = result.report["accuracy"]
    assert _error(result.load(), reference, _calibration()) <= budget
    kept = [row for row in result.report["kernels"] if "MatMul" in row["ops"] and row["precision"] == "fp32"]
    assert 0 < len(kept) < len(WIDTHS) - 1 and len(kept) == len(record["fp32_kernels"])
    manifest = json.loads(result.files["manifest.json"])
    assert manifest["accuracy"]["error"] == record["error"] <= budget
    assert sum(c.get("precision") == "bf16" for c in manifest["calls"]) == len(WIDTHS) - 1 - len(kept)
    # Fewest: without the least harmful of those kept (by its own error), the budget breaks.
    kept_errors = [k for k in record["kernel_errors"] if k["precision"] == "fp32"]
    spared = min(kept_errors, key=lambda k: k["error_alone"])
    fewer = [key for k in kept_errors if k is not spared for key in k["bf16_nodes"]]
    one_fewer = build(_mlp(), cache=store, executor="inprocess", progress=False, precision="bf16",
                      fp32_nodes=tuple(fewer)).load()
    assert _error(one_fewer, reference, _calibration()) > budget


def test_a_loose_budget_keeps_everything_in_bf16(store, errors):
    _, whole = errors
    result = build(_mlp(), cache=store, executor="inprocess", progress=False, precision="bf16", max_error=2 * whole,
                   calibration=_calibration())
    assert result.report["accuracy"]["fp32_kernels"] == []
    assert all(row["precision"] == "bf16" for row in result.report["kernels"] if "MatMul" in row["ops"])


def test_a_budget_below_any_bf16_kernel_keeps_them_all_in_float32(store, errors):
    """The output then is the float32 build's, bit for bit."""
    reference, _ = errors
    result = build(_mlp(), cache=store, executor="inprocess", progress=False, precision="bf16", max_error=1e-12,
                   calibration=_calibration())
    assert len(result.report["accuracy"]["fp32_kernels"]) == len(WIDTHS) - 1
    for s in _calibration():
        np.testing.assert_array_equal(result.load().run(s)["h3"], reference.run(s)["h3"])


def test_an_unchanged_rebuild_does_not_search_again(store, errors, tmp_path):
    """The budget's choice is filed in the store: the rebuild is a whole bundle found there,
    and `kiln explain` shows each kernel's precision and its error alone."""
    _, whole = errors
    path = tmp_path / "mlp.onnx"
    onnx.save(_mlp(), path)
    np.savez(tmp_path / "cal.npz", **_calibration()[0])
    args = [str(path), "--precision", "bf16", "--max-error", f"{whole / 3!r}", "--calibration",
            str(tmp_path / "cal.npz"), "--cache", store]
    kiln = [sys.executable, "-m", "modelkiln.orchestrator.cli"]
    env = {**os.environ, "CI": "true"}
    for _ in range(2):
        r = subprocess.run(kiln + ["build", "-o", str(tmp_path / "out"), "--report", str(tmp_path / "r.json")] + args,
                           capture_output=True, text=True, env=env)
        assert r.returncode == 0, r.stderr
    assert "kept in float32: error" in r.stdout
    assert json.loads((tmp_path / "r.json").read_text())["whole_model_hit"] is True
    r = subprocess.run(kiln + ["explain"] + args, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert "accuracy budget" in r.stdout and "precision fp32" in r.stdout and "alone in bf16: error" in r.stdout


@pytest.mark.parametrize("settings,says", [
    ({"max_error": 0.01}, "budget for a reduced precision"),
    ({"precision": "bf16", "max_error": 0.0}, "positive number"),
    ({"precision": "bf16", "max_error": float("nan")}, "positive number"),
    ({"precision": "bf16", "calibration": "cal.npz"}, "give max_error too"),
    ({"precision": "bf16", "max_error": 0.01, "fp32_nodes": ("m0",)}, "one or the other"),
])
def test_settings_that_make_no_budget_are_refused(settings, says):
    with pytest.raises(KilnError, match=says):
        build(_mlp(), cache=None, executor="inprocess", progress=False, **settings)


def test_a_budget_is_refused_in_a_batch_and_without_float_outputs(tmp_path):
    with pytest.raises(KilnError, match="per model"):
        build_many([_mlp()], cache=None, executor="inprocess", progress=False, precision="bf16", max_error=0.01)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("ArgMax", ["m"], ["y"])],
                              "argmax", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.INT64, None)],
                              [numpy_helper.from_array(np.ones((8, 8), np.float32), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    with pytest.raises(KilnError, match="no float outputs"):
        build(model, cache=str(tmp_path), executor="inprocess", progress=False, precision="bf16", max_error=0.01)
