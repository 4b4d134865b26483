"""aarch64 for real: bundles for the `aarch64` preset are linked with Debian's cross toolchain
(gcc-aarch64-linux-gnu) into a complete bundle, and run here under qemu-user: docs/example_run.c,
cross-compiled against the bundle, reads raw inputs and writes raw outputs, which are compared
with references computed on this host (onnxruntime; onnx's reference evaluator for integers).

tests/install_test_deps.sh installs both tools; without them these tests fail, naming them.
"""
import json
import os
import shutil
import subprocess

import numpy as np
import pytest
from onnx import helper

from modelkiln.artifacts.link import find_linker
from modelkiln.orchestrator.api import build
from tests import model_zoo
from tests.int8_reference import reference_outputs
from tests.test_c_api import _run_from_c
from tests.test_dtypes import _small_cnn
from tests.test_quantized import I8, I32, U8, _bytes, _model

SYSROOT = "/usr/aarch64-linux-gnu"  # where Debian's cross toolchain keeps aarch64's libc


@pytest.fixture(scope="module")
def emulator() -> tuple:
    """The qemu-user launcher of aarch64 programs (and the cross compiler must be there)."""
    qemu = shutil.which("qemu-aarch64")
    assert qemu and find_linker("aarch64"), (
        "qemu-aarch64 and aarch64-linux-gnu-gcc are needed (sh tests/install_test_deps.sh installs "
        "qemu-user and gcc-aarch64-linux-gnu)")
    return (qemu, "-L", SYSROOT)


def _run_on_aarch64(model, feeds, tmp_path, emulator, executor, threads=None) -> dict:
    """Build `model` for aarch64 and run its bundle under emulation: {output name: array}."""
    from modelkiln.artifacts.element_types import numpy_dtype
    result = build(model, target="aarch64", executor=executor, cache=None, progress=False)
    bundle = result.export(str(tmp_path / "bundle"))
    outputs = _manifest(bundle)["outputs"]
    raw = _run_from_c(bundle, tmp_path, feeds, [(o["name"], numpy_dtype(o["dtype"])) for o in outputs],
                      threads=threads, cc=find_linker("aarch64"), launcher=emulator)
    return {o["name"]: raw[o["name"]].reshape(o["shape"]) for o in outputs}


def _manifest(bundle: str) -> dict:
    with open(os.path.join(bundle, "manifest.json")) as f:
        return json.load(f)


def test_an_aarch64_bundle_is_complete(tmp_path, emulator, executor):
    """A linked aarch64 library, its header and weights: what an aarch64 machine loads."""
    result = build(model_zoo.cnn(), target="aarch64", executor=executor, cache=None, progress=False)
    bundle = result.export(str(tmp_path / "arm"))
    assert {"model.so", "kiln_model.h", "weights.bin", "manifest.json"} <= set(os.listdir(bundle))
    with open(os.path.join(bundle, "model.so"), "rb") as f:
        head = f.read(20)
    assert head[:4] == b"\x7fELF" and int.from_bytes(head[18:20], "little") == 183  # EM_AARCH64
    assert _manifest(bundle)["runnable"] and "objects" not in os.listdir(bundle)
    symbols = subprocess.run(["aarch64-linux-gnu-nm", "-D", "--defined-only", os.path.join(bundle, "model.so")],
                             capture_output=True, text=True).stdout
    assert all(f" T {name}\n" in symbols for name in ("kiln_run", "kiln_run_threads", "kiln_arena_bytes"))


ANCHOR_MODELS = {
    "cnn": lambda: model_zoo.cnn(),
    "mlp": lambda: model_zoo.mlp(4),
    "resnet18": lambda: model_zoo.resnet18(size=64),
    "mobilenet_v2": lambda: model_zoo.mobilenet_v2(size=64),
    "transformer_encoder": lambda: model_zoo.transformer_encoder(seq=16, d=64, heads=4, ffn=128),
    "unet": lambda: model_zoo.unet(size=32),
}


@pytest.mark.parametrize("name", sorted(ANCHOR_MODELS))
def test_anchor_models_match_onnxruntime_under_emulation(name, tmp_path, emulator, executor):
    model = ANCHOR_MODELS[name]()
    feeds = model_zoo.random_inputs(model, 5)
    got = _run_on_aarch64(model, feeds, tmp_path, emulator, executor, threads=2)
    want = model_zoo.onnxruntime_outputs(model, feeds)
    assert got.keys() == want.keys()
    for out in want:
        np.testing.assert_allclose(got[out], want[out], rtol=1e-3, atol=1e-4, err_msg=out)


def test_lstm_matches_onnxruntime_under_emulation(tmp_path, emulator, executor):
    model, feeds = model_zoo.recurrent_model("LSTM", seq=6, batch=2, width=5, hidden=7)
    got = _run_on_aarch64(model, feeds, tmp_path, emulator, executor)
    want = model_zoo.onnxruntime_outputs(model, feeds)
    for out in want:
        np.testing.assert_allclose(got[out], want[out], rtol=1e-3, atol=1e-4, err_msg=out)


