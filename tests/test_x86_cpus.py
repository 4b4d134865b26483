"""A target named by its CPU (`-mcpu=X`) gets X's features; loading checks every feature the
code may use against the host.

The table of CPUs (orchestrator/x86_cpus.py) is held to two oracles: the list of CPUs LLVM
itself prints (llvmlite's LLVM, asked for `-mcpu=help`), and for every CPU the C compiler
knows, the features it says `-march=X` implies.
"""
import re
import subprocess
import sys

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import modelkiln.artifacts.module as module_mod
from modelkiln.artifacts.cpu_features import (FLAG_OF_LLVM, IMPLIES, NOT_EMITTED, X86_FEATURES, byte_dot_widths,
                                              checkable, enabled, host_flags)
from modelkiln.ir.errors import KilnError
from modelkiln.orchestrator.api import build
from modelkiln.orchestrator.pipeline import schedule_for
from modelkiln.orchestrator.target import parse_target
from modelkiln.orchestrator.x86_cpus import THIRTY_TWO_BIT_ONLY, cpu_features, cpu_names
from tests import model_zoo
from tests.conftest import kernel_statements, shared_cache
from tests.isa import kernel_assembly, run_or_inspect

_LLVM_HELP = """
import llvmlite.binding as llvm
llvm.initialize_all_targets(); llvm.initialize_all_asmprinters()
llvm.Target.from_triple("x86_64-unknown-linux-gnu").create_target_machine(cpu="help", features="")
"""

# Where GCC and LLVM disagree about a CPU (LLVM's table is what LLVM compiles with): GCC 12's
# -march=sapphirerapids turns on AVX512-VP2INTERSECT, which LLVM's Sapphire Rapids has not.
GCC_DIFFERS = {"sapphirerapids": {"avx512vp2intersect"}}


def _llvm_lists() -> tuple[set, set]:
    """(the x86 CPUs, the x86 features) llvmlite's LLVM knows, as it prints them."""
    err = subprocess.run([sys.executable, "-c", _LLVM_HELP], capture_output=True, text=True, timeout=60).stderr
    cpus, features = err.split("Available features for this target:")
    return set(re.findall(r"^\s+(\S+)\s+- Select the", cpus, re.M)), set(re.findall(r"^\s+(\S+)\s+- ", features, re.M))


def test_the_table_holds_every_cpu_and_feature_llvm_knows():
    cpus, features = _llvm_lists()
    assert len(cpus) > 100 and "emeraldrapids" in cpus  # (the listing was read)
    assert not cpus - set(cpu_names()) - THIRTY_TWO_BIT_ONLY, "CPUs LLVM knows that x86_cpus.py does not"
    assert not set(cpu_names()) - cpus
    named = ({f for f, _, _ in X86_FEATURES} | NOT_EMITTED | set(IMPLIES) | {g for v in IMPLIES.values() for g in v}
             | {f for cpu in cpu_names() for f in cpu_features(cpu)})
    assert not named - features, "feature names LLVM does not know"


def test_cpu_features_agree_with_the_c_compiler():
    with_macro = {llvm for llvm, macro, _ in X86_FEATURES if macro}
    macro_of = {llvm: macro for llvm, macro, _ in X86_FEATURES if macro}
    compared = 0
    for cpu in cpu_names():
        p = subprocess.run(["cc", f"-march={cpu}", "-dM", "-E", "-x", "c", "-"], input="", capture_output=True,
                           text=True, timeout=30)
        if p.returncode:  # (a CPU newer than this compiler)
            continue
        macros = {line.split()[1] for line in p.stdout.splitlines() if line.startswith("#define ")}
        gcc = {f for f in with_macro if macro_of[f] in macros}
        ours = cpu_features(cpu) & with_macro
        assert gcc ^ ours == GCC_DIFFERS.get(cpu, set()), cpu
        compared += 1
    assert compared > 50


def test_a_cpu_name_alone_gives_its_features():
    """-mcpu=sapphirerapids (and emeraldrapids) alone: AVX-512 with VNNI, BF16, FP16 and AMX,
    so the int8 kernels take the tiles; -mattr takes features away, and what depends on them."""
    for cpu in ("sapphirerapids", "emeraldrapids"):
        t = parse_target(f"llvm -mcpu={cpu}")
        assert {"avx512vnni", "avx512bf16", "avx512fp16", "amx-tile", "amx-int8", "amx-bf16"} <= enabled(t.features)
        config = schedule_for(t)
        assert t.vector_width == 16 and config.int8_tiles and config.bf16_tiles
        assert {"avx512_vnni", "amx_int8", "amx_tile"} <= set(t.cpu_flags())
    assert byte_dot_widths(parse_target("llvm -mcpu=cascadelake").features) == {16, 8}
    no_tiles = parse_target("llvm -mcpu=sapphirerapids -mattr=-amx-tile")
    assert not {f for f in enabled(no_tiles.features) if f.startswith("amx")} and not schedule_for(no_tiles).int8_tiles
    assert "avx512vnni" in enabled(no_tiles.features)
    no_512 = parse_target("llvm -mcpu=znver4 -mattr=-avx512f")
    assert no_512.vector_width == 8 and not {f for f in enabled(no_512.features) if f.startswith("avx512")}


