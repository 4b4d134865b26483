"""GEMMs whose row count is known only at run time (a batch times a sequence, an output row
over a run-time width): their whole tiles, then the rows left over. Every count of left-over
rows, for wide and narrow panels, float and 8-bit, plain and outlined (SiLU) epilogues, and
the conv's rows within an output row, against numpy (exact for integers) and onnxruntime, on
each x86 target (run where the host can, else checked by instructions: tests/isa.py)."""
import re

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from modelkiln.codegen_worker.llvm_emit import kernel_to_llvm_ir
from modelkiln.orchestrator.api import build
from tests import model_zoo
from tests.isa import AVX512, X86_TARGETS, run_or_inspect

K = 40


def _matmuls() -> tuple:
    """x [rows, K] float and q [rows, K] uint8 against constant weights: y = Relu(x W + b)
    (72 columns: whole panels and a partial one), s = SiLU(x V) (its epilogue calls exp),
    narrow = x N (6 columns: one-vector panels, twice the rows), i = MatMulInteger(q, Wq)."""
    rng = np.random.default_rng(3)
    w = {"W": rng.standard_normal((K, 72)).astype(np.float32), "b": rng.standard_normal(72).astype(np.float32),
         "V": rng.standard_normal((K, 72)).astype(np.float32), "N": rng.standard_normal((K, 6)).astype(np.float32),
         "Wq": rng.integers(-128, 128, (K, 24)).astype(np.int8)}
    nodes = [helper.make_node("MatMul", ["x", "W"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["xwb"]),
             helper.make_node("Relu", ["xwb"], ["y"]),
             helper.make_node("MatMul", ["x", "V"], ["xv"]), helper.make_node("Sigmoid", ["xv"], ["gate"]),
             helper.make_node("Mul", ["xv", "gate"], ["s"]),
             helper.make_node("MatMul", ["x", "N"], ["narrow"]),
             helper.make_node("MatMulInteger", ["q", "Wq"], ["i"])]
    graph = helper.make_graph(
        nodes, "rows", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", K]),
                        helper.make_tensor_value_info("q", TensorProto.UINT8, ["rows", K])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT if o != "i" else TensorProto.INT32, None)
         for o in ("y", "s", "narrow", "i")],
        [numpy_helper.from_array(v, k) for k, v in w.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), w


def _numpy_outputs(w: dict, x: np.ndarray, q: np.ndarray) -> dict:
    x64 = x.astype(np.float64)
    xv = x64 @ w["V"]
    return {"y": np.maximum(x64 @ w["W"] + w["b"], 0), "s": xv / (1 + np.exp(-xv)), "narrow": x64 @ w["N"],
            "i": q.astype(np.int64) @ w["Wq"].astype(np.int64)}


@pytest.mark.parametrize("target", X86_TARGETS)
def test_every_count_of_run_time_rows(target, executor):
    """Row counts 0 to 60: every count of rows left after the whole tiles (up to 27 for the
    narrow GEMM's 28-row tiles on AVX-512), each of the left-over tiles."""
    model, w = _matmuls()
    result = build(model, target=target, dims={"rows": (0, 60)}, executor=executor, cache=None, progress=False)

    def run():
        module = result.load(threads=2)
        for rows in range(61):
            rng = np.random.default_rng(rows)
            x = rng.standard_normal((rows, K)).astype(np.float32)
            q = rng.integers(0, 256, (rows, K)).astype(np.uint8)
            got, want = module.run({"x": x, "q": q}), _numpy_outputs(w, x, q)
            for name in ("y", "s", "narrow"):
                np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-4, err_msg=f"{name}, {rows} rows")
            np.testing.assert_array_equal(got["i"], want["i"], err_msg=f"{rows} rows")
    run_or_inspect(result, run)


def test_counts_too_few_to_fill_a_tile_share_the_least_tile_that_does(executor):
    """On AVX-512 the last rows of a GEMM had a tile for each count up to half a tile. Counts
    from 3 up that cannot fill 8 accumulators (the FMAs' latency) run in the least tile that
    does: for 32-column panels (14-row tiles) 3 rows run in the 4-row tile; for 6 columns
    (one-vector panels, 28-row tiles) 3-7 rows in the 8-row tile. Counted as k loops, one per
    tile, for whole panels and the partial one, in each of the GEMM's two ways of dividing
    among threads (split_by_run_time_rows)."""
    model, _ = _matmuls()
    result = build(model, target=AVX512, dims={"rows": (0, 60)}, executor=executor, cache=None, progress=False)
    t = result.target

    def k_loops(output: str) -> int:
        call = next(c for c in result.lowered.calls if output in c.outputs)
        return len(re.findall(r"^K\d+\.body:", kernel_to_llvm_ir(call.kernel, call.kernel.symbol, t.triple, t.cpu,
                                                                  t.features), re.M))
    whole_tiles, wide_left, narrow_left = 1, len([1, 2, 4, 5, 6, 7]), len([1, 2, *range(8, 15)])
    assert k_loops("y") == 2 * 2 * (whole_tiles + wide_left)  # (7 tiles for the last rows: 32 k loops)
    assert k_loops("narrow") == 2 * (whole_tiles + narrow_left)  # (one partial panel; 14 tiles: 30)


def _conv_over_run_time_widths() -> tuple:
    rng = np.random.default_rng(5)
    w = rng.standard_normal((16, 8, 3, 3)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Sigmoid", ["c"], ["g"]), helper.make_node("Mul", ["c", "g"], ["y"])]
    graph = helper.make_graph(nodes, "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 5, "w"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("target", X86_TARGETS)
def test_a_conv_over_every_run_time_width(target, executor):
    """A 3x3 conv's output rows are its GEMM's rows (stored down the columns of its NCHW
    output), a row's last pixels in the left-over tiles: every width from 1 to 31."""
    model = _conv_over_run_time_widths()
    result = build(model, target=target, dims={"w": (1, 31)}, executor=executor, cache=None, progress=False)

    def run():
        module = result.load(threads=2)
        for width in range(1, 32):
            x = np.random.default_rng(width).standard_normal((1, 8, 5, width)).astype(np.float32)
            np.testing.assert_allclose(module.run({"x": x})["y"], model_zoo.onnxruntime_outputs(model, {"x": x})["y"],
                                       rtol=1e-4, atol=1e-4, err_msg=f"width {width}")
    run_or_inspect(result, run)
