"""Kernels write a model's outputs straight into the caller's arrays (orchestrator.bundle.
output_homes): no copy at the end, no arena space. Every output lands within its own bytes,
in arrays only element-aligned (tests/fenced.py), on one thread and two; an output that is
an input, a constant or a second name of a tensor is still right; buffers that overlap are
refused before anything runs."""
import ctypes

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from modelkiln.ir.errors import KilnError
from modelkiln.orchestrator.api import build
from tests import model_zoo
from tests.conftest import ATOL, RTOL, shared_cache
from tests.fenced import FencedOutputs


def _graph_model(nodes, inputs: dict, outputs: list, inits=(), opset: int = 17):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s)
                                           for n, s in inputs.items()],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs], list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _ragged_convs():
    """A 3x3 conv of 24 channels over 13 x 11 (tiles ragged both ways), then a depthwise conv
    and an average pool as the outputs' last kernels."""
    g = model_zoo.GraphMaker(3)
    c = g.op("Relu", [g.conv("x", 5, 24, 3)])
    dw = g.conv(c, 24, 24, 3, group=24)
    pool = g.op("AveragePool", [c], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    return g.model({"x": [1, 5, 13, 11]}, [dw, pool, c])


def _normalizations():
    """Softmax, LayerNormalization and a reduction as the last kernels, over rows of 37."""
    g = model_zoo.GraphMaker(4)
    h = g.op("MatMul", ["x", g.weight((19, 37))])
    ln = g.op("LayerNormalization", [h, g.const(np.ones(37, np.float32)), g.const(np.zeros(37, np.float32))],
              axis=-1)
    sm = g.op("Softmax", [h], axis=-1)
    mean = g.op("ReduceMean", [h, g.const(np.array([-1], np.int64))], keepdims=0)
    return g.model({"x": [3, 29, 19]}, [ln, sm, mean], opset=18)


MODELS = {
    "cnn": model_zoo.cnn,
    "ragged_convs": _ragged_convs,
    "normalizations": _normalizations,
    "transformer_encoder": lambda: model_zoo.transformer_encoder(seq=24, d=64, heads=4, ffn=96),
}


def _assert_close(got: dict, want: dict):
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=RTOL, atol=ATOL * 10, err_msg=name)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_outputs_land_within_the_caller_s_arrays(name, executor):
    model = MODELS[name]()
    inputs = model_zoo.random_inputs(model)
    want = model_zoo.onnxruntime_outputs(model, inputs)
    result = build(model, executor=executor, cache=None, progress=False)
    for threads in (1, 2):
        module = result.load(threads=threads)
        fenced = FencedOutputs(want)
        module.run(inputs, out=fenced.arrays)
        assert not fenced.trespassed(), f"{fenced.trespassed()}: bytes written outside the output"
        _assert_close(fenced.arrays, want)


@pytest.mark.usefixtures("no_winograd")  # (its blocks' workspaces would pass the output's MiB)
def test_an_output_takes_no_arena_space(executor):
    """A conv alone: its 1 MiB output is computed where the caller wants it, so the arena
    holds only the conv's workspaces (the implicit GEMM's: small)."""
    g = model_zoo.GraphMaker(1)
    model = g.model({"x": [1, 16, 64, 64]}, [g.conv("x", 16, 64, 3)])
    result = build(model, executor=executor, cache=None, progress=False)
    module = result.load()
    assert module.manifest.arena_bytes < 64 * 64 * 64 * 4
    inputs = model_zoo.random_inputs(model)
    _assert_close(module.run(inputs), model_zoo.onnxruntime_outputs(model, inputs))


def _outputs_sharing_tensors():
    """Outputs that cannot all be computed in place: the input itself, a constant, one tensor
    under two names (Identity, Reshape), and an output a later kernel still reads."""
    nodes = [helper.make_node("Identity", ["x"], ["same"]),
             helper.make_node("Identity", ["table"], ["constant"]),
             helper.make_node("Relu", ["x"], ["relu"]),
             helper.make_node("Identity", ["relu"], ["relu_again"]),
             helper.make_node("Reshape", ["relu", "flat"], ["relu_flat"]),
             helper.make_node("Mul", ["relu", "relu"], ["square"])]
    inits = [numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3), "table"),
             numpy_helper.from_array(np.array([-1], np.int64), "flat")]
    return _graph_model(nodes, {"x": [4, 33]}, ["same", "constant", "relu", "relu_again", "relu_flat", "square"],
                        inits)


