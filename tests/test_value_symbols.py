"""Shape parameters fed at run time (ir/value_symbols.py): a Reshape's shape, a Slice's starts
and ends, an Expand's shape, a Tile's repeats, a Pad's pads, a Range's limits and a
ConstantOfShape's shape given as graph inputs. One build reads them at each call; checked
against onnxruntime at many values."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from modelkiln.artifacts.errors import KilnError
from modelkiln.orchestrator.api import build
from modelkiln.orchestrator.explain import explain
from tests import model_zoo
from tests.conftest import shared_cache
from tests.test_c_api import _run_from_c

RNG = np.random.default_rng(7)


def _model(nodes, inputs, initializers=(), opset=18):
    graph = helper.make_graph(nodes, "fed", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _fed(name, shape, dtype=TensorProto.INT64):
    return helper.make_tensor_value_info(name, dtype, shape)


def _matches_onnxruntime(model, module, feeds_list):
    for feeds in feeds_list:
        got, want = module.run(feeds)["y"], model_zoo.onnxruntime_outputs(model, feeds)["y"]
        assert got.shape == want.shape, (feeds, got.shape, want.shape)
        np.testing.assert_array_equal(got, want, err_msg=str(feeds))


def _reshape_model():
    return _model([helper.make_node("Reshape", ["x", "shape"], ["r"]), helper.make_node("Neg", ["r"], ["y"])],
                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4]), _fed("shape", [3])])


@pytest.fixture(scope="module")
def reshape_build(executor):
    model = _reshape_model()
    return model, build(model, executor=executor, cache=None, progress=False)


def test_a_reshape_to_a_shape_fed_at_run_time(reshape_build):
    """One build; 0 copies the input's dim, -1 is what the others leave, as onnxruntime does."""
    model, result = reshape_build
    x = RNG.standard_normal((2, 3, 4)).astype(np.float32)
    _matches_onnxruntime(model, result.load(), [{"x": x, "shape": np.array(s, np.int64)}
                                                for s in ([4, 2, 3], [0, -1, 2], [24, 1, 1], [-1, 1, 1], [2, 0, 4])])


@pytest.mark.parametrize("shape, message", [
    ([5, 5, 1], r"Reshape_0' \(Reshape\): the sizes in 'shape' multiply to the input's elements: "
                r"r\[0\]\*r\[1\]\*r\[2\] = 25 and 24 = 24 must be equal"),
    ([-3, 2, 4], r"dim 0 of node 'Reshape_0' \(Reshape\)'s output, read from input 'shape' is -3, outside 0\.\.24")])
def test_a_shape_that_does_not_fit_is_named_and_nothing_runs(reshape_build, shape, message):
    _, result = reshape_build
    module = result.load()
    x = np.ones((2, 3, 4), np.float32)
    with pytest.raises(KilnError, match=message):
        module.run({"x": x, "shape": np.array(shape, np.int64)})


def test_the_explain_and_the_c_entry_compute_the_read_sizes(reshape_build, tmp_path):
    """kiln explain names the sizes read at run time; from C, the entry reads them from the
    input buffer (the output's buffer is sized at their bounds)."""
    model, result = reshape_build
    text = explain(model)
    assert "derived r[1] = read at run time: dim 1 of node 'Reshape_0' (Reshape)'s output, read from input " \
           "'shape', 0..24" in text
    bundle = str(tmp_path / "bundle")
    result.export(bundle)
    x = RNG.standard_normal((2, 3, 4)).astype(np.float32)
    got = _run_from_c(bundle, tmp_path, {"x": x, "shape": np.array([0, -1, 2], np.int64)}, [("y", np.float32)])
    np.testing.assert_array_equal(got["y"][:24], -x.reshape(-1))


def test_a_slice_with_starts_and_ends_fed_at_run_time(executor):
    """Negative, out-of-range and huge starts and ends, steps of both signs (constant), as numpy
    clamps them."""
    for steps in ([1, 1], [2, -1], [-3, 3]):
        model = _model([helper.make_node("Slice", ["x", "starts", "ends", "axes", "steps"], ["s"]),
                        helper.make_node("Neg", ["s"], ["y"])],
                       [helper.make_tensor_value_info("x", TensorProto.FLOAT, [20, 10, 5]), _fed("starts", [2]),
                        _fed("ends", [2])],
                       [numpy_helper.from_array(np.array([0, 1], np.int64), "axes"),
                        numpy_helper.from_array(np.array(steps, np.int64), "steps")])
        module = build(model, executor=executor, cache=shared_cache(), progress=False).load()
        x = RNG.standard_normal((20, 10, 5)).astype(np.float32)
        _matches_onnxruntime(model, module, [
            {"x": x, "starts": np.array(s, np.int64), "ends": np.array(e, np.int64)}
            for s, e in [((0, 0), (3, 10)), ((1, -4), (1000, -1)), ((-100, 9), (100, -100)), ((5, 2), (2, 8)),
                         ((19, 9), (-21, -11)), ((2 ** 62, -2 ** 62), (-2 ** 62, 2 ** 62))]])