def test_an_int8_model_built_for_a_cpu_name_uses_its_int8_units():
    """An int8 GEMM built for `-mcpu=sapphirerapids` runs on the tiles (it took the slow byte
    path when the name carried no features), for `-mcpu=cascadelake` on VNNI; both exact
    against onnx's reference evaluator where this host runs them."""
    import onnx.reference
    rng = np.random.default_rng(0)
    w = rng.integers(-128, 128, (128, 64), dtype=np.int8)
    a = rng.integers(0, 256, (48, 128), dtype=np.uint8)
    graph = helper.make_graph([helper.make_node("MatMulInteger", ["a", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("a", TensorProto.UINT8, [48, 128])],
                              [helper.make_tensor_value_info("y", TensorProto.INT32, None)],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    want = onnx.reference.ReferenceEvaluator(model).run(None, {"a": a})[0]
    for cpu, tiles in (("sapphirerapids", True), ("cascadelake", False)):
        result = build(model, target=f"llvm -mcpu={cpu}", executor="inprocess", cache=shared_cache(), progress=False)
        gemms = [s for c in result.lowered.calls for s in kernel_statements(c.kernel.body)
                 if type(s).__name__ == "Gemm"]
        assert [(g.kind, g.tiles, g.b_words) for g in gemms] == [("u8s8", tiles, False)], cpu
        run_or_inspect(result, lambda r=result: np.testing.assert_array_equal(r.load().run({"a": a})["y"], want),
                       ["tdpbusd"] if tiles else ["vpdpbusd"])


@pytest.mark.parametrize("cpu,flag", [("graniterapids", "amx_fp16"), ("znver5", "avx512_vp2intersect")])
def test_a_bundle_for_a_newer_cpu_is_refused_naming_what_the_host_lacks(cpu, flag, monkeypatch, tmp_path):
    """On an Emerald Rapids (simulated: this host's flags without the ones it lacks), bundles
    for Granite Rapids (AMX-FP16) and Zen 5 (AVX512-VP2INTERSECT) are refused by name."""
    out = build(model_zoo.cnn(), target=f"llvm -mcpu={cpu}", executor="inprocess", cache=shared_cache(),
                progress=False).export(str(tmp_path / cpu))
    emerald = set(parse_target("llvm -mcpu=emeraldrapids").cpu_flags())
    assert flag not in emerald
    monkeypatch.setattr(module_mod, "missing_on_host", lambda required: sorted(set(required) - emerald))
    with pytest.raises(KilnError, match=f"lacks: {flag}"):
        module_mod.Module(out)


def test_names_kiln_cannot_build_for_are_refused_by_name():
    with pytest.raises(KilnError, match="unknown x86-64 CPU 'zen9'"):
        parse_target("llvm -mcpu=zen9")
    with pytest.raises(KilnError, match="CPU 'pentium4' cannot run 64-bit code"):
        parse_target("llvm -mcpu=pentium4")
    with pytest.raises(KilnError, match="feature 'egpr' is not one Kiln can check a host for"):
        parse_target("llvm -mcpu=sapphirerapids -mattr=+egpr")


def test_features_no_host_can_be_checked_for_are_turned_off():
    """Diamond Rapids' APX and AVX10.2 have no /proc/cpuinfo flag Kiln knows: a build for it
    turns them off (no APX registers in its code) and says so; the host's own target turns
    on nothing it could not check."""
    t = parse_target("llvm -mcpu=diamondrapids")
    assert {"egpr", "ndd", "avx10.2"} <= {f[1:] for f in t.features.split(",") if f[:1] == "-"}
    assert "off (no host can be checked for them): avx10.2" in t.feature_summary()
    assert all(checkable(f) for f in enabled(t.features))
    result = build(model_zoo.cnn(), target=t, executor="inprocess", cache=shared_cache(), progress=False)
    assert not re.search(r"%r(1[6-9]|2[0-9]|3[01])\b", kernel_assembly(result))
    assert all(checkable(f) for f in enabled(parse_target("llvm").features))


def test_the_host_target_requires_only_what_the_host_has():
    have = host_flags()
    if have is None:
        pytest.skip("host_flags: no /proc/cpuinfo flags to compare with")
    assert set(parse_target("llvm").cpu_flags()) <= have
    assert set(FLAG_OF_LLVM.values()) & have  # (the table's spellings are this kernel's)
