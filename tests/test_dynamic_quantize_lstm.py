"""onnxruntime's com.microsoft.DynamicQuantizeLSTM, as `quantize_dynamic` writes it for every
LSTM, against onnxruntime and against the reference of tests/int8_reference.py (which follows
onnxruntime's kernel: X and each step's h_prev quantized to uint8 at run time).

onnxruntime runs on one thread here: with more, its kernel splits the batch rows among
threads and quantizes each share of h_prev with its own range. It is an oracle only where
its int8 sums are exact (`onnxruntime_int8_is_exact`): without VNNI its u8 x s8 kernel
saturates 16-bit pair sums.

The tolerance is float rounding: the gates' float arithmetic (activations, the order of the
bias and scale products) differs by an ulp or so between the three, and only where such an
ulp moves a quantized h_prev across a rounding boundary does it grow to a quantization step.
Each test also checks that the float LSTM, with the same 8-bit weights but no activation
quantization, is much further from the oracle: the quantization is what is being compared.
"""
import re

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from modelkiln.ir.errors import KilnError
from modelkiln.orchestrator.api import build
from tests import model_zoo
from tests.int8_reference import onnxruntime_int8_is_exact, reference_outputs
from tests.conftest import shared_cache

ATOL = 2e-5
FLOAT_LSTM_IS_FURTHER = 10  # times the largest difference Kiln has


def _oracles(model, feeds):
    oracles = [("reference", reference_outputs(model, feeds))]
    if onnxruntime_int8_is_exact():
        oracles.append(("onnxruntime", model_zoo.onnxruntime_outputs(model, feeds)))
    return oracles


def _dequantized_lstm(model: onnx.ModelProto) -> onnx.ModelProto:
    """The float LSTM the quantized one stands for: its 8-bit weights dequantized, no
    activation quantization."""
    consts = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    nodes, inits = [], list(model.graph.initializer)
    for index, n in enumerate(model.graph.node):
        if n.op_type != "DynamicQuantizeLSTM":
            nodes.append(n)
            continue
        ins = list(n.input) + [""] * (12 - len(n.input))
        for k, (q, s, z) in enumerate(((1, 8, 9), (2, 10, 11))):
            dirs = consts[ins[q]].shape[0]
            scale, zero = (consts[ins[i]].reshape(dirs, 1, -1).astype(np.float32) for i in (s, z))
            value = ((consts[ins[q]].astype(np.float32) - zero) * scale).transpose(0, 2, 1)
            ins[q] = f"lstm{index}_float{k}"
            inits.append(numpy_helper.from_array(np.ascontiguousarray(value), ins[q]))
        nodes.append(helper.make_node("LSTM", ins[:8], list(n.output), name=n.name,
                                      **{a.name: helper.get_attribute_value(a) for a in n.attribute}))
    graph = helper.make_graph(nodes, "float", list(model.graph.input), list(model.graph.output), inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)], ir_version=8)


def _compare(model, feeds, float_check=True):
    got = build(model, executor="inprocess", cache=shared_cache(), progress=False).load().run(feeds)
    worst = 0.0
    for oracle, want in _oracles(model, feeds):
        for name in want:
            assert got[name].shape == want[name].shape, f"{name}: {got[name].shape} vs {oracle} {want[name].shape}"
            np.testing.assert_allclose(got[name], want[name], rtol=0, atol=ATOL, err_msg=f"{name} against {oracle}")
            worst = max(worst, float(np.abs(got[name] - want[name]).max()))
    if float_check:
        float_out = model_zoo.onnxruntime_outputs(_dequantized_lstm(model), feeds)
        want = _oracles(model, feeds)[0][1]
        float_error = max(float(np.abs(float_out[n] - want[n]).max()) for n in want)
        assert float_error > FLOAT_LSTM_IS_FURTHER * max(worst, 1e-7), (float_error, worst)
    return got


def _quantize_dynamic(model, per_channel):
    return model_zoo.quantized(model, "dynamic", per_channel=per_channel)


@pytest.mark.parametrize("dirs,attrs", [(1, {}), (1, {"direction": "reverse"}), (2, {})])
@pytest.mark.parametrize("lens,init,peepholes", [(False, False, False), (True, True, True)])
@pytest.mark.parametrize("per_channel", [False, True])
def test_quantize_dynamic_lstm(dirs, attrs, lens, init, peepholes, per_channel):
    """What the tool writes for an LSTM (int8 weights, per tensor or per column), with
    sequence lengths, initial states and peepholes."""
    float_model, feeds = model_zoo.recurrent_model("LSTM", seq=6, batch=3, width=10, hidden=12, dirs=dirs, lens=lens,
                                                   init=init, peepholes=peepholes, **attrs)
    model = _quantize_dynamic(float_model, per_channel)
    assert "DynamicQuantizeLSTM" in {n.op_type for n in model.graph.node}
    _compare(model, feeds)


def test_stacked_layers_and_odd_hidden_size():
    """Two layers (the second one's X is the first one's Y, quantized again), batch first,
    a hidden size that is no multiple of the product's unroll."""
    float_model, feeds = model_zoo.recurrent_model("LSTM", seq=7, batch=2, width=5, hidden=7, dirs=2, layers=2,
                                                   lens=False, init=False, seed=3)
    _compare(_quantize_dynamic(float_model, True), feeds)


