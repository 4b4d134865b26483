"""DFT, STFT and MelWeightMatrix against onnxruntime and numpy's FFT: real and complex
signals, forward and inverse, one-sided spectra and their real inverse, a dft_length that
pads or cuts, the axis as an attribute (opset 17) and as an input (opset 20), and a log-mel
front end as an audio model computes it in its graph (STFT with a Hann window, power,
mel filters, log)."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from modelkiln.orchestrator.api import build
from tests import model_zoo
from tests.conftest import shared_cache

H = helper


def _model(nodes, inputs, outputs, inits=(), opset=17):
    graph = H.make_graph(nodes, "g", [H.make_tensor_value_info(n, t, s) for n, t, s in inputs],
                         [H.make_tensor_value_info(n, t, None) for n, t in outputs], list(inits))
    return H.make_model(graph, opset_imports=[H.make_opsetid("", opset)], ir_version=9)


def _int(name, value):
    return numpy_helper.from_array(np.array(value, np.int64), name)


@pytest.mark.parametrize("parts,inverse,onesided,length", [
    (1, 0, 0, None), (1, 0, 1, None), (2, 0, 0, None), (2, 0, 0, 40), (1, 0, 1, 24),
    (2, 1, 0, None), (2, 1, 1, None), (2, 1, 1, 30)])
def test_dft_against_numpy(parts, inverse, onesided, length, executor):
    """A signal [3, 32, parts] along axis 1: numpy's fft, ifft and irfft are the definition."""
    inits = [_int("n", length)] if length else []
    node = H.make_node("DFT", ["x"] + (["n"] if length else []), ["y"], axis=1, inverse=inverse, onesided=onesided)
    rows = 17 if inverse and onesided else 32  # (an inverse of a one-sided spectrum reads its bins)
    model = _model([node], [("x", TensorProto.FLOAT, [3, rows, parts])], [("y", TensorProto.FLOAT)], inits)
    x = np.random.default_rng(parts + 2 * inverse).standard_normal((3, rows, parts)).astype(np.float32)
    got = build(model, executor=executor, cache=shared_cache(), progress=False).load().run({"x": x})["y"]
    signal = x[..., 0] + 1j * x[..., 1] if parts == 2 else x[..., 0]
    n = length or (2 * (rows - 1) if inverse and onesided else rows)
    if inverse and onesided:
        want = np.fft.irfft(signal, n=n, axis=1)[..., None]
    else:
        spectrum = (np.fft.ifft if inverse else np.fft.fft)(signal, n=n, axis=1)
        spectrum = spectrum[:, :n // 2 + 1] if onesided else spectrum
        want = np.stack([spectrum.real, spectrum.imag], -1)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_dft_of_opset_20_along_another_axis(executor):
    nodes = [H.make_node("DFT", ["x", "", "axis"], ["y"], onesided=1)]
    model = _model(nodes, [("x", TensorProto.FLOAT, [20, 4, 1])], [("y", TensorProto.FLOAT)], [_int("axis", 0)],
                   opset=20)
    x = np.random.default_rng(5).standard_normal((20, 4, 1)).astype(np.float32)
    got = build(model, executor=executor, cache=shared_cache(), progress=False).load().run({"x": x})["y"]
    spectrum = np.fft.rfft(x[..., 0], axis=0)
    np.testing.assert_allclose(got, np.stack([spectrum.real, spectrum.imag], -1), rtol=1e-4, atol=1e-4)


def test_a_log_mel_front_end_against_onnxruntime(executor):
    """Whisper's front end in the graph: STFT (400-sample Hann frames every 160, one-sided),
    power, 80 mel filters from MelWeightMatrix, log: [batch, frames, 80]."""
    window = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(400) / 400)).astype(np.float32)
    inits = [_int("step", 160), numpy_helper.from_array(window, "window"), _int("frame", 400), _int("bins", 80),
             _int("n_fft", 400), _int("rate", 16000), numpy_helper.from_array(np.array(0.0, np.float32), "low"),
             numpy_helper.from_array(np.array(8000.0, np.float32), "high"),
             numpy_helper.from_array(np.array(1e-10, np.float32), "eps"),
             numpy_helper.from_array(np.array([3], np.int64), "parts")]
    nodes = [H.make_node("STFT", ["audio", "step", "window", "frame"], ["spectrum"], onesided=1),
             H.make_node("Mul", ["spectrum", "spectrum"], ["squares"]),
             H.make_node("ReduceSum", ["squares", "parts"], ["power"], keepdims=0),  # ([batch, frames, bins])
             H.make_node("MelWeightMatrix", ["bins", "n_fft", "rate", "low", "high"], ["filters"]),
             H.make_node("MatMul", ["power", "filters"], ["mel"]),
             H.make_node("Add", ["mel", "eps"], ["floored"]), H.make_node("Log", ["floored"], ["log_mel"])]
    model = _model(nodes, [("audio", TensorProto.FLOAT, [2, 4000, 1])], [("log_mel", TensorProto.FLOAT)], inits)
    module = build(model, executor=executor, cache=shared_cache(), progress=False).load()
    audio = (np.random.default_rng(6).standard_normal((2, 4000, 1)) * 0.1).astype(np.float32)
    got = module.run({"audio": audio})["log_mel"]
    want = model_zoo.onnxruntime_outputs(model, {"audio": audio})["log_mel"]
    assert got.shape == want.shape == (2, 1 + (4000 - 400) // 160, 80)
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=2e-3)
