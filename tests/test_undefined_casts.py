"""A float cast to an integer type out of that type's range is undefined in ONNX; Kiln gives
its own documented answer (ir/casts.py), in kernels and in constant folding alike. Each
element ONNX defines is judged by onnx's reference evaluator; every element, by that
definition written out in tests/cast_definition.py."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from modelkiln.ir.dtypes import DTYPES
from modelkiln.orchestrator.api import build
from tests.cast_definition import INTEGER_TYPES, defined, kiln_casts
from tests.conftest import shared_cache

# In range, near the ends, out of range both ways, past 2**63 and 2**64, NaN and the infinities.
EDGES = [0.0, 0.75, -0.75, 1.5, -2.5, 7.9, -8.0, 35.5, 127.0, 128.0, -129.0, 255.5, 256.0, -1.0, 300.0,
         65535.0, 70000.0, -40000.0, 2.0 ** 31, -2.0 ** 31 - 512, 4.5e9, 2.0 ** 63, 1e19, 2.0 ** 64 * 3,
         -1e19, np.nan, np.inf, -np.inf]


def _values(src: str) -> np.ndarray:
    values = np.array(EDGES, np.float64)
    if src == "float16":  # (beyond float16's range the value is its Inf: still a case)
        with np.errstate(over="ignore"):
            return values.astype(np.float16)
    return values.astype(src)


def _model(src: str, dst: str, folded: bool):
    to, frm = DTYPES[dst].onnx, DTYPES[src].onnx
    values = _values(src)
    out = helper.make_tensor_value_info("y", to, [len(values)])
    if folded:  # a Cast of a constant: computed when Kiln builds
        graph = helper.make_graph([helper.make_node("Cast", ["c"], ["y"], to=to)], "g", [], [out],
                                  [numpy_helper.from_array(values, "c")])
    else:
        graph = helper.make_graph([helper.make_node("Cast", ["x"], ["y"], to=to)], "g",
                                  [helper.make_tensor_value_info("x", frm, [len(values)])], [out])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 25)], ir_version=11), values


@pytest.mark.parametrize("folded", [False, True], ids=["kernel", "folded"])
@pytest.mark.parametrize("src", ["float32", "float64", "float16"])
@pytest.mark.parametrize("dst", sorted(INTEGER_TYPES))
def test_float_to_integer_is_onnxs_cast_where_defined_and_kilns_definition_elsewhere(dst, src, folded, executor):
    model, values = _model(src, dst, folded)
    feeds = {} if folded else {"x": values}
    got = build(model, executor=executor, cache=shared_cache(), progress=False).load().run(feeds)["y"]
    assert got.dtype.name == dst
    wide = got.astype(np.int64) if dst != "uint64" else got
    assert [int(v) for v in wide] == kiln_casts(values, dst)
    mask = defined(values, dst)
    with np.errstate(invalid="ignore", over="ignore"):
        want = ReferenceEvaluator(model).run(None, feeds)[0]
    assert mask.sum() >= 3  # the defined part is exercised too
    np.testing.assert_array_equal(got[mask].astype(np.float64), want[mask].astype(np.float64))


@pytest.mark.parametrize("value", [-3.0, 300.5, np.nan])
def test_a_scalar_constant_casts_as_an_array_does(value, executor):
    """A 0-d constant (a size computed in float, as exporters write them) folds to a 0-d
    integer."""
    graph = helper.make_graph([helper.make_node("Cast", ["c"], ["y"], to=TensorProto.INT8)], "g", [],
                              [helper.make_tensor_value_info("y", TensorProto.INT8, [])],
                              [numpy_helper.from_array(np.array(value, np.float32), "c")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 25)], ir_version=11)
    got = build(model, executor=executor, cache=shared_cache(), progress=False).load().run({})["y"]
    assert got.shape == () and int(got) == kiln_casts(np.array([value]), "int8")[0]