def test_sizes_the_op_does_not_bound_take_the_users_bounds(executor):
    """Expand, Tile, Pad and ConstantOfShape read their sizes at run time within bounds given
    like a dim's (`--dim shape=1..8`); without them the error says how to give them."""
    x31, x23 = RNG.standard_normal((3, 1)).astype(np.float32), RNG.standard_normal((2, 3)).astype(np.float32)
    cases = [
        ("Expand", [3, 1], "shape", [3], (1, 8), {}, [[2, 1, 6], [1, 3, 1], [4, 3, 8]], x31),
        ("Tile", [2, 3], "repeats", [2], (0, 4), {}, [[1, 1], [3, 2], [0, 4]], x23),
        ("Pad", [2, 3], "pads", [4], (0, 3), {}, [[0, 0, 0, 0], [1, 2, 3, 0], [3, 3, 3, 3]], x23),
        ("ConstantOfShape", None, "shape", [2], (0, 5),
         {"value": numpy_helper.from_array(np.array([2.5], np.float32))}, [[1, 1], [3, 5], [0, 2]], None)]
    for op, x_shape, name, shape, bounds, attrs, values, x in cases:
        inputs = ([helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)] if x_shape else []) + \
            [_fed(name, shape)]
        model = _model([helper.make_node(op, (["x"] if x_shape else []) + [name], ["v"], **attrs),
                        helper.make_node("Identity", ["v"], ["y"])], inputs)
        with pytest.raises(KilnError, match=rf"'{name}'.* to read its values at run time, bound them: "
                                            rf"--dim {name}=LEAST\.\.GREATEST"):
            build(model, executor=executor, cache=None, progress=False)
        module = build(model, dims={name: bounds}, executor=executor, cache=shared_cache(), progress=False).load()
        _matches_onnxruntime(model, module, [{**({"x": x} if x_shape else {}), name: np.array(v, np.int64)}
                                             for v in values])
        with pytest.raises(KilnError, match=rf"element \d of input '{name}' is {bounds[1] + 1}, outside "
                                            rf"{bounds[0]}\.\.{bounds[1]}"):
            module.run({**({"x": x} if x_shape else {}), name: np.full(shape, bounds[1] + 1, np.int64)})


def test_a_range_between_limits_fed_at_run_time(executor):
    """Range(start, limit, 2) with start and limit inputs: its length a size read at run time,
    empty where limit <= start."""
    model = _model([helper.make_node("Range", ["start", "limit", "delta"], ["r"]),
                    helper.make_node("Cast", ["r"], ["y"], to=TensorProto.FLOAT)],
                   [_fed("start", []), _fed("limit", [])], [numpy_helper.from_array(np.array(2, np.int64), "delta")])
    module = build(model, dims={"start": (0, 10), "limit": (0, 30)}, executor=executor, cache=None,
                   progress=False).load()
    _matches_onnxruntime(model, module, [{"start": np.array(s, np.int64), "limit": np.array(limit, np.int64)}
                                         for s, limit in ((0, 10), (3, 4), (5, 30), (9, 2))])


def test_the_cli_takes_bounds_of_values(tmp_path):
    """`kiln build --dim 'repeats[1]=1..4'` and `kiln run` on random inputs (each value read
    as a size at its least)."""
    import subprocess
    import sys

    import onnx
    path = str(tmp_path / "tile.onnx")
    onnx.save(_model([helper.make_node("Tile", ["x", "repeats"], ["y"])],
                     [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]), _fed("repeats", [2])]), path)
    kiln = [sys.executable, "-m", "modelkiln.orchestrator.cli"]
    subprocess.run(kiln + ["build", path, "-o", str(tmp_path / "out"), "--dim", "repeats[0]=2..2", "--dim",
                           "repeats[1]=1..4", "--no-cache", "--quiet"], check=True, capture_output=True)
    ran = subprocess.run(kiln + ["run", str(tmp_path / "out")], check=True, capture_output=True, text=True).stdout
    assert "y: float32[4, 3]" in ran, ran


def test_one_element_bounded_alone_and_a_misspelt_bound(executor):
    model = _model([helper.make_node("Tile", ["x", "repeats"], ["y"])],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]), _fed("repeats", [2])])
    with pytest.raises(KilnError, match=r"input 'repeats': bounds given for some of its values but not repeats\[0\]"):
        build(model, dims={"repeats[1]": (1, 3)}, executor=executor, cache=None, progress=False)
    with pytest.raises(KilnError, match=r"--dim names repeat, which no input's shape has"):
        build(model, dims={"repeat": (1, 3)}, executor=executor, cache=None, progress=False)
    with pytest.raises(KilnError, match=r"--dim repeats\[2\]: no input has a dim of that name, and it names no "
                                        r"element of an integer input .* such inputs: repeats"):
        build(model, dims={"repeats[2]": (1, 3)}, executor=executor, cache=None, progress=False)
    module = build(model, dims={"repeats[0]": (1, 1), "repeats[1]": (1, 3)}, executor=executor, cache=None,
                   progress=False).load()
    x = RNG.standard_normal((2, 3)).astype(np.float32)
    _matches_onnxruntime(model, module, [{"x": x, "repeats": np.array([1, r], np.int64)} for r in (1, 2, 3)])


@pytest.mark.parametrize("start,end,step", [(0, 5, 1), (-3, 1000, 1), (1, -1, 2), (-1, -1000, -1), (4, 0, -2)])
def test_constant_slice_bounds_that_may_pass_a_run_time_dim(start, end, step, executor):
    """x[:, :5], x[:, -3:], x[:, 1:-1:2], x[:, ::-1], x[:, 4:0:-2] of a sequence 1..10 long:
    bounds the dim may be shorter than clamp at run time as numpy does (value symbols)."""
    consts = [numpy_helper.from_array(np.array([v], np.int64), name)
              for name, v in (("s", start), ("e", end), ("a", 1), ("st", step))]
    nodes = [helper.make_node("Slice", ["x", "s", "e", "a", "st"], ["part"]), helper.make_node("Relu", ["part"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, "seq", 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], consts)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    module = build(model, executor=executor, cache=None, progress=False, dims={"seq": (1, 10)}).load()
    _matches_onnxruntime(model, module, [{"x": RNG.standard_normal((2, seq, 3)).astype(np.float32)}
                                         for seq in (1, 2, 3, 6, 10)])
