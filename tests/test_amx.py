"""8-bit GEMMs and convs on AMX's tile unit (Gemm.tiles, codegen_worker/tile_gemm.py).

Built for the `sapphirerapids` preset, every case runs where the host has AMX (Sapphire
Rapids and later Xeons) and is compared exactly with onnx's reference evaluator: the tiles
sum bytes in int32 as VNNI does, so Kiln's int8 stays exact. On a host without AMX the same
builds are checked by what they emit (tile loads, the dot instruction of each signedness pair,
the tile configuration), and loading them is refused by name: nothing runs that would fault.
Each case also asserts that its GEMMs ran on tiles, so a lowering that fell back to VNNI fails.

The tests that need real tiles (the process's permission, several threads) are skipped by the
named check `host_has_amx` where the host has none, with the reason in pytest's summary.
"""
import os
import subprocess
import sys

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from modelkiln.artifacts import module as module_mod
from modelkiln.artifacts.cpu_features import host_flags
from modelkiln.ir.errors import KilnError
from modelkiln.ir.lower.tile_rules import TILE_MIN_ROWS
from modelkiln.orchestrator.api import build
from tests import model_zoo
from tests.conftest import kernel_statements, shared_cache
from tests.int8_reference import reference_outputs
from tests.isa import AVX512, kernel_assembly, run_or_inspect

AMX = "sapphirerapids"
U8, I8, I32 = TensorProto.UINT8, TensorProto.INT8, TensorProto.INT32
NP = {U8: np.uint8, I8: np.int8}
DOT = {"u8s8": "tdpbusd", "s8s8": "tdpbssd", "s8u8": "tdpbsud"}


def host_has_amx() -> bool:
    """AMX-TILE and AMX-INT8 in /proc/cpuinfo (the kernel also lists them only where it
    supports the tile state)."""
    return {"amx_tile", "amx_int8"} <= (host_flags() or set())


needs_amx = pytest.mark.skipif(not host_has_amx(), reason="host_has_amx: no amx_tile/amx_int8 in /proc/cpuinfo")


def _model(nodes, inputs, outputs, inits=(), opset=21):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
                              [helper.make_tensor_value_info(n, t, None) for n, t in outputs],
                              [numpy_helper.from_array(v, n) for n, v in inits])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _bytes(shape, t, seed=0):
    info = np.iinfo(NP[t])
    return np.random.default_rng(seed).integers(info.min, info.max + 1, shape).astype(NP[t])


def _gemms(result) -> list:
    return [s for c in result.lowered.calls for s in kernel_statements(c.kernel.body)
            if type(s).__name__ == "Gemm" and s.kind != "f32"]


def _exact(model, feeds, target=AMX, atol=0, all_tiles=True):
    """Build for `target`; where the host runs it, equal to the reference (within atol output
    steps for a QDQ model, whose reference computes in float), else its assembly holds the
    tile instructions of its GEMMs. Every GEMM on tiles, or with all_tiles False some (a
    whole model's stem or classifier may stay on VNNI by the cost rule)."""
    result = build(model, target=target, executor="inprocess", cache=shared_cache(), progress=False)
    gemms = _gemms(result)
    assert gemms and (all if all_tiles else any)(g.tiles for g in gemms), [(g.kind, g.m, g.tiles) for g in gemms]

    def run():
        got, want = result.load().run(feeds), reference_outputs(model, feeds)
        for name in want:
            if atol:
                np.testing.assert_allclose(got[name].astype(np.float64), want[name].astype(np.float64),
                                           rtol=0, atol=atol, err_msg=name)
            else:
                np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    run_or_inspect(result, run, ["ldtilecfg", "tileloadd", *{DOT[g.kind] for g in gemms}])
    return result


