"""A weight that several kernels read is packed once (an ALBERT's layers share theirs, a
detector head runs one conv over every scale): one packed constant per way of packing it,
and each kernel's outputs match onnxruntime's. (Winograd's filters: tests/test_winograd.py.)"""
import re

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from modelkiln.orchestrator.api import build
from tests.model_zoo import onnxruntime_outputs


def _model(nodes, inputs, outputs, inits):
    graph = helper.make_graph(nodes, "shared", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s)
                                                for n, s in inputs],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _packed(result) -> list:
    return sorted(n for n in result.lowered.constants if re.fullmatch(r".+_packed_\d+", n))


def _matches(model, result, feeds):
    want, got = onnxruntime_outputs(model, feeds), result.load().run(feeds)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-4 * float(np.abs(value).max()))


def test_a_weight_two_matmuls_share_is_packed_once(executor):
    """Two MatMuls of one weight (kernels of their own: their rows differ) read one packed
    copy; a Gemm reading it transposed packs it another way, once."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((64, 96)).astype(np.float32), "w")
    wt = numpy_helper.from_array(rng.standard_normal((96, 64)).astype(np.float32), "wt")
    nodes = [helper.make_node("MatMul", ["a", "w"], ["ya"]), helper.make_node("MatMul", ["b", "w"], ["yb"]),
             helper.make_node("Gemm", ["c", "wt"], ["yc"], transB=1), helper.make_node("MatMul", ["d", "wt"], ["yd"])]
    model = _model(nodes, [("a", [1, 5, 64]), ("b", [3, 64]), ("c", [4, 64]), ("d", [2, 96])],
                   ["ya", "yb", "yc", "yd"], [w, wt])
    result = build(model, executor=executor, cache=None, progress=False)
    assert len(result.lowered.calls) == 4
    assert [n.rsplit("_", 1)[0] for n in _packed(result)] == ["w_packed", "wt_packed", "wt_packed"]
    _matches(model, result, {"a": rng.standard_normal((1, 5, 64)).astype(np.float32),
                             "b": rng.standard_normal((3, 64)).astype(np.float32),
                             "c": rng.standard_normal((4, 64)).astype(np.float32),
                             "d": rng.standard_normal((2, 96)).astype(np.float32)})


def test_a_conv_weight_at_two_scales_is_packed_once(executor):
    """One 3x3 stride-2 conv weight (a path that packs it in panels: the implicit GEMM) over
    two feature maps of different sizes: two kernels, one packed weight."""
    rng = np.random.default_rng(1)
    w = numpy_helper.from_array(rng.standard_normal((48, 32, 3, 3)).astype(np.float32) / 12, "w")
    nodes = [helper.make_node("Conv", [x, "w"], [y], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
             for x, y in (("p3", "y3"), ("p4", "y4"))]
    model = _model(nodes, [("p3", [1, 32, 40, 40]), ("p4", [1, 32, 20, 20])], ["y3", "y4"], [w])
    result = build(model, executor=executor, cache=None, progress=False)
    assert len(result.lowered.calls) == 2
    packed = _packed(result)
    assert len(packed) == 1 and packed[0].startswith("w_packed"), packed
    assert all(packed[0] in c.inputs for c in result.lowered.calls)
    _matches(model, result, {"p3": rng.standard_normal((1, 32, 40, 40)).astype(np.float32),
                             "p4": rng.standard_normal((1, 32, 20, 20)).astype(np.float32)})
