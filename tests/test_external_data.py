"""Models whose weights live in external data files: found beside the model, and part of
what identifies it in the whole-model cache."""
import os

import numpy as np
import onnx
import pytest
from onnx import external_data_helper

from modelkiln.ir.errors import KilnError
from modelkiln.orchestrator.api import build
from tests import model_zoo
from tests.test_bad_input import kiln


def _small_mlp(seed: int) -> onnx.ModelProto:
    g = model_zoo.GraphMaker(seed)
    h = g.op("Relu", [g.linear("x", 16, 32)])
    return g.model({"x": [2, 16]}, [g.linear(h, 32, 4)], name="ext_mlp")


def _save_external(model: onnx.ModelProto, folder, location="weights.data") -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "model.onnx")
    if os.path.exists(os.path.join(folder, location)):
        os.remove(os.path.join(folder, location))  # onnx appends to an existing data file
    onnx.save_model(model, path, save_as_external_data=True, all_tensors_to_one_file=True, location=location,
                    size_threshold=0)
    return path


def _check(result, path, seed=0):
    inputs = {"x": np.random.default_rng(seed).standard_normal((2, 16)).astype(np.float32)}
    want = model_zoo.onnxruntime_outputs(onnx.load(path), inputs)
    got = result.load().run(inputs)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-5)
    return got


def test_external_weights_resolve_against_the_model_folder(tmp_path, executor, monkeypatch):
    path = _save_external(_small_mlp(1), tmp_path / "m")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # not the model's folder: the data file is not here
    _check(build(os.path.relpath(path), executor=executor, cache=None, progress=False), path)
    r = kiln("build", path, "-o", str(tmp_path / "out"), "--no-cache", "--quiet", cwd=str(elsewhere))
    assert r.returncode == 0, r.stderr


def test_changed_external_weights_are_not_served_from_the_cache(tmp_path, executor):
    store = tmp_path / "store"
    path = _save_external(_small_mlp(1), tmp_path / "m")
    onnx_bytes = open(path, "rb").read()
    first = _check(build(path, executor=executor, cache=str(store), progress=False), path)
    _save_external(_small_mlp(2), tmp_path / "m")  # same graph, same .onnx bytes, new weights
    assert open(path, "rb").read() == onnx_bytes
    second = build(path, executor=executor, cache=str(store), progress=False)
    assert not second.report.get("whole_model_hit")
    assert second.report["totals"]["compiled"] == 0  # weights are data: no kernel recompiles
    got = _check(second, path)
    assert not np.allclose(got[next(iter(got))], first[next(iter(first))])
    third = build(path, executor=executor, cache=str(store), progress=False)
    assert third.report.get("whole_model_hit")  # unchanged bytes everywhere: a whole hit again
    _check(third, path)


def test_external_location_outside_the_model_folder_is_refused(tmp_path):
    model = _small_mlp(1)
    (tmp_path / "secret.data").write_bytes(b"\0" * 4096)
    tensor = model.graph.initializer[0]
    external_data_helper.set_external_data(tensor, location="../secret.data", offset=0,
                                           length=tensor.ByteSize())
    tensor.data_location = onnx.TensorProto.EXTERNAL
    tensor.ClearField("raw_data")
    tensor.ClearField("float_data")
    (tmp_path / "m").mkdir()
    path = tmp_path / "m" / "model.onnx"
    path.write_bytes(model.SerializeToString())
    with pytest.raises(KilnError, match=f"tensor '{tensor.name}'.*(outside|not a path inside) the model's folder"):
        build(str(path), cache=str(tmp_path / "store"))
    os.remove(tmp_path / "secret.data")
    with pytest.raises(KilnError, match=f"tensor '{tensor.name}'"):
        build(str(path), cache=None)


def test_external_data_without_a_folder_is_a_clear_error(tmp_path):
    path = _save_external(_small_mlp(1), tmp_path / "m")
    proto = onnx.load(path, load_external_data=False)
    with pytest.raises(KilnError, match="give Kiln the model's path"):
        build(proto.SerializeToString(), cache=None)
