"""Targets: string forms, presets, code shaped per target, and a cross target."""
import os

import numpy as np
import pytest

from modelkiln.ir.errors import KilnError
from modelkiln.orchestrator.api import build
from modelkiln.orchestrator.target import parse_target
from tests import model_zoo
from tests.conftest import build_and_compare


def test_target_strings():
    host = parse_target("llvm")
    assert host.triple.startswith("x86_64") and host.features
    t = parse_target("llvm -mcpu=haswell -mattr=+avx2,+fma -cl-opt=-unroll-threshold=100")
    assert (t.cpu, t.features, t.llvm_options, t.vector_width) == ("haswell", "+avx2,+fma",
                                                                     ("-unroll-threshold=100",), 8)
    assert parse_target("cascadelake").vector_width == 16
    assert parse_target("x86-64-v3").vector_width == 8
    assert parse_target("aarch64").arch == "aarch64" and not parse_target("aarch64").runnable
    with pytest.raises(KilnError, match="start with \\+ or -"):
        parse_target("llvm -mcpu=haswell -mattr=avx2")


@pytest.mark.parametrize("target", ["x86-64-v3", "cascadelake", "llvm -mcpu=x86-64"])
def test_presets_build_correct_code(target, executor):
    """AVX2 (6x16 tiles), AVX-512 (14x32) and SSE-only (6x8) code paths all match the oracle."""
    build_and_compare(model_zoo.transformer_encoder(seq=16, d=32, heads=2, ffn=64), executor, target=target)
    build_and_compare(model_zoo.cnn(), executor, target=target)


def test_cross_target_emits_objects_but_does_not_run(tmp_path, executor):
    result = build(model_zoo.cnn(), target="aarch64", executor=executor, cache=None)
    path = result.export(str(tmp_path / "arm"))
    objects = os.listdir(os.path.join(path, "objects"))
    assert objects and "model.so" not in os.listdir(path)
    with open(os.path.join(path, "objects", objects[0]), "rb") as f:
        head = f.read(20)
    assert head[:4] == b"\x7fELF" and int.from_bytes(head[18:20], "little") == 183  # EM_AARCH64
    from modelkiln.artifacts import load
    with pytest.raises(KilnError, match="cannot run on this machine"):
        load(path)


def test_unroll_option_changes_code_but_not_results(executor):
    plain = build(model_zoo.cnn(), executor=executor, cache=None)
    tuned = build(model_zoo.cnn(), target="llvm -cl-opt=-unroll-threshold=1", executor=executor, cache=None)
    assert plain.files["model.so"] != tuned.files["model.so"]
    x = model_zoo.random_inputs(model_zoo.cnn())
    np.testing.assert_allclose(plain.load().run(x)["logits"], tuned.load().run(x)["logits"], rtol=1e-5, atol=1e-6)


def test_preset_carries_its_own_llvm_options(monkeypatch, executor):
    from modelkiln import configs
    real = configs.load_preset

    def with_custom(name):
        if name == "tuned-host":
            return {"name": "tuned-host", "target": "llvm", "llvm_options": ["-unroll-threshold=0"]}
        return real(name)
    monkeypatch.setattr("modelkiln.orchestrator.target.load_preset", with_custom)
    t = parse_target("tuned-host")
    assert t.name == "tuned-host" and t.llvm_options == ("-unroll-threshold=0",)
    tuned = build(model_zoo.cnn(), target="tuned-host", executor=executor, cache=None)
    plain = build(model_zoo.cnn(), executor=executor, cache=None)
    assert tuned.files["model.so"] != plain.files["model.so"]
    assert tuned.report["kernels"][0]["attempts"] == 1
    x = model_zoo.random_inputs(model_zoo.cnn())
    np.testing.assert_allclose(tuned.load().run(x)["logits"], model_zoo.onnxruntime_outputs(model_zoo.cnn(), x)["logits"],
                               rtol=1e-3, atol=1e-4)
