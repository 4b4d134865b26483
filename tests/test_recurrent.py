"""LSTM, GRU and RNN against onnxruntime: directions, two stacked layers, sequence_lens,
initial states, clip, peepholes, input_forget, linear_before_reset, activations, layout."""
import numpy as np
import pytest
from onnx import TensorProto, helper

from modelkiln.ir.errors import KilnError
from modelkiln.orchestrator.api import build
from tests import model_zoo
from tests.model_zoo import recurrent_model
from tests.conftest import shared_cache

F = TensorProto.FLOAT
TOL = dict(rtol=1e-5, atol=1e-5)


def _compare(model, feeds):
    got = build(model, executor="inprocess", cache=shared_cache(), progress=False).load().run(feeds)
    want = model_zoo.onnxruntime_outputs(model, feeds)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], err_msg=name, **TOL)
    return got


@pytest.mark.parametrize("cell", ["LSTM", "GRU"])
def test_two_bidirectional_layers_with_sequence_lens(cell):
    """The issue's case: bidirectional, two layers, sequence_lens and initial states."""
    model, feeds = recurrent_model(cell, layers=2)
    got = _compare(model, feeds)
    short = int(np.argmin(feeds["lens"]))
    assert not got["y1"][feeds["lens"][short]:, :, short].any()  # past a row's length: zeros


@pytest.mark.parametrize("cell", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("variant", [dict(), dict(dirs=1, direction="reverse", clip=0.5),
                                     dict(dirs=1, lens=False, init=False), dict(batch=1, seq=12, hidden=16)])
def test_cells(cell, variant):
    _compare(*recurrent_model(cell, **variant))


def test_plain_rnn_with_activations():
    _compare(*recurrent_model("RNN", activations=["Relu", "LeakyRelu"], activation_alpha=[0.2]))
    _compare(*recurrent_model("RNN", dirs=1, activations=["ScaledTanh"], activation_alpha=[0.7],
                              activation_beta=[1.3]))


def test_lstm_peepholes_and_input_forget():
    _compare(*recurrent_model("LSTM", peepholes=True, input_forget=1))


def test_lstm_activations():
    _compare(*recurrent_model("LSTM", dirs=1, activations=["HardSigmoid", "Softsign", "Elu"],
                              activation_alpha=[0.3, 0.9], activation_beta=[0.4]))


def test_gru_linear_before_reset():
    _compare(*recurrent_model("GRU", linear_before_reset=1))


@pytest.mark.parametrize("cell", ["LSTM", "GRU", "RNN"])
def test_batch_first_layout(cell):
    """layout=1 ([batch, seq, ...]): onnxruntime refuses it, so the oracle is the same
    weights at layout 0, with the inputs and outputs transposed in numpy."""
    model1, _ = recurrent_model(cell, layout=1, lens=False)
    model0, feeds0 = recurrent_model(cell, layout=0, lens=False)
    want = model_zoo.onnxruntime_outputs(model0, feeds0)
    feeds1 = {k: v.transpose(1, 0, 2) for k, v in feeds0.items()}
    got = build(model1, executor="inprocess", cache=shared_cache(), progress=False).load().run(feeds1)
    np.testing.assert_allclose(got["y0"], want["y0"].transpose(2, 0, 1, 3), **TOL)
    np.testing.assert_allclose(got["yh0"], want["yh0"].transpose(1, 0, 2), **TOL)


def test_one_gemm_for_the_input_projection_and_one_kernel_for_the_steps():
    model, _ = recurrent_model("LSTM", layers=1)
    ops = [c.ops for c in build(model, executor="inprocess", cache=None, progress=False).lowered.calls]
    assert ops == [["MatMul", "Add"], ["kiln.Recurrence"]]


def test_weights_computed_at_run_time_are_refused_by_name():
    model, feeds = recurrent_model("GRU", dirs=1, lens=False, init=False)
    model.graph.input.append(helper.make_tensor_value_info("R0", F, [1, 24, 8]))
    del model.graph.initializer[1]
    with pytest.raises(KilnError, match="GRU.*input 'R0' \\(R\\) must be known at compile time"):
        build(model, executor="inprocess", cache=None, progress=False)
