"""The 4- and 2-bit integer element types (int4, uint4, int2, uint2) as inputs, constants,
intermediates and outputs, through Cast, QuantizeLinear and DequantizeLinear. The oracle is
onnx's reference evaluator (whose casts are ml_dtypes', as ONNX specifies them); a module's
arrays of these types are ml_dtypes' (one element a byte, the value in its low bits)."""
import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from modelkiln.orchestrator.api import build
from tests.cast_definition import defined, kiln_casts
from tests.conftest import shared_cache

SUB_BYTE = {"int4": TensorProto.INT4, "uint4": TensorProto.UINT4, "int2": TensorProto.INT2, "uint2": TensorProto.UINT2}
OTHER = {"float32": TensorProto.FLOAT, "int32": TensorProto.INT32, "int8": TensorProto.INT8, "uint8": TensorProto.UINT8}


def _model(nodes, inputs, outputs, inits=(), opset=25):
    types = {**SUB_BYTE, **OTHER}
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, types[t], s) for n, t, s in inputs],
                              [helper.make_tensor_value_info(n, types[t], None) for n, t in outputs], list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=11)


def _check(model, feeds, executor, extra_outputs=()):
    """The module's outputs equal the reference evaluator's: values, dtypes and bytes. The
    reference runs the model without `extra_outputs` (the caller checks those)."""
    got = build(model, executor=executor, cache=shared_cache(), progress=False).load().run(feeds)
    reference = model.__class__()
    reference.CopyFrom(model)
    kept = [o for o in model.graph.output if o.name not in extra_outputs]
    del reference.graph.output[:]
    reference.graph.output.extend(kept)
    nodes = [n for n in model.graph.node if not set(n.output) <= set(extra_outputs)]
    del reference.graph.node[:]
    reference.graph.node.extend(nodes)
    names = [o.name for o in kept]
    for name, want in zip(names, ReferenceEvaluator(reference).run(None, feeds)):
        assert got[name].dtype == want.dtype, name
        np.testing.assert_array_equal(got[name].astype(np.float64), want.astype(np.float64), err_msg=name)
        if want.dtype.itemsize == 1:  # the high bits clear, as ml_dtypes keeps them
            np.testing.assert_array_equal(got[name].view(np.uint8), want.view(np.uint8), err_msg=name)
    return got


@pytest.mark.parametrize("dtype", SUB_BYTE)
def test_casts_wrap_at_the_width(dtype, executor):
    """int32 to the type (its low bits: Cast's definition) and float32 to it (out of the type's
    range undefined in ONNX: Kiln's own answer, truncated and then its low bits), and back in
    the same kernel, so the value wraps before it is stored as well as when it is; and to the
    type of the other signedness."""
    rng = np.random.default_rng(4)
    x = np.round(rng.uniform(-40, 40, (5, 13)) * 4).astype(np.float32) / 4  # fractions of both signs
    i = rng.integers(-300, 300, (5, 13), dtype=np.int32)
    other = dtype[1:] if dtype.startswith("u") else "u" + dtype
    to = SUB_BYTE[dtype]
    nodes = [helper.make_node("Cast", ["x"], ["q"], to=to),
             helper.make_node("Cast", ["q"], ["back"], to=TensorProto.FLOAT),
             helper.make_node("Cast", ["i"], ["qi"], to=to),
             helper.make_node("Cast", ["qi"], ["wide"], to=TensorProto.INT32),
             helper.make_node("Cast", ["q"], ["flipped"], to=SUB_BYTE[other])]
    model = _model(nodes, [("x", "float32", [5, 13]), ("i", "int32", [5, 13])],
                   [("q", dtype), ("back", "float32"), ("wide", "int32"), ("flipped", other)])
    got = _check(model, {"x": x, "i": i}, executor, extra_outputs=["flipped", "q", "back"])
    assert got["q"].dtype == np.dtype(getattr(ml_dtypes, dtype))
    assert [int(v) for v in got["q"].astype(np.int64).ravel()] == kiln_casts(x, dtype)
    in_range = defined(x, dtype)
    cast_alone = _model(nodes[:1], [("x", "float32", [5, 13])], [("q", dtype)])
    want = ReferenceEvaluator(cast_alone).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got["q"][in_range].astype(np.int64), want[in_range].astype(np.int64))
    np.testing.assert_array_equal(got["back"], got["q"].astype(np.float32))
    # (ml_dtypes casts between these types only through a wider integer)
    np.testing.assert_array_equal(got["flipped"], got["q"].astype(np.int32).astype(getattr(ml_dtypes, other)))
    assert len(np.unique(got["back"])) == 1 << int(dtype[-1])  # every value of the type occurs: wraps happened


def test_inputs_and_constants_through_layout_ops(executor):
    """An int4 input transposed, concatenated with an int4 constant (onnx packs two to a
    byte; Kiln holds one a byte), reshaped, and also widened to int8; a uint2 input sliced."""
    rng = np.random.default_rng(5)
    x = rng.integers(-8, 8, (4, 6)).astype(ml_dtypes.int4)
    k = numpy_helper.from_array(rng.integers(-8, 8, (6, 3)).astype(ml_dtypes.int4), "k")
    u = rng.integers(0, 4, (2, 9)).astype(ml_dtypes.uint2)
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0]),
             helper.make_node("Concat", ["t", "k"], ["c"], axis=1),
             helper.make_node("Reshape", ["c", "shape"], ["y"]),
             helper.make_node("Cast", ["c"], ["w"], to=TensorProto.INT8),
             helper.make_node("Slice", ["u", "starts", "ends", "axes"], ["s"])]
    inits = [k, numpy_helper.from_array(np.array([3, 14], np.int64), "shape"),
             numpy_helper.from_array(np.array([2], np.int64), "starts"),
             numpy_helper.from_array(np.array([7], np.int64), "ends"),
             numpy_helper.from_array(np.array([1], np.int64), "axes")]
    model = _model(nodes, [("x", "int4", [4, 6]), ("u", "uint2", [2, 9])],
                   [("y", "int4"), ("w", "int8"), ("s", "uint2")], inits)
    _check(model, {"x": x, "u": u}, executor)


@pytest.mark.parametrize("dtype", SUB_BYTE)
def test_block_quantize_and_dequantize(dtype, executor):
    """QuantizeLinear to the type with a scale and zero point per block of 4 along axis 1
    (values past the type's range saturate), and DequantizeLinear of the result."""
    rng = np.random.default_rng(6)
    x = (rng.standard_normal((3, 16)) * 6).astype(np.float32)
    scale = rng.uniform(0.5, 2.0, (3, 4)).astype(np.float32)
    dt = getattr(ml_dtypes, dtype)
    info = ml_dtypes.iinfo(dt)
    zp = rng.integers(info.min, info.max + 1, (3, 4)).astype(dt)
    inits = [numpy_helper.from_array(scale, "s"), numpy_helper.from_array(zp, "z")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], axis=1, block_size=4),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"], axis=1, block_size=4)]
    model = _model(nodes, [("x", "float32", [3, 16])], [("q", dtype), ("d", "float32")], inits)
    got = _check(model, {"x": x}, executor)
    q = got["q"].astype(np.int32)
    assert q.min() == info.min and q.max() == info.max  # saturated at both ends
