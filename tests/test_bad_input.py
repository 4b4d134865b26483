"""Bad input gets one clear error naming the thing at fault: from the API and from the CLI
(no traceback), before any codegen starts."""
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from modelkiln.ir.errors import KilnError
from modelkiln.orchestrator.api import build
from tests import model_zoo
from tests.conftest import shared_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def kiln(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "modelkiln.orchestrator.cli", *args], capture_output=True, text=True,
                          cwd=cwd or ROOT, env={**os.environ, "PYTHONPATH": ROOT})


def _single(op, inputs, attrs=None, shape=(1, 4), opset=17):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    node = helper.make_node(op, inputs, ["y"], name="the_node", **(attrs or {}))
    return helper.make_model(helper.make_graph([node], "g", [x], [y]),
                             opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def test_truncated_file(tmp_path):
    path = tmp_path / "cut.onnx"
    path.write_bytes(model_zoo.cnn().SerializeToString()[:1000])
    with pytest.raises(KilnError, match="not a valid ONNX model"):
        build(str(path), cache=None)
    r = kiln("build", str(path), "-o", str(tmp_path / "out"))
    assert r.returncode == 2 and "kiln: error:" in r.stderr and "cut.onnx" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_missing_file(tmp_path):
    r = kiln("build", str(tmp_path / "nope.onnx"), "-o", str(tmp_path / "out"))
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr


def test_unsupported_op_names_node_op_and_opset():
    model = _single("Bernoulli", ["x"], {}, shape=(3, 3))  # (random draws: Kiln computes none)
    with pytest.raises(KilnError) as e:
        build(model, cache=None)
    assert "the_node" in str(e.value) and "Bernoulli" in str(e.value) and "opset 17" in str(e.value)


def test_unsupported_attribute_names_it():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    pads = helper.make_tensor("p", TensorProto.INT64, [8], [0, 0, 1, 1, 0, 0, 1, 1])
    node = helper.make_node("Pad", ["x", "p"], ["y"], name="border", mode="mirror")  # (no mode of ONNX's)
    model = helper.make_model(helper.make_graph([node], "g", [x], [y], [pads]),
                              opset_imports=[helper.make_opsetid("", 19)], ir_version=8)
    with pytest.raises(KilnError, match=r"'border'.*mode='mirror'"):
        build(model, cache=None)


def test_wrong_shape_override(tmp_path):
    path = tmp_path / "cnn.onnx"
    onnx.save(model_zoo.cnn(), path)
    # a name that is not an input
    r = kiln("build", str(path), "-o", str(tmp_path / "o"), "--shape", "nope=1x3x32x32")
    assert r.returncode == 2 and "nope" in r.stderr and "inputs: x" in r.stderr and "Traceback" not in r.stderr
    # the wrong rank
    r = kiln("build", str(path), "-o", str(tmp_path / "o"), "--shape", "x=1x3x32")
    assert r.returncode == 2 and "rank" in r.stderr
    # the right rank, but channels that do not fit the first conv's weights: the error names that node
    r = kiln("build", str(path), "-o", str(tmp_path / "o"), "--shape", "x=1x5x32x32")
    assert r.returncode == 2 and "Conv" in r.stderr and "does not match weight" in r.stderr
    # not a shape at all
    r = kiln("build", str(path), "-o", str(tmp_path / "o"), "--shape", "x=1x?x3")
    assert r.returncode == 2 and "NAME=DIMS" in r.stderr
    # a name makes a dim symbolic, which needs its bounds
    r = kiln("build", str(path), "-o", str(tmp_path / "o"), "--shape", "x=1x3xhx32")
    assert r.returncode == 2 and "symbolic dims without bounds: 'h' (in x)" in r.stderr and "--dim" in r.stderr


def test_symbolic_shape_needs_override():
    model = _single("Relu", ["x"], shape=("batch", 4))
    with pytest.raises(KilnError, match=r"symbolic.*--shape x="):
        build(model, cache=None)
    module = build(model, shapes={"x": [3, 4]}, cache=shared_cache()).load()
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(module.run({"x": x})["y"], np.maximum(x, 0))


def test_graph_with_a_cycle():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    nodes = [helper.make_node("Add", ["x", "b"], ["a"], name="n1"), helper.make_node("Relu", ["a"], ["b"], name="n2"),
             helper.make_node("Relu", ["a"], ["y"], name="n3")]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y]), opset_imports=[helper.make_opsetid("", 17)],
                              ir_version=8)
    with pytest.raises(KilnError, match=r"cycle: .*n1.*n2"):
        build(model, cache=None)


def test_dangling_input_names_node():
    model = _single("Add", ["x", "ghost"])
    with pytest.raises(KilnError, match=r"the_node.*'ghost'"):
        build(model, cache=None)


