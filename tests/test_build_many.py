"""Batch builds: kernels shared across models compile once; one report for the batch."""
import json
import os

import onnx

from modelkiln.orchestrator.api import build, build_many
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
