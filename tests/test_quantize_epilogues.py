"""Every anchor kind with a QuantizeLinear epilogue, against onnx's reference evaluator.

Fusion puts a QuantizeLinear after an anchor (softmax, a reduction, a normalization, a pool,
a GEMM, a conv) into the anchor's kernel, where it narrows what the kernel stores to 8 bits.
An anchor that keeps intermediate values in its output buffer would then keep them as
bytes: a Softmax's exps in (0, 1] became 0 or 1 there, and a statically quantized
transformer's attention probabilities were off by up to 113 steps. Each case here is an
anchor alone followed by QuantizeLinear to uint8 and to int8, with the scale and zero point
covering the reference's float output.

The oracle is `onnx.reference` (plain numpy arithmetic). The float anchor computes in float32
in both, in a different order, so a value whose reference lands within a hundredth of a step
of a rounding boundary may round to the neighbouring level; every other value must be equal.
"""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from modelkiln.orchestrator.api import build

F = TensorProto.FLOAT
NEAR_HALF_STEP = 0.01  # in steps of the output's scale


def _weights(shape, seed):
    return (np.random.default_rng(seed).standard_normal(shape) * 0.3).astype(np.float32)


# name -> (node op, attributes, input shape, constant inputs after x, opset)
ANCHORS = {
    "softmax": ("Softmax", {"axis": -1}, [2, 7, 33], [], 21),
    "softmax_attention": ("Softmax", {"axis": -1}, [1, 4, 64, 64], [], 21),
    "softmax_middle_axis": ("Softmax", {"axis": 1}, [2, 9, 5], [], 21),
    "log_softmax": ("LogSoftmax", {"axis": -1}, [3, 40], [], 21),
    "hardmax": ("Hardmax", {"axis": -1}, [3, 17], [], 21),
    "reduce_mean": ("ReduceMean", {"keepdims": 1}, [2, 6, 50], [np.array([-1], np.int64)], 21),
    "reduce_sum": ("ReduceSum", {"keepdims": 0}, [4, 30, 8], [np.array([1], np.int64)], 21),
    "reduce_max": ("ReduceMax", {"keepdims": 1}, [5, 21], [np.array([1], np.int64)], 21),
    "reduce_l2": ("ReduceL2", {"keepdims": 1}, [3, 4, 10], [np.array([1, 2], np.int64)], 21),
    "global_average_pool": ("GlobalAveragePool", {}, [1, 24, 7, 7], [], 21),
    "layer_norm": ("LayerNormalization", {"axis": -1}, [2, 5, 48], [_weights([48], 1), _weights([48], 2)], 21),
    "rms_norm": ("RMSNormalization", {"axis": -1}, [2, 5, 48], [_weights([48], 1)], 23),
    "instance_norm": ("InstanceNormalization", {}, [2, 6, 9, 9], [_weights([6], 1), _weights([6], 2)], 21),
    "group_norm": ("GroupNormalization", {"num_groups": 2}, [1, 8, 6, 6], [_weights([8], 1), _weights([8], 2)], 21),
    "lp_norm": ("LpNormalization", {"axis": -1, "p": 2}, [4, 33], [], 21),
    "mean_variance_norm": ("MeanVarianceNormalization", {}, [2, 3, 5, 5], [], 21),
    "max_pool": ("MaxPool", {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}, [1, 8, 15, 15], [], 21),
    "average_pool": ("AveragePool", {"kernel_shape": [2, 2], "strides": [2, 2]}, [1, 8, 14, 14], [], 21),
    "matmul": ("MatMul", {}, [3, 37, 64], [_weights([64, 48], 3)], 21),
    "matmul_one_row": ("MatMul", {}, [1, 96], [_weights([96, 80], 3)], 21),
    "gemm": ("Gemm", {"transB": 1}, [20, 64], [_weights([40, 64], 4), _weights([40], 5)], 21),
    "conv_3x3": ("Conv", {"pads": [1, 1, 1, 1]}, [1, 16, 14, 14], [_weights([24, 16, 3, 3], 6), _weights([24], 7)], 21),
    "conv_1x1": ("Conv", {}, [1, 32, 10, 10], [_weights([64, 32, 1, 1], 6)], 21),
    "conv_few_channels": ("Conv", {"pads": [1, 1, 1, 1]}, [1, 3, 20, 20], [_weights([8, 3, 3, 3], 6)], 21),
    "conv_depthwise": ("Conv", {"group": 24, "strides": [2, 2], "pads": [1, 1, 1, 1]}, [1, 24, 16, 16],
                       [_weights([24, 1, 3, 3], 6), _weights([24], 7)], 21),
    "conv_transpose": ("ConvTranspose", {"strides": [2, 2]}, [1, 8, 6, 6], [_weights([8, 12, 3, 3], 6)], 21),
    "einsum": ("Einsum", {"equation": "bij,jk->bik"}, [2, 9, 16], [_weights([16, 12], 8)], 21),
    "einsum_diagonal": ("Einsum", {"equation": "bii,ik->bik"}, [2, 9, 9], [_weights([9, 12], 8)], 21),
}
KERNEL_OP = {"einsum": "MatMul"}  # (a product of two operands is built as a MatMul: ir/ops/einsum.py)


