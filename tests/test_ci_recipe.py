"""The CI recipe in docs/cache-and-ci.md (docs/ci/github-actions-kiln.yml), step by step: main writes
the store, a pull request reads it read-only, gc keeps it bounded."""
import json

import onnx

from modelkiln.artifacts.store import Store
from tests import model_zoo
from tests.test_bad_input import kiln


def test_main_writes_pull_requests_only_read(tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    onnx.save(model_zoo.cnn(), models / "cnn.onnx")
    onnx.save(model_zoo.mlp(1), models / "mlp.onnx")
    store = str(tmp_path / "kiln-store")
    paths = sorted(str(p) for p in models.iterdir())

    def ci_run(*extra):
        report = tmp_path / "kiln-report.json"
        r = kiln("build-many", *paths, "-o", str(tmp_path / "dist"), "--cache", store, "--quiet",
                 "--report", str(report), "--trace", str(tmp_path / "kiln-trace.json"), *extra)
        assert r.returncode == 0, r.stderr
        return json.loads(report.read_text())["totals"]

    first = ci_run()  # main, cold
    assert first["compiled"] == first["kernels"] > 0
    entries = Store(store).stats()["entries"]
    pr = ci_run("--cache-readonly")  # pull request, unchanged models: all hits
    assert pr["compiled"] == 0 and pr["cached"] == pr["kernels"]
    changed = model_zoo.mlp(1)
    for node in changed.graph.node:
        if node.op_type == "Relu":
            node.op_type = "Sigmoid"
    onnx.save(changed, models / "mlp.onnx")
    pr = ci_run("--cache-readonly")  # pull request that changes a model: compiles, writes nothing
    assert pr["compiled"] >= 1 and Store(store).stats()["entries"] == entries
    assert kiln("cache", "gc", "--cache", store, "--max-size", "2G").returncode == 0
    assert Store(store).stats()["entries"] == entries
