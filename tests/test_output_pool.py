"""Module.run's outputs come from buffers it reuses once the caller has dropped every array
made from them (artifacts/output_pool.py): never one the caller still holds."""
import numpy as np
from onnx import TensorProto, helper

from modelkiln.artifacts.output_pool import MIN_POOLED_BYTES, OutputPool
from modelkiln.orchestrator.api import build
from tests import model_zoo
from tests.conftest import shared_cache


def _scaled_model():
    """y = 2x + 1 and z = x * x over [n, 256, 1024] (1 MiB a row of n): outputs the pool serves."""
    nodes = [helper.make_node("Mul", ["x", "two"], ["t"]), helper.make_node("Add", ["t", "one"], ["y"]),
             helper.make_node("Mul", ["x", "x"], ["z"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 256, 1024])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("y", "z")],
                              [helper.make_tensor("two", TensorProto.FLOAT, [], [2.0]),
                               helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_arrays_the_caller_holds_are_never_written_again(executor):
    model = _scaled_model()
    module = build(model, dims={"n": (1, 4)}, executor=executor, cache=shared_cache(), progress=False).load()
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal((n, 256, 1024)).astype(np.float32)} for n in (2, 2, 3, 1, 2)]
    kept = [module.run(f) for f in feeds]  # every result held while the next calls run
    for f, got in zip(feeds, kept):
        want = model_zoo.onnxruntime_outputs(model, f)
        for name in ("y", "z"):
            np.testing.assert_array_equal(got[name], want[name])


def test_a_dropped_output_s_memory_serves_the_next_call(executor):
    """A loop that drops each result (or feeds it back and drops the one before, as a decoder
    does with its cache) touches no fresh memory after the first calls."""
    module = build(_scaled_model(), dims={"n": (1, 4)}, executor=executor, cache=shared_cache(), progress=False).load()
    x = np.ones((2, 256, 1024), np.float32)
    first = module.run({"x": x})["y"].ctypes.data
    assert module.run({"x": x})["y"].ctypes.data == first  # (the first result was dropped at once)
    y = module.run({"x": x})["y"]
    held = y.ctypes.data
    z = module.run({"x": np.full((1, 256, 1024), 3, np.float32)})["y"]  # smaller: fits a free buffer
    assert z.ctypes.data != held and np.all(y == 3) and np.all(z == 7)
    del z
    w = module.run({"x": np.full((4, 256, 1024), 5, np.float32)})  # larger than any free buffer: a new one
    assert np.all(w["y"] == 11) and np.all(w["z"] == 25) and np.all(y == 3)


def test_small_outputs_are_plain_arrays():
    pool = OutputPool()
    a = pool.array((4, 4), np.float32)
    assert a.base is None and a.nbytes < MIN_POOLED_BYTES
    big = pool.array((MIN_POOLED_BYTES // 4,), np.float32)
    assert big.base is not None and big.shape == (MIN_POOLED_BYTES // 4,)