@pytest.mark.parametrize("a_type,b_type", [(U8, I8), (I8, I8), (U8, U8), (I8, U8)])
@pytest.mark.parametrize("m,k,n", [(37, 200, 70), (5, 100, 16), (100, 64, 33), (64, 1024, 48), (8, 256, 200)])
def test_matmul_integer_on_tiles(a_type, b_type, m, k, n):
    """Every signedness pair; rows, k and columns off the tiles' 16 x 64 bytes x 16 (a last
    tile of fewer rows, a last k step of fewer bytes, a panel past N; 2 x 2 and 4 x 1
    accumulator tiles); per-column weight zero points and a zero point computed
    at run time; a batch dim."""
    w = (_bytes([k, n], b_type, 1).astype(np.int32) * 200 // 255).astype(NP[b_type])
    zb = (_bytes([n], b_type, 2).astype(np.int32) // 8 + (85 if b_type == U8 else 0)).astype(NP[b_type])
    nodes = [helper.make_node("Add", ["za_in", "zero"], ["za"]),
             helper.make_node("MatMulInteger", ["a", "w", "za", "zb"], ["y"])]
    model = _model(nodes, [("a", a_type, [2, m, k]), ("za_in", a_type, [])], [("y", I32)],
                   [("w", w), ("zb", zb), ("zero", np.zeros((), NP[a_type]))])
    result = _exact(model, {"a": _bytes([2, m, k], a_type, 3), "za_in": np.array(5, NP[a_type])})
    # (signed activations multiply as they are on tiles: tdpbssd, no shift by 128)
    assert {g.kind for g in _gemms(result)} == {"s8s8" if a_type == I8 else "u8s8"}


@pytest.mark.parametrize("x_type", [U8, I8])
@pytest.mark.parametrize("case", [
    dict(shape=[1, 64, 14, 14], pads=[1, 1, 1, 1]),  # one k run per window row: 3 x 64 channels
    dict(shape=[2, 10, 11, 13]),  # a run of 3 x 12 channels: only a short step
    dict(shape=[1, 16, 9, 20], strides=[2, 2], pads=[1, 1, 1, 1]),
    dict(shape=[1, 128, 12, 12], group=2, pads=[1, 1, 1, 1]),  # runs per window tap, per group
    dict(shape=[1, 192, 8, 13], group=3, dilations=[2, 2], pads=[2, 0, 1, 2]),
    dict(shape=[1, 3, 30, 30], kernel=7, strides=[2, 2], pads=[3, 3, 3, 3], cout=32),  # a stem: 3 channels
    dict(shape=[1, 64, 7, 7], kernel=1),  # pointwise: weights as A, pixels as B (tdpbsud)
    dict(shape=[1, 70, 40, 37], pads=[0, 1, 2, 1]),  # 18 quads, rows of 37 + 2 pixels
    dict(shape=[1, 64, 14, 14], strides=[2, 2], pads=[1, 1, 1, 1], cout=200),  # rows of 7 pixels
])
def test_conv_integer_on_tiles(x_type, case):
    """The channels-last implicit GEMM, A's window rows read as tiles in place from the
    bordered copy (Gemm.a_kruns): over the padded plane's rows end to end for stride 1
    (Gemm.m_rows: the pixels between rows computed and not stored), per output row
    otherwise; and the pointwise GEMM. 24 output channels (a panel past N). Exact int32."""
    case = dict(case)
    k, shape, cout = case.pop("kernel", 3), case.pop("shape"), case.pop("cout", 24)
    w = (_bytes([cout, shape[1] // case.get("group", 1), k, k], I8, 1).astype(np.int32) * 200 // 255).astype(np.int8)
    model = _model([helper.make_node("ConvInteger", ["x", "w", "zx", "zw"], ["y"], **case)], [("x", x_type, shape)],
                   [("y", I32)], [("w", w), ("zw", np.array(-3, np.int8)), ("zx", np.array(7, NP[x_type]))])
    result = _exact(model, {"x": _bytes(shape, x_type, 3)})
    pointwise = k == 1 and not case
    assert all(bool(g.m_rows) == (not pointwise and case.get("strides", [1, 1]) == [1, 1]) for g in _gemms(result))


@pytest.mark.parametrize("fmt", ["qdq", "qoperator"])
@pytest.mark.parametrize("per_channel", [True, False])
def test_quantized_cnn_on_tiles(fmt, per_channel):
    """A residual CNN through onnxruntime's quantizer, per-tensor and per-channel: the fused
    requantize, bias and residual add read the accumulators the tiles stored. Within one
    output step of the reference (which computes the QDQ model's convs in float)."""
    model = model_zoo.quantized(model_zoo.residual_cnn(), fmt, per_channel=per_channel)
    out = model.graph.output[0].name
    consts = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    last = next(n for n in model.graph.node if out in n.output)
    step = float(consts[last.input[1]]) if last.op_type == "DequantizeLinear" else 1.0
    _exact(model, model_zoo.random_inputs(model, 7), atol=step * 1.001, all_tiles=False)


def test_qlinear_matmul_on_tiles():
    """QLinearMatMul with per-column weight scales and zero points into a quantized output."""
    m, k, n = 40, 96, 48
    rng = np.random.default_rng(5)
    inits = [("sa", np.float32(0.03)), ("za", np.uint8(110)), ("b", rng.integers(-100, 100, (k, n)).astype(np.int8)),
             ("sb", rng.uniform(0.002, 0.01, n).astype(np.float32)), ("zb", np.zeros(n, np.int8)),
             ("sy", np.float32(0.2)), ("zy", np.uint8(128))]
    model = _model([helper.make_node("QLinearMatMul", ["a", "sa", "za", "b", "sb", "zb", "sy", "zy"], ["y"])],
                   [("a", U8, [m, k])], [("y", U8)], inits)
    _exact(model, {"a": _bytes([m, k], U8, 4)})


@pytest.mark.parametrize("case", [dict(shape=[1, 32, 20, 20], kernel=1),  # 32 bytes of k: one step, half padding
                                  dict(shape=[1, 64, 14, 14], group=8, pads=[1, 1, 1, 1])])  # runs of 8 bytes
def test_convs_that_tiles_would_mostly_pad_stay_on_vnni(case):
    """The cost rule: a GEMM whose k is under one 64-byte step, or whose products would be
    mostly zero padding on tiles (k's runs padded to 64 bytes, columns to 16), runs on VNNI.
    Exact against the reference either way."""
    case = dict(case)
    k, shape = case.pop("kernel", 3), case.pop("shape")
    w = _bytes([64, shape[1] // case.get("group", 1), k, k], I8, 1) // 2
    model = _model([helper.make_node("ConvInteger", ["x", "w"], ["y"], **case)], [("x", U8, shape)], [("y", I32)],
                   [("w", w)])
    result = build(model, target=AMX, executor="inprocess", cache=shared_cache(), progress=False)
    assert _gemms(result) and not any(g.tiles for g in _gemms(result))
    x = _bytes(shape, U8, 2)
    run_or_inspect(result, lambda: np.testing.assert_array_equal(
        result.load().run({"x": x})["y"], reference_outputs(model, {"x": x})["y"]), ["vpdpbusd"])


def test_few_rows_stay_on_vnni():
    """The cost rule: a GEMM of fewer than TILE_MIN_ROWS rows (a decoding step's one row)
    runs on VNNI, where the tile unit would stream each weight tile for one row of products;
    the rule's choice is a knob `kiln tune` may set."""
    w = _bytes([256, 64], I8, 1)
    model = _model([helper.make_node("MatMulInteger", ["a", "w"], ["y"])], [("a", U8, [TILE_MIN_ROWS - 1, 256])],
                   [("y", I32)], [("w", w)])
    result = build(model, target=AMX, executor="inprocess", cache=shared_cache(), progress=False)
    assert [g.tiles for g in _gemms(result)] == [False]
    assert any("tile_unit" in c.space for c in result.lowered.calls)
    a = _bytes([TILE_MIN_ROWS - 1, 256], U8, 2)
    run_or_inspect(result, lambda: np.testing.assert_array_equal(
        result.load().run({"a": a})["y"], (a.astype(np.int64) @ w.astype(np.int64)).astype(np.int32)), ["vpdpbusd"])


@pytest.mark.parametrize("target", [AVX512, "llvm -mattr=-amx-tile"])
def test_targets_without_amx_never_emit_tiles(target):
    """An explicit target without AMX (Cascade Lake; the host with AMX turned off) keeps its
    GEMMs on VNNI and its code holds no tile instruction."""
    model = _model([helper.make_node("MatMulInteger", ["a", "w"], ["y"])], [("a", U8, [64, 128])], [("y", I32)],
                   [("w", _bytes([128, 64], I8, 1))])
    result = build(model, target=target, executor="inprocess", cache=None, progress=False)
    assert _gemms(result) and not any(g.tiles for g in _gemms(result))
    assert "tdpb" not in kernel_assembly(result) and "ldtilecfg" not in kernel_assembly(result)


def test_bundle_for_amx_is_refused_on_a_host_without_it(monkeypatch, tmp_path):
    """Loading reads the CPU features the manifest lists: on a host without AMX (simulated
    here by taking the tile flags out of the host's) the bundle is refused, naming them."""
    model = _model([helper.make_node("MatMulInteger", ["a", "w"], ["y"])], [("a", U8, [32, 64])], [("y", I32)],
                   [("w", _bytes([64, 32], I8, 1))])
    out = build(model, target=AMX, executor="inprocess", cache=shared_cache(), progress=False).export(
        str(tmp_path / "amx"))
    flags = set(host_flags() or {"avx512f"}) - {"amx_tile", "amx_int8", "amx_bf16"}
    monkeypatch.setattr(module_mod, "missing_on_host", lambda required: sorted(set(required) - flags))
    with pytest.raises(KilnError, match="uses CPU features this machine lacks: .*amx_int8.*amx_tile"):
        module_mod.Module(out)


# ---- on real tiles -------------------------------------------------------------------------------

_PERMISSION_CHILD = r"""
import ctypes, sys
libc = ctypes.CDLL(None)
def granted():
    have = ctypes.c_ulonglong(0)
    assert libc.syscall(158, 0x1022, ctypes.byref(have)) == 0  # ARCH_GET_XCOMP_PERM
    return bool(have.value >> 18 & 1)  # XFEATURE_XTILEDATA
before = granted()
from modelkiln.artifacts.module import Module
first = Module(sys.argv[1])
second = Module(sys.argv[1])
lib = ctypes.CDLL(sys.argv[1] + "/" + first.manifest.library)
print(before, granted(), lib.kiln_tile_status())
"""


@needs_amx
def test_tile_permission_is_asked_once_per_process(tmp_path):
    """A fresh process has no tile state until the bundle's library asks for it as it loads;
    loading a second module of it finds the permission granted and asks nothing more."""
    model = _model([helper.make_node("MatMulInteger", ["a", "w"], ["y"])], [("a", U8, [32, 64])], [("y", I32)],
                   [("w", _bytes([64, 32], I8, 1))])
    out = build(model, target=AMX, executor="inprocess", cache=shared_cache(), progress=False).export(
        str(tmp_path / "amx"))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", _PERMISSION_CHILD, out], capture_output=True, text=True,
                          cwd=root, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "True", "0"]


@needs_amx
def test_tiles_on_several_threads():
    """The thread pool's workers configure their own tiles (each tile function's entry): a
    GEMM divided among 1, 2 and 4 threads gives the exact product each time."""
    a, w = _bytes([200, 384], U8, 1), _bytes([384, 160], I8, 2)
    model = _model([helper.make_node("MatMulInteger", ["a", "w"], ["y"])], [("a", U8, [200, 384])], [("y", I32)],
                   [("w", w)])
    result = build(model, target=AMX, executor="inprocess", cache=shared_cache(), progress=False)
    want = (a.astype(np.int64) @ w.astype(np.int64)).astype(np.int32)
    for threads in (1, 2, 4):
        np.testing.assert_array_equal(result.load(threads=threads).run({"a": a})["y"], want, err_msg=f"{threads}")


_REFUSING_SHIM = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <stdarg.h>
#include <dlfcn.h>
/* syscall() as libc's, except that asking for AMX's tile state (arch_prctl
   ARCH_REQ_XCOMP_PERM) is refused and asking what is granted says nothing. */
long syscall(long number, ...) {
  va_list ap; va_start(ap, number);
  long a = va_arg(ap, long), b = va_arg(ap, long), c = va_arg(ap, long);
  va_end(ap);
  if (number == 158 && a == 0x1023) { errno = EPERM; return -1; }
  if (number == 158 && a == 0x1022) { *(unsigned long long*)b = 0; return 0; }
  long (*real)(long, ...) = (long (*)(long, ...))dlsym(RTLD_NEXT, "syscall");
  return real(number, a, b, c);
}
"""

_REFUSED_CHILD = r"""
import ctypes, sys
from modelkiln.artifacts.errors import KilnError
from modelkiln.artifacts.module import Module
try:
    Module(sys.argv[1])
except KilnError as e:
    print("refused:", e)
lib = ctypes.CDLL(sys.argv[1] + "/model.so")
print("status", lib.kiln_tile_status(), "run", lib.kiln_run(None, None, None, None))
"""


@needs_amx
def test_refused_tile_state_is_a_clear_error(tmp_path):
    """Where Linux refuses the tile state (simulated by a preloaded syscall() that refuses
    it), loading names the refusal, and the C entry returns 6 without running a kernel."""
    model = _model([helper.make_node("MatMulInteger", ["a", "w"], ["y"])], [("a", U8, [32, 64])], [("y", I32)],
                   [("w", _bytes([64, 32], I8, 1))])
    out = build(model, target=AMX, executor="inprocess", cache=shared_cache(), progress=False).export(
        str(tmp_path / "amx"))
    (tmp_path / "shim.c").write_text(_REFUSING_SHIM)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(tmp_path / "shim.so"), str(tmp_path / "shim.c"), "-ldl"],
                   check=True)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", _REFUSED_CHILD, out], capture_output=True, text=True, cwd=root,
                          timeout=120, env={**os.environ, "LD_PRELOAD": str(tmp_path / "shim.so")})
    assert proc.returncode == 0, proc.stderr
    assert "runs kernels on AMX tiles and Linux refused this process the tile state" in proc.stdout
    assert "Operation not permitted" in proc.stdout
    assert "status 1 run 6" in proc.stdout  # (EPERM is 1)