def test_unknown_target():
    with pytest.raises(KilnError, match="unknown target"):
        build(model_zoo.cnn(), target="gpu", cache=None)
    with pytest.raises(KilnError, match="unknown flag"):
        build(model_zoo.cnn(), target="llvm -mfoo=1", cache=None)


@pytest.fixture(scope="module")
def cnn_module():
    return build(model_zoo.cnn(), cache=shared_cache()).load()


def test_run_wrong_shape(cnn_module):
    with pytest.raises(KilnError, match=r"input 'x': expected shape \(1, 3, 32, 32\), got \(1, 3, 16, 16\)"):
        cnn_module.run({"x": np.zeros((1, 3, 16, 16), np.float32)})


def test_run_wrong_dtype(cnn_module):
    with pytest.raises(KilnError, match="input 'x': expected dtype float32, got int64"):
        cnn_module.run({"x": np.zeros((1, 3, 32, 32), np.int64)})


def test_run_wrong_names(cnn_module):
    with pytest.raises(KilnError, match=r"missing \['x'\], unexpected \['y'\]"):
        cnn_module.run({"y": np.zeros((1, 3, 32, 32), np.float32)})


def test_run_cli_wrong_inputs_no_traceback(tmp_path):
    path = tmp_path / "cnn.onnx"
    onnx.save(model_zoo.cnn(), path)
    assert kiln("build", str(path), "-o", str(tmp_path / "b"), "--no-cache", "--quiet").returncode == 0
    np.savez(tmp_path / "in.npz", x=np.zeros((2, 3, 32, 32), np.float32))
    r = kiln("run", str(tmp_path / "b"), "--inputs", str(tmp_path / "in.npz"))
    assert r.returncode == 2 and "expected shape" in r.stderr and "Traceback" not in r.stderr


def test_corrupt_bundle_weights(tmp_path):
    result = build(model_zoo.cnn(), cache=None)
    path = result.export(str(tmp_path / "b"))
    with open(os.path.join(path, "weights.bin"), "r+b") as f:
        f.write(b"\xff" * 16)
    from modelkiln.artifacts import load
    with pytest.raises(KilnError, match="checksum"):
        load(path)


def _twice(case: str) -> onnx.ModelProto:
    """A graph that defines one name twice, in each way a graph can."""
    from onnx import numpy_helper
    b = numpy_helper.from_array(np.ones((1, 4), np.float32), "b")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    nodes, inputs, inits = [helper.make_node("Add", ["b", "x"], ["y"])], [x], [b]
    if case == "node_output_is_an_initializer":
        nodes.insert(0, helper.make_node("Relu", ["x"], ["b"], name="relu"))
    elif case == "constant_node_is_an_initializer":
        nodes.insert(0, helper.make_node("Constant", [], ["b"], name="const",
                                         value=numpy_helper.from_array(np.zeros((1, 4), np.float32))))
    elif case == "node_output_is_a_graph_input":
        nodes.insert(0, helper.make_node("Relu", ["b"], ["x"], name="relu"))
    elif case == "two_initializers":
        inits.append(numpy_helper.from_array(np.zeros((1, 4), np.float32), "b"))
    elif case == "in_a_branch":
        branch = helper.make_graph([helper.make_node("Relu", ["x"], ["t"], name="r1"),
                                    helper.make_node("Neg", ["x"], ["t"], name="r2")], "then_branch", [],
                                   [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)])
        other = helper.make_graph([helper.make_node("Neg", ["x"], ["e"])], "else_branch", [],
                                  [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)])
        inputs.append(helper.make_tensor_value_info("c", TensorProto.BOOL, []))
        nodes = [helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=other)]
    return helper.make_model(helper.make_graph(nodes, "g", inputs, [y], inits),
                             opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("case,named,onnxruntime_refuses", [
    ("node_output_is_an_initializer", "'b' is defined twice, as an initializer and as the output of node 'relu'", True),
    ("constant_node_is_an_initializer", "'b' is defined twice, as an initializer and as the output of node 'const'",
     False),
    ("node_output_is_a_graph_input", "'x' is defined twice, as a graph input and as the output of node 'relu'", True),
    ("two_initializers", "'b' is defined twice, as an initializer and as an initializer", False),
    ("in_a_branch", "subgraph 'then_branch': 't' is defined twice", True),
])
def test_a_name_defined_twice_is_refused_by_name(case, named, onnxruntime_refuses):
    """ONNX graphs are single assignment: every name is defined once. onnxruntime refuses
    three of these ("Duplicate definition"), and silently takes one of the two values in the
    other two; Kiln had built several, using one value."""
    import onnxruntime as ort
    model = _twice(case)
    if onnxruntime_refuses:
        with pytest.raises(Exception, match="Duplicate definition"):
            ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    with pytest.raises(KilnError, match=named.replace("(", r"\(").replace(")", r"\)")):
        build(model, executor="inprocess", cache=None, progress=False)
