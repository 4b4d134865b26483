"""`kiln build-many --manifest batch.yaml`: models each with its own shapes, dims, target and
output folder, from the CLI and from Python; every mistake in the file named by its line."""
import json
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from modelkiln.artifacts.module import Module
from modelkiln.orchestrator.api import build_many
from modelkiln.orchestrator.batch_manifest import ManifestError, read_manifest
from tests import model_zoo
from tests.test_bad_input import kiln


def _dynamic_mlp() -> onnx.ModelProto:
    """y = relu(x @ w) over a symbolic row count `rows`, its input's width left 0 (unknown)."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((6, 5)).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
                              "dyn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture
def models_dir(tmp_path):
    os.makedirs(tmp_path / "models")
    onnx.save(model_zoo.cnn(), tmp_path / "models" / "cnn.onnx")
    onnx.save(_dynamic_mlp(), tmp_path / "models" / "mlp.onnx")
    return tmp_path


MANIFEST = """\
# two models, each with settings of its own
opt_level: 3
models:
  - model: models/cnn.onnx
    output: vision
    target: x86-64-v3
    precision: bf16
  - model: models/mlp.onnx
    dims: {rows: [1, 16]}
    precision: fp32
"""


def test_a_manifest_builds_each_model_with_its_own_settings(models_dir):
    (models_dir / "batch.yaml").write_text(MANIFEST)
    out = models_dir / "out"
    r = kiln("build-many", "--manifest", str(models_dir / "batch.yaml"), "-o", str(out), "--no-cache",
             "--report", str(models_dir / "r.json"))
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(out)) == ["mlp", "vision"]
    assert "vision" in r.stdout and "built 2 of 2 models" in r.stdout  # the summary table, then the totals
    vision = json.loads((out / "vision" / "manifest.json").read_text())
    assert vision["target"]["name"] == "x86-64-v3"
    module = Module(str(out / "mlp"))  # built for rows 1..16: runs at any of them
    weights = numpy_helper.to_array(_dynamic_mlp().graph.initializer[0])
    for rows in (1, 9, 16):
        x = np.random.default_rng(rows).standard_normal((rows, 6)).astype(np.float32)
        np.testing.assert_allclose(module.run({"x": x})["y"], np.maximum(x @ weights, 0), rtol=1e-5, atol=1e-5)


def test_the_python_api_takes_the_same_entries(models_dir, executor):
    (models_dir / "batch.yaml").write_text(MANIFEST)
    entries = read_manifest(str(models_dir / "batch.yaml"))
    assert [e.output for e in entries] == ["vision", "mlp"] and entries[1].dims == {"rows": (1, 16)}
    batch = build_many(entries, executor=executor, cache=None, progress=False)
    assert [r.report["precision"] for r in batch.results] == ["bf16", "fp32"]
    as_dicts = build_many([{"model": str(models_dir / "models" / "mlp.onnx"), "dims": {"rows": (1, 16)}}],
                          executor=executor, cache=None, progress=False)
    assert batch.results[1].files["model.so"] == as_dicts.results[0].files["model.so"]
    module = batch.results[1].load()
    model = _dynamic_mlp()
    for rows in (1, 7, 16):
        x = np.random.default_rng(rows).standard_normal((rows, 6)).astype(np.float32)
        want = np.maximum(x @ numpy_helper.to_array(model.graph.initializer[0]), 0)
        np.testing.assert_allclose(module.run({"x": x})["y"], want, rtol=1e-5, atol=1e-5)
    assert batch.results[0].target.name == "x86-64-v3"


@pytest.mark.parametrize("text,line,says", [
    ("models:\n  - model: a.onnx\n    shape: {x: [1]}\n", 3, "unknown key 'shape'"),
    ("models:\n  - model: a.onnx\n    dims: {n: [1]}\n", 3, "[least, greatest]"),
    ("models:\n  - output: a\n", 2, "each entry names its model file"),
    ("models:\n  - model: a.onnx\n  - model: b/a.onnx\n", 3, "output 'a' is also model 1's"),
    ("models:\n  - model: a.onnx\n    precision: fp8\n", 3, "precision 'fp8' is not supported"),
    ("models:\n  - model: a.onnx\n    opt_level: 5\n", 3, "opt_level is 0, 1, 2 or 3"),
    ("target: llvm\nmodels: [\n", 3, "not valid YAML"),
    ("targets: llvm\nmodels:\n  - model: a.onnx\n", 1, "unknown key 'targets'"),
    ("target: llvm\n", 1, "lists its models under 'models:'"),
])
def test_a_mistake_is_named_by_its_line(tmp_path, text, line, says):
    path = tmp_path / "batch.yaml"
    path.write_text(text)
    with pytest.raises(ManifestError) as e:
        read_manifest(str(path))
    assert str(e.value).startswith(f"{path}:{line}:") and says in str(e.value), str(e.value)
    r = kiln("build-many", "--manifest", str(path), "-o", str(tmp_path / "out"), "--no-cache")
    assert r.returncode == 2 and f"{path}:{line}:" in r.stderr