def test_outputs_that_are_inputs_constants_or_one_tensor_twice(executor):
    model = _outputs_sharing_tensors()
    inputs = model_zoo.random_inputs(model)
    want = model_zoo.onnxruntime_outputs(model, inputs)
    module = build(model, executor=executor, cache=shared_cache(), progress=False).load()
    _assert_close(module.run(inputs), want)
    fenced = FencedOutputs(want)
    module.run(inputs, out=fenced.arrays)
    assert not fenced.trespassed()
    _assert_close(fenced.arrays, want)


def test_outputs_over_run_time_sizes_stay_within_the_call_s_sizes(executor):
    """Built for up to 64 rows, run at fewer: each output is written at the call's sizes
    in arrays of exactly those sizes."""
    g = model_zoo.GraphMaker(2)
    h = g.op("Relu", [g.linear("x", 24, 40)])
    sm = g.op("Softmax", [g.op("MatMul", [h, g.weight((40, 17))])], axis=-1)
    model = g.model({"x": [1, "rows", 24]}, [h, sm])
    module = build(model, dims={"rows": (1, 64)}, executor=executor, cache=shared_cache(), progress=False).load()
    rng = np.random.default_rng(0)
    for rows in (1, 7, 64):
        inputs = {"x": rng.standard_normal((1, rows, 24)).astype(np.float32)}
        want = model_zoo.onnxruntime_outputs(model, inputs)
        fenced = FencedOutputs(want)
        module.run(inputs, out=fenced.arrays)
        assert not fenced.trespassed(), rows
        _assert_close(fenced.arrays, want)


def test_overlapping_buffers_are_refused_before_anything_runs(executor):
    """An out array sharing memory with an input (or another output) would be overwritten
    while still read: Module.run names both; the C entry returns 5 and writes nothing."""
    model = _outputs_sharing_tensors()
    module = build(model, executor=executor, cache=shared_cache(), progress=False).load()
    x = np.random.default_rng(0).standard_normal((4, 33)).astype(np.float32)
    out = {o["name"]: np.zeros([d for d in o["shape"]], np.float32) for o in module.outputs}
    with pytest.raises(KilnError, match=r"input 'x' and out\['relu'\] share memory"):
        module.run({"x": x}, out={**out, "relu": x})
    with pytest.raises(KilnError, match=r"out\['relu'\] and out\['square'\] share memory|"
                                        r"out\['square'\] and out\['relu'\] share memory"):
        module.run({"x": x}, out={**out, "square": out["relu"]})

    names = [o["name"] for o in module.outputs]
    arrays = [x[1:] if n == "relu" else out[n] for n in names]  # (relu's from x's second row on)
    before = x.copy()
    rc = module._lib.kiln_run_threads(ctypes.c_void_p(module._weights_ptr), ctypes.c_void_p(module._arena_ptr),
                                      (ctypes.c_void_p * 1)(x.ctypes.data),
                                      (ctypes.c_void_p * len(arrays))(*[a.ctypes.data for a in arrays]), 1)
    assert rc == 5
    np.testing.assert_array_equal(x, before)
    assert not any(out[n].any() for n in names if n != "relu")


def test_a_kernel_over_an_empty_tensor_stores_nothing(executor):
    """A Slice to zero columns: its loop nest has no points (an extent of 0 is not one
    iteration), so nothing is written where the empty tensor lives."""
    from tests.conftest import kernel_statements
    from modelkiln.ir.loop import Store
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("Slice", ["r", "start", "end", "axis"], ["empty"])]
    inits = [numpy_helper.from_array(np.array([v], np.int64), n) for n, v in (("start", 5), ("end", 5), ("axis", 1))]
    model = _graph_model(nodes, {"x": [3, 8]}, ["empty", "r"], inits)
    result = build(model, executor=executor, cache=None, progress=False)
    sliced = next(c for c in result.lowered.calls if "Slice" in c.ops)
    assert not [s for s in kernel_statements(sliced.kernel.body) if isinstance(s, Store)]
    got = result.load().run(model_zoo.random_inputs(model))
    assert got["empty"].shape == (3, 0)