def _anchor_model(case, out_type=None, scale=None, zero_point=None):
    """The anchor alone (out_type None: its float output), or followed by QuantizeLinear."""
    op, attrs, shape, consts, opset = ANCHORS[case]
    names = [f"c{i}" for i in range(len(consts))]
    nodes = [helper.make_node(op, ["x"] + names, ["a"], **attrs)]
    inits = [numpy_helper.from_array(c, n) for c, n in zip(consts, names)]
    out, out_elem = "a", F
    if out_type is not None:
        nodes.append(helper.make_node("QuantizeLinear", ["a", "scale", "zp"], ["y"]))
        inits += [numpy_helper.from_array(np.array(scale, np.float32), "scale"),
                  numpy_helper.from_array(np.array(zero_point, out_type), "zp")]
        out, out_elem = "y", {np.uint8: TensorProto.UINT8, np.int8: TensorProto.INT8}[out_type]
    graph = helper.make_graph(nodes, case, [helper.make_tensor_value_info("x", F, shape)],
                              [helper.make_tensor_value_info(out, out_elem, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _covering(lo: float, hi: float, out_type):
    """Scale and zero point that map [lo, hi] (which includes 0) onto the type's range."""
    info = np.iinfo(out_type)
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    scale = np.float32(max(hi - lo, 1e-6) / (info.max - info.min))
    zero_point = int(np.clip(np.round(info.min - lo / scale), info.min, info.max))
    return float(scale), zero_point


@pytest.mark.parametrize("out_type", [np.uint8, np.int8], ids=["u8", "i8"])
@pytest.mark.parametrize("case", sorted(ANCHORS))
def test_anchor_with_quantize_epilogue_matches_reference(case, out_type, executor):
    shape = ANCHORS[case][2]
    x = (np.random.default_rng(0).standard_normal(shape) * 3).astype(np.float32)
    real = ReferenceEvaluator(_anchor_model(case)).run(None, {"x": x})[0]
    scale, zero_point = _covering(float(real.min()), float(real.max()), out_type)
    model = _anchor_model(case, out_type, scale, zero_point)
    want = ReferenceEvaluator(model).run(None, {"x": x})[0]

    result = build(model, executor=executor, cache=None, progress=False)
    fused = [call.ops for call in result.lowered.calls]
    assert any("QuantizeLinear" in ops and KERNEL_OP.get(case, ANCHORS[case][0]) in ops for ops in fused), \
        f"the QuantizeLinear did not fuse into the anchor's kernel: {fused}"
    got = result.load().run({"x": x})["y"]

    assert got.dtype == want.dtype and got.shape == want.shape
    steps = np.abs(got.astype(np.int64) - want.astype(np.int64))
    ratio = real.astype(np.float64) / scale
    near_boundary = np.abs(ratio - np.floor(ratio) - 0.5) < NEAR_HALF_STEP
    assert steps.max(initial=0) <= 1 and not np.any(steps[~near_boundary]), (
        f"{int(np.count_nonzero(steps))} of {steps.size} outputs differ from the reference, "
        f"up to {int(steps.max())} steps")
