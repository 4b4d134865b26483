"""A whole-model hit through the CLI is cheap: it imports neither numpy, onnx nor LLVM, and
the toolchain facts every key names come from a record, not from asking LLVM again."""
import json
import os
import subprocess
import sys

from tests.conftest import ROOT

_HIT = """
import sys
from modelkiln.orchestrator import cli
rc = cli.main(sys.argv[1:])
heavy = sorted(m for m in ("numpy", "onnx", "llvmlite.binding", "modelkiln.ir.frontend_onnx", "modelkiln.ir.lower.group") if m in sys.modules)
print("HEAVY", ",".join(heavy))
sys.exit(rc)
"""


def _kiln_hit(args, env):
    r = subprocess.run([sys.executable, "-c", _HIT, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout.split("HEAVY")[-1].strip()


def test_whole_model_hit_imports_no_numpy_onnx_or_llvm(tmp_path):
    env = {**os.environ, "KILN_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": ROOT}
    example = os.path.join(ROOT, "configs", "examples", "cnn.onnx")
    args = ["build", example, "-o", str(tmp_path / "out"), "--quiet", "--report", str(tmp_path / "r.json")]
    assert _kiln_hit(args, env) != ""  # the cold build needs them all
    assert _kiln_hit(args, env) == ""
    assert json.loads((tmp_path / "r.json").read_text())["whole_model_hit"]


def test_toolchain_record_says_what_llvm_says(tmp_path, monkeypatch):
    import llvmlite
    import llvmlite.binding as llvm

    from modelkiln.artifacts.link import compiler_identity
    from modelkiln.orchestrator import toolchain
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    toolchain.host_toolchain.cache_clear()
    try:
        asked = toolchain.host_toolchain()
        toolchain.host_toolchain.cache_clear()
        recorded = toolchain.host_toolchain()  # read back from the record
    finally:
        toolchain.host_toolchain.cache_clear()
    llvm.initialize_native_target()
    truth = {"triple": llvm.get_process_triple(), "cpu": llvm.get_host_cpu_name(),
             "features": llvm.get_host_cpu_features().flatten(), "llvmlite": llvmlite.__version__,
             "llvm": ".".join(map(str, llvm.llvm_version_info)), "cc": compiler_identity()}
    assert asked == recorded == truth
    assert len(os.listdir(tmp_path / "toolchain")) == 1
