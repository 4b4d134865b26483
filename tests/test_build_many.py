"""Batch builds: kernels shared across models compile once; one report for the batch."""
import json
import os

import onnx
import pytest
from onnx import TensorProto, helper

from modelkiln.ir.errors import KilnError
from modelkiln.orchestrator import bundle
from modelkiln.orchestrator.api import BuildError, build, build_many
from tests import model_zoo
from tests.test_bad_input import kiln
from tests.conftest import assert_matches_oracle


def test_shared_kernels_compile_once(executor):
    models = [model_zoo.mlp(1), model_zoo.mlp(1), model_zoo.cnn()]  # two identical MLPs
    batch = build_many(models, executor=executor, cache=None, progress=False)
    singles = [build(m, executor=executor, cache=None, progress=False) for m in models]
    t = batch.report["totals"]
    assert t["compiled"] == t["kernels"] == len({k["key"] for s in singles for k in s.report["kernels"]})
    assert t["kernel_calls"] == sum(len(s.report["kernels"]) for s in singles)
    for result, single, model in zip(batch.results, singles, models):
        assert result.files["model.so"] == single.files["model.so"]
        assert_matches_oracle(result, model)


def test_resnet_repeats_its_blocks_kernels(executor):
    """ResNet-18 has 23 kernel calls but only 21 distinct kernels: equal layers share one."""
    result = build(model_zoo.resnet18(), executor=executor, cache=None, progress=False)
    t = result.report["totals"]
    assert t["kernels"] < t["kernel_calls"]


def test_build_many_cli(tmp_path):
    paths = []
    for name in ("cnn", "mlp_b1"):
        paths.append(str(tmp_path / f"{name}.onnx"))
        onnx.save(model_zoo.ALL[name](), paths[-1])
    r = kiln("build-many", *paths, "-o", str(tmp_path / "out"), "--no-cache", "--report", str(tmp_path / "r.json"))
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(tmp_path / "out")) == ["cnn", "mlp_b1"]
    report = json.loads((tmp_path / "r.json").read_text())
    assert [m["model"] for m in report["models"]] == ["cnn", "mlp"]
    assert report["totals"]["compiled"] == report["totals"]["kernels"]


def _one_op(op: str, name: str) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph([helper.make_node(op, ["x"], ["y"])], name, [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture
def a_batch_with_every_kind_of_failure(tmp_path, monkeypatch):
    """Two good models among one of each failure: a corrupt file, an unsupported op, a kernel
    that fails codegen on every attempt, a model whose link fails."""
    corrupt = tmp_path / "corrupt.onnx"
    corrupt.write_bytes(b"\x08\x07 not a model")
    real_assemble = bundle.assemble

    def assemble(lowered, objects, target, manifest, *rest):
        if manifest["model"] == "link_fails":
            raise KilnError("linking the module failed (cc ...): injected by the test")
        return real_assemble(lowered, objects, target, manifest, *rest)
    monkeypatch.setattr(bundle, "assemble", assemble)
    models = [model_zoo.mlp(1), str(corrupt), _one_op("NoSuchOp", "unsupported"), _one_op("Sin", "codegen_fails"),
              _one_op("Tanh", "link_fails"), model_zoo.cnn()]
    return models, {"fused_sin": "crash:always"}


@pytest.mark.parametrize("hosts", ["1", "2"])  # planned and linked by the driver, or by forked model hosts
def test_a_model_that_fails_fails_alone(a_batch_with_every_kind_of_failure, executor, hosts, monkeypatch):
    monkeypatch.setenv("KILN_MODEL_HOSTS", hosts)
    models, inject = a_batch_with_every_kind_of_failure
    batch = build_many(models, executor=executor, cache=None, progress=False, inject=inject)
    assert batch.report["timing"]["model_hosts"] == (0 if hosts == "1" else 2)
    assert [r is not None for r in batch.results] == [True, False, False, False, False, True]
    stages = {f.index: (f.stage, f.message) for f in batch.failures}
    assert stages[1][0] == "plan" and "corrupt.onnx' is not a valid ONNX model" in stages[1][1]
    assert stages[2][0] == "plan" and "NoSuchOp" in stages[2][1]
    assert stages[3][0] == "compile" and "fused_sin" in stages[3][1] and "crash" in stages[3][1]
    assert stages[4][0] == "link" and "injected by the test" in stages[4][1]
    rows = batch.report["models"]
    assert [row["status"] for row in rows] == ["built", "failed", "failed", "failed", "failed", "built"]
    assert rows[3]["kernels"] and rows[1]["model"] == models[1]
    assert batch.report["totals"]["models_failed"] == 4
    for i in (0, 5):  # the good models are what they are built alone
        alone = build(models[i], executor=executor, cache=None, progress=False)
        assert batch.results[i].files["model.so"] == alone.files["model.so"]
        assert_matches_oracle(batch.results[i], models[i])


@pytest.mark.parametrize("hosts", ["1", "2"])
def test_fail_fast_stops_at_the_first_failure(a_batch_with_every_kind_of_failure, executor, hosts, monkeypatch):
    monkeypatch.setenv("KILN_MODEL_HOSTS", hosts)
    models, inject = a_batch_with_every_kind_of_failure
    with pytest.raises(KilnError, match="corrupt.onnx' is not a valid ONNX model"):
        build_many(models, executor=executor, cache=None, progress=False, inject=inject, fail_fast=True)
    with pytest.raises(BuildError, match="fused_sin"):  # the compile failure, once the bad inputs are gone
        build_many([models[0], models[3]], executor=executor, cache=None, progress=False, inject=inject,
                   fail_fast=True)


def test_build_many_cli_builds_every_good_model_and_names_the_bad_one(tmp_path):
    paths = []
    for name in ("cnn", "mlp_b1"):
        paths.append(str(tmp_path / f"{name}.onnx"))
        onnx.save(model_zoo.ALL[name](), paths[-1])
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x08\x07 not a model")
    r = kiln("build-many", paths[0], str(bad), paths[1], "-o", str(tmp_path / "out"), "--no-cache",
             "--report", str(tmp_path / "r.json"))
    assert r.returncode == 1, r.stderr
    assert sorted(os.listdir(tmp_path / "out")) == ["cnn", "mlp_b1"]
    assert "built 2 of 3 models" in r.stdout
    assert f"kiln: {bad}: failed to plan: model file '{bad}' is not a valid ONNX model" in r.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert [m["status"] for m in report["models"]] == ["built", "failed", "built"]
    r = kiln("build-many", paths[0], str(bad), paths[1], "-o", str(tmp_path / "out2"), "--no-cache", "--fail-fast")
    assert r.returncode == 2 and "kiln: error: model file" in r.stderr
    assert not os.path.exists(tmp_path / "out2" / "cnn")