def test_steps_past_the_longest_sequence():
    """onnxruntime quantizes X only up to the longest sequence: the larger steps after it
    must not widen X's range."""
    float_model, feeds = model_zoo.recurrent_model("LSTM", seq=6, batch=3, width=8, hidden=8, dirs=2, lens=True,
                                                   init=False, seed=5)
    feeds["lens"] = np.array([3, 4, 2], np.int32)
    feeds["x"][4:] *= 10
    _compare(_quantize_dynamic(float_model, False), feeds)


def test_a_recognizer_head():
    """An OCR-style tail as the tool quantizes it whole: an LSTM over feature columns, then a
    MatMul classifier (DynamicQuantizeLinear + MatMulInteger) and a Softmax."""
    rng = np.random.default_rng(11)
    seq, batch, width, hidden, classes = 8, 1, 16, 16, 12
    w, r = (rng.standard_normal((2, 4 * hidden, k)).astype(np.float32) * 0.3 for k in (width, hidden))
    head = rng.standard_normal((2 * hidden, classes)).astype(np.float32) * 0.3
    nodes = [helper.make_node("LSTM", ["x", "W", "R"], ["y"], hidden_size=hidden, direction="bidirectional"),
             helper.make_node("Transpose", ["y"], ["t"], perm=[0, 2, 1, 3]),
             helper.make_node("Reshape", ["t", "shape"], ["features"]),
             helper.make_node("MatMul", ["features", "head"], ["logits"]),
             helper.make_node("Softmax", ["logits"], ["probs"], axis=-1)]
    graph = helper.make_graph(nodes, "ocr", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [seq, batch, width])],
                              [helper.make_tensor_value_info("probs", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(v, k) for k, v in
                               {"W": w, "R": r, "head": head, "shape": np.array([seq, batch, 2 * hidden])}.items()])
    model = _quantize_dynamic(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), True)
    assert {"DynamicQuantizeLSTM", "MatMulInteger"} <= {n.op_type for n in model.graph.node}
    feeds = {"x": rng.standard_normal((seq, batch, width)).astype(np.float32)}
    _compare(model, feeds, float_check=False)


def _lstm_node_model(w, r, w_scale, w_zero, r_scale, r_zero, seq, batch, **attrs):
    dirs, width, gh = w.shape
    inits = {"W": w, "R": r, "ws": w_scale, "wz": w_zero, "rs": r_scale, "rz": r_zero}
    node = helper.make_node("DynamicQuantizeLSTM", ["x", "W", "R", "", "", "", "", "", "ws", "wz", "rs", "rz"],
                            ["y", "y_h", "y_c"], domain="com.microsoft", hidden_size=gh // 4, **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [seq, batch, width])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "y_h", "y_c")],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                             ir_version=8)


def _uint8_model(seq=5, batch=2, width=9, hidden=8, dirs=2, **attrs):
    """uint8 weights with a zero point of 128 (onnxruntime takes one zero point per direction
    for uint8), a scale per direction."""
    rng = np.random.default_rng(7)
    w = rng.integers(0, 256, (dirs, width, 4 * hidden)).astype(np.uint8)
    r = rng.integers(0, 256, (dirs, hidden, 4 * hidden)).astype(np.uint8)
    zero = np.full(dirs, 128, np.uint8)
    model = _lstm_node_model(w, r, np.array([0.004, 0.003][:dirs], np.float32), zero,
                             np.array([0.005, 0.002][:dirs], np.float32), zero, seq, batch,
                             direction="bidirectional" if dirs == 2 else "forward", **attrs)
    return model, {"x": rng.standard_normal((seq, batch, width)).astype(np.float32)}


def test_uint8_weights_with_a_zero_point_and_clip():
    model, feeds = _uint8_model(clip=0.6)
    _compare(model, feeds)


def test_input_of_zeros():
    """An empty range: onnxruntime takes a scale of 1 (onnx's DynamicQuantizeLinear would
    divide by zero). Every h_prev of the first step is such a range too."""
    model, feeds = _uint8_model()
    got = _compare(model, {"x": np.zeros_like(feeds["x"])}, float_check=False)
    assert np.isfinite(got["y"]).all()


@pytest.mark.parametrize("what,change,message", [
    ("W", lambda i: i.update(W=i["W"].astype(np.float32)), "W is float32, not int8 or uint8"),
    ("W_scale", lambda i: i.update(ws=np.ones((2, 3), np.float32)), "W_scale is [2, 3], expected [2] (per direction)"),
    ("R", lambda i: i.update(R=i["R"][:, :5]), "hidden_size=8 but R is [2, 5, 32]"),
])
def test_bad_weights_are_named(what, change, message):
    model, feeds = _uint8_model()
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    change(inits)
    del model.graph.initializer[:]
    model.graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in inits.items())
    with pytest.raises(KilnError, match=re.escape(message)):
        build(model, executor="inprocess", cache=None, progress=False)