def test_int8_kernels_are_exact_under_emulation(tmp_path, emulator, executor):
    """MatMulInteger, channels-last (one group and two), pointwise and depthwise ConvInteger,
    and a requantizing QLinearConv on aarch64's 4-lane kernels: exact against onnx's
    reference evaluator."""
    nodes = [helper.make_node("MatMulInteger", ["a", "w", "za"], ["m"]),
             helper.make_node("ConvInteger", ["x", "k3", "zx"], ["c3"], pads=[1, 1, 1, 1]),
             helper.make_node("ConvInteger", ["x", "k1", "zx"], ["c1"]),
             helper.make_node("ConvInteger", ["x", "kg", "zx"], ["cg"], group=2, pads=[0, 1, 1, 0]),
             helper.make_node("ConvInteger", ["x", "kd", "zx"], ["dw"], group=8, strides=[2, 2], pads=[1, 1, 1, 1]),
             helper.make_node("QLinearConv", ["xu", "sx", "zu", "k3", "sw", "zw", "sy", "zy"], ["q"], pads=[1, 1, 1, 1])]
    inits = [("w", _bytes([36, 20], I8, 1)), ("za", np.array(3, np.uint8)), ("k3", _bytes([6, 8, 3, 3], I8, 2)),
             ("k1", _bytes([6, 8, 1, 1], I8, 3)), ("kg", _bytes([6, 4, 3, 3], I8, 7)),
             ("kd", _bytes([8, 1, 3, 3], I8, 4)), ("zx", np.array(-5, np.int8)),
             ("sx", np.float32(0.02)), ("zu", np.uint8(128)), ("sw", np.float32(0.01)), ("zw", np.int8(0)),
             ("sy", np.float32(0.3)), ("zy", np.uint8(120))]
    model = _model(nodes, [("a", U8, [7, 36]), ("x", I8, [1, 8, 9, 10]), ("xu", U8, [1, 8, 9, 10])],
                   [("m", I32), ("c3", I32), ("c1", I32), ("cg", I32), ("dw", I32), ("q", U8)], inits)
    feeds = {"a": _bytes([7, 36], U8, 4), "x": _bytes([1, 8, 9, 10], I8, 5), "xu": _bytes([1, 8, 9, 10], U8, 6)}
    got = _run_on_aarch64(model, feeds, tmp_path, emulator, executor)
    want = reference_outputs(model, feeds)
    for out in want:
        np.testing.assert_array_equal(got[out], want[out], err_msg=out)


def test_quantized_cnn_matches_the_reference_under_emulation(tmp_path, emulator, executor):
    """A CNN quantized by onnxruntime's tool (QDQ): within one step of the output's scale of
    the reference, which runs the convs in float on dequantized values (Kiln: exact int32)."""
    model = model_zoo.quantized(model_zoo.residual_cnn(), "qdq")
    feeds = model_zoo.random_inputs(model, 7)
    got = _run_on_aarch64(model, feeds, tmp_path, emulator, executor)
    want = reference_outputs(model, feeds)
    from tests.test_quantized import _output_step
    for out in want:
        np.testing.assert_allclose(got[out], want[out], rtol=0, atol=_output_step(model) * 1.001, err_msg=out)


@pytest.mark.parametrize("half_io", [True, False], ids=["fp16-io", "fp32-io"])
def test_float16_model_matches_onnxruntime_under_emulation(half_io, tmp_path, emulator, executor):
    model = _small_cnn(half_io)
    x = np.random.default_rng(12).standard_normal((2, 3, 16, 16)).astype(np.float16 if half_io else np.float32)
    got = _run_on_aarch64(model, {"x": x}, tmp_path, emulator, executor)["y"]
    want = model_zoo.onnxruntime_outputs(model, {"x": x})["y"]
    assert got.dtype == want.dtype
    # onnxruntime rounds to float16 after every op, Kiln once per fused kernel: a few ulps.
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=1e-2, atol=2e-3)


@pytest.mark.parametrize("rows", [1, 6], ids=["decoding-rows", "prompt-rows"])
def test_int4_matmul_nbits_matches_onnxruntime_under_emulation(rows, tmp_path, emulator, executor):
    """MatMulNBits on its 4-bit codes with NEON's panels (2 vectors of 4 columns): a decoding
    step's rows and a prompt's, the bias fused."""
    from tests.test_matmul_nbits import _nbits_model
    model = _nbits_model(128, 40, 4, 32, "packed", True, a_shape=(rows,))
    x = np.random.default_rng(15).standard_normal((rows, 128)).astype(np.float32)
    got = _run_on_aarch64(model, {"x": x}, tmp_path, emulator, executor)["y"]
    np.testing.assert_allclose(got, model_zoo.onnxruntime_outputs(model, {"x": x})["y"], rtol=1e-5, atol=1e-4)


def test_without_a_cross_compiler_the_bundle_holds_objects(tmp_path, executor, monkeypatch):
    """No linker for the target's architecture: the bundle keeps the objects, and loading it
    says why it cannot run."""
    from modelkiln.artifacts import load
    from modelkiln.ir.errors import KilnError
    from modelkiln.orchestrator import bundle
    monkeypatch.setattr(bundle, "find_linker", lambda arch: None)
    result = build(model_zoo.cnn(), target="aarch64", executor=executor, cache=None, progress=False)
    path = result.export(str(tmp_path / "arm"))
    objects = os.listdir(os.path.join(path, "objects"))
    assert "model.so" not in os.listdir(path) and objects
    with open(os.path.join(path, "objects", objects[0]), "rb") as f:
        head = f.read(20)
    assert head[:4] == b"\x7fELF" and int.from_bytes(head[18:20], "little") == 183  # EM_AARCH64
    with pytest.raises(KilnError, match="holds objects only"):
        load(path)
