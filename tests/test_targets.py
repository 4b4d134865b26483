"""Targets: string forms, presets, code shaped per target, and a cross target."""

import numpy as np
import pytest

from modelkiln.ir.errors import KilnError
from modelkiln.orchestrator.api import build
from modelkiln.orchestrator.target import parse_target
from tests import model_zoo
from tests.conftest import build_and_compare_for


def test_target_strings():
    host = parse_target("llvm")
    assert host.triple.startswith("x86_64") and host.features
    t = parse_target("llvm -mcpu=haswell -mattr=+avx2,+fma -cl-opt=-unroll-threshold=100")
    assert (t.cpu, t.llvm_options, t.vector_width) == ("haswell", ("-unroll-threshold=100",), 8)
    assert t.features.endswith(",+avx2,+fma")  # (Haswell's own features first: tests/test_x86_cpus.py)
    assert parse_target("cascadelake").vector_width == 16
    assert parse_target("x86-64-v3").vector_width == 8
    assert parse_target("aarch64").arch == "aarch64" and not parse_target("aarch64").runnable  # not on x86
    with pytest.raises(KilnError, match="start with \\+ or -"):
        parse_target("llvm -mcpu=haswell -mattr=avx2")


@pytest.mark.parametrize("target", ["x86-64-v3", "cascadelake", "llvm -mcpu=x86-64"])
def test_presets_build_correct_code(target, executor):
    """AVX2 (6x16 tiles), AVX-512 (14x32) and SSE-only (6x8) code paths all match the oracle
    where this host runs them (their assembly checked where it does not: tests/isa.py)."""
    build_and_compare_for(model_zoo.transformer_encoder(seq=16, d=32, heads=2, ffn=64), executor, target)
    build_and_compare_for(model_zoo.cnn(), executor, target)


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


# Machines the build could run on, as LLVM would describe each (host_toolchain's answer).
OTHER_HOSTS = {
    "zen3": {"triple": "x86_64-unknown-linux-gnu", "cpu": "znver3",
             "features": "+sse4.2,+avx,+avx2,+fma,+f16c,+bmi2,-avx512f,-avx512vnni,-avxvnni"},
    "sapphirerapids": {"triple": "x86_64-unknown-linux-gnu", "cpu": "sapphirerapids",
                       "features": "+avx2,+fma,+avx512f,+avx512bw,+avx512vl,+avx512vnni,+avx512fp16,+amx-tile"},
    "graviton3": {"triple": "aarch64-unknown-linux-gnu", "cpu": "neoverse-v1", "features": "+neon,+sve,+dotprod"},
}


@pytest.mark.parametrize("target", ["x86-64-v3", *(pytest.param(t, marks=pytest.mark.slow) for t in ("cascadelake",
                                                                                                  "aarch64"))])
def test_explicit_target_builds_the_same_bytes_on_any_host(target, executor, monkeypatch):
    """A build for an explicit target reads nothing of the machine it runs on: with host
    detection reporting other CPUs (and another architecture), every file of every bundle
    (objects, linked library, manifest, weights) is the same bytes. Only the target 'llvm'
    may ask for the host."""
    from modelkiln.orchestrator import toolchain
    models = [model_zoo.cnn(), model_zoo.transformer_encoder(seq=16, d=32, heads=2, ffn=64),
              model_zoo.quantized(model_zoo.residual_cnn(), "qdq")]
    real = toolchain.host_toolchain()

    def build_on(host):
        monkeypatch.setattr(toolchain, "host_toolchain", lambda: {**real, **host})
        assert parse_target("llvm").cpu == host["cpu"]  # the pretence reaches target resolution
        return [build(m, target=target, executor=executor, cache=None, progress=False).files for m in models]

    here = build_on({k: real[k] for k in ("triple", "cpu", "features")})
    for name, host in OTHER_HOSTS.items():
        there = build_on(host)
        for files_here, files_there in zip(here, there):
            assert files_here.keys() == files_there.keys(), name
            differ = [f for f in files_here if bytes(files_here[f]) != bytes(files_there[f])]
            assert not differ, f"built on a {name} host, these files differ: {differ}"
