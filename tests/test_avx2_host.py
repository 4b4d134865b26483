"""On an AVX2-only host (AMD Zen 3, emulated by qemu on any x86-64 machine: tests/avx2_host.py),
a build for this machine ("llvm") is AVX2 code that runs and matches onnxruntime; Kiln's int8
is exact where onnxruntime's is not, and the tests' oracle choice knows it; a bundle built
for AVX-512 is refused at load, naming what the host lacks.

The guest half runs in the emulated process and reports what it saw as JSON; the asserts
are here. On an AVX2 host the same test holds: the emulated CPU is the same kind.
"""
import json
import os
import re
import subprocess

import pytest
from onnx import helper

from modelkiln.artifacts.cpu_features import host_arch
from modelkiln.orchestrator.api import build
from tests import avx2_host, model_zoo
from tests.isa import AVX512, VECTOR_SIGNS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _int8_model():
    """MatMulInteger, u8 x s8 with K = 64: pairs of products leave a saturating 16-bit sum
    (onnxruntime's AVX2 kernels, vpmaddubsw) for most outputs."""
    from tests.test_quantized import I8, I32, U8, _bytes, _model
    w = _bytes([64, 40], I8, 1)
    model = _model([helper.make_node("MatMulInteger", ["a", "w"], ["y"])], [("a", U8, [3, 17, 64])],
                   [("y", I32)], [("w", w)])
    return model, {"a": _bytes([3, 17, 64], U8, 2)}


def guest(foreign_bundle: str) -> None:
    """In the emulated process: build for this host, run, compare; print a report."""
    from modelkiln.artifacts import load
    from modelkiln.artifacts.cpu_features import host_flags
    from modelkiln.ir.errors import KilnError
    from tests.conftest import assert_matches_oracle
    from tests.int8_reference import onnxruntime_int8_is_exact, reference_outputs
    from tests.isa import kernel_assembly
    cnn = model_zoo.cnn()
    result = build(cnn, executor="inprocess", cache=None, progress=False)
    assert_matches_oracle(result, cnn)
    asm = kernel_assembly(result)
    model, feeds = _int8_model()
    got = build(model, executor="inprocess", cache=None, progress=False).load().run(feeds)["y"]
    want = reference_outputs(model, feeds)["y"]
    ort = model_zoo.onnxruntime_outputs(model, feeds)["y"]
    try:
        load(foreign_bundle)
        refusal = None
    except KilnError as e:
        refusal = str(e)
    print(json.dumps({
        "cpu": result.target.cpu, "features": result.target.features, "lanes": result.target.vector_width,
        "avx512_signs": bool(re.search(VECTOR_SIGNS[16], asm)), "ymm": "%ymm" in asm,
        "host_has_avx512f": "avx512f" in host_flags(), "oracle_trusts_onnxruntime": onnxruntime_int8_is_exact(),
        "kiln_int8_wrong": int((got != want).sum()), "onnxruntime_int8_wrong": int((ort != want).sum()),
        "outputs": int(want.size), "refusal": refusal}))


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    """(Runs a whole build under qemu: the tests reading it are marked slow.)"""
    assert host_arch() == "x86_64", "an emulated x86 host runs on an x86-64 machine"
    root = str(tmp_path_factory.mktemp("kiln-avx2-host"))
    foreign = build(model_zoo.cnn(), target=AVX512, executor="inprocess", cache=None,
                    progress=False).export(os.path.join(root, "cascadelake-bundle"))
    code = f"from tests.test_avx2_host import guest; guest({foreign!r})"
    proc = subprocess.run(avx2_host.command(root, ["-c", code]), env=avx2_host.prepare(root), cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    errors = "".join(line for line in proc.stderr.splitlines(keepends=True) if avx2_host.QEMU_NOISE not in line)
    assert proc.returncode == 0, errors[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_build_for_this_host_is_avx2_code_and_matches(report):
    assert report["cpu"] == "znver3" and not report["host_has_avx512f"]
    assert "+avx2" in report["features"] and "+avx512f" not in report["features"]
    assert report["lanes"] == 8 and report["ymm"] and not report["avx512_signs"]


@pytest.mark.slow
def test_int8_is_exact_where_onnxruntime_saturates(report):
    """Kiln's u8 x s8 sums equal onnx's reference; onnxruntime's (the same emulated CPU) do
    not, and the suite's oracle choice (tests/int8_reference.py) does not trust them here."""
    assert report["kiln_int8_wrong"] == 0
    assert report["onnxruntime_int8_wrong"] > 0
    assert not report["oracle_trusts_onnxruntime"]


@pytest.mark.slow
def test_a_bundle_for_avx512_is_refused_naming_the_missing_features(report):
    assert report["refusal"] and all(f in report["refusal"] for f in ("avx512f", "avx512bw", "avx512_vnni"))


def test_the_zen3_cpuinfo_keeps_avx2_and_drops_avx512():
    real = "processor\t: 0\nmodel name\t: AMD EPYC 9B45\nflags\t\t: fpu avx avx2 fma avx512f avx512_vnni avx_vnni\n"
    flags = [line for line in avx2_host.zen3_cpuinfo(real).splitlines() if line.startswith("flags")]
    assert flags == ["flags\t\t: fpu avx avx2 fma"]


def test_a_suite_run_as_an_avx2_host_keeps_its_tests_in_the_emulated_process():
    """pytest-xdist's test processes would start outside qemu, on the real CPU."""
    assert avx2_host.in_one_process(["-m", "pytest", "-q", "tests/"]) == ["-m", "pytest", "-n", "0", "-q", "tests/"]
    assert avx2_host.in_one_process(["-m", "pytest", "-n", "1", "tests/"]) == ["-m", "pytest", "-n", "1", "tests/"]
    assert avx2_host.in_one_process(["script.py"]) == ["script.py"]
