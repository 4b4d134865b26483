"""Ops evaluated at compile time: Shape, Size, Constant, Range, ConstantOfShape. Their
outputs are constants (a Shape needs only its input's shape); an input that is not known at
compile time is an error naming the node. Range and ConstantOfShape over sizes known only
at run time (symbolic values) are the exception: they compute at run time."""
from __future__ import annotations

import numpy as np

from ..attrs import NotConstant
from ..graph import Node, ShapeError, TensorType, UnsupportedError, as_kiln_array
from ..loop import Cast, Const, Store, add, mul
from ..symbolic import Dim, dim_from_json, dim_to_json, greatest, least, require_equal
from ..value_symbols import bounds_hint, counted_tensors_of, define
from ..validate import check_tensor_size
from .registry import OPAQUE, OpDef, register


def _shape(g, node, p):
    x = g.types[node.inputs[0]]
    rank = len(x.shape)
    start = node.attrs.get("start", 0)
    end = node.attrs.get("end", rank)
    return TensorType((len(range(rank)[slice(start, end)]),), "int64")


def _sizes(values) -> np.ndarray:
    """int64 sizes, or an object array where some are symbolic (Dims)."""
    symbolic = any(isinstance(v, Dim) for v in np.asarray(values, dtype=object).reshape(-1))
    return np.array(values, dtype=object if symbolic else np.int64)


def _shape_value(a, values, g, node):
    shape = g.types[node.inputs[0]].shape
    return [_sizes(list(shape[slice(a.get("start", 0), a.get("end", len(shape)))]))]


def _size(g, node, p):
    return TensorType((), "int64")


def _size_value(a, values, g, node):
    return [_sizes(g.types[node.inputs[0]].size)]


def _range_value(a, values, g, node):
    start, limit, delta = (v.reshape(()) for v in values)
    return [np.arange(start, limit, delta).astype(start.dtype)]


def _whole(v):
    """A float that is a whole number as an int (arange(0.0, float(w), 1.0) counts like ints)."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


def _range_infer(g, node, p):
    """Range: a constant where its inputs are; over sizes known at run time (arange(past,
    past + seq) of a decoder's positions), an op computing start + i * delta at run time, its
    length a symbolic size (`at_run_time` in its parameters)."""
    if not any(i in g.symbolic_values for i in node.inputs):
        # (start and limit may be read at run time; a step may not: its sign decides the count)
        return _from_value(_range_value, at_run_time=node.inputs[2] in g.constants)(g, node, p)
    start, limit, delta = (_whole(np.asarray(g.symbolic_values.get(i, g.constants.get(i))).reshape(()).item())
                           if i in g.symbolic_values or i in g.constants else None for i in node.inputs)
    if start is None or limit is None or not isinstance(delta, int) or delta == 0 or isinstance(start, float):
        raise TypeError("a Range over run-time sizes needs a constant whole start and step")
    start, limit, delta = (v if isinstance(v, Dim) else int(v) for v in (start, limit, delta))
    span, step = (limit - start, delta) if delta > 0 else (start - limit, -delta)
    if step == 1 and least(span) >= 0:
        length = span  # (a polynomial: arange(past, past + seq) is seq long)
    else:  # (a value symbol: the count, never negative, computed at the start of a call)
        length = define(f"{node.outputs[0]}[0]", ("div", ("add", ("max", span, 0), step - 1), step), 0,
                        max(0, -(-greatest(span) // step)), f"the length of {node.describe()}")
    p["at_run_time"], p["start"], p["delta"] = True, dim_to_json(start), int(delta)
    return TensorType((length,), g.types[node.inputs[0]].dtype)


def _range_reader(b, node):
    """start + i * delta, computed in i64 and converted to the Range's type."""
    a, t = b.attrs(node), b.compute(node.outputs[0])
    start = b.dim(dim_from_json(a["start"], b.g.symbols))

    def value(idx):
        v = add(start, mul(idx[0], a["delta"]))
        return v if t == "i64" else Cast(t, v)
    return {node.outputs[0]: value}


def _constant_of_shape_value(a, values, g, node):
    value = a.get("value", np.zeros(1, np.float32))
    shape = [int(d) for d in values[0].reshape(-1)]
    check_tensor_size(node.outputs[0], shape, value.dtype.itemsize)  # before np.full allocates it
    return [np.full(shape, value.reshape(-1)[0], dtype=value.dtype)]


def _constant_of_shape_infer(g, node, p):
    """ConstantOfShape: a constant, or over sizes known at run time an op filling its output
    (`at_run_time` in its parameters) whose shape holds symbolic sizes."""
    if node.inputs[0] not in g.symbolic_values:
        return _from_value(_constant_of_shape_value, at_run_time=True)(g, node, p)
    value = node.attrs.get("value", np.zeros(1, np.float32))
    shape = tuple(v if isinstance(v, Dim) else int(v) for v in g.symbolic_values[node.inputs[0]].reshape(-1))
    if any(greatest(d) < 0 for d in shape):
        raise ShapeError(f"{node.describe()}: its shape {list(shape)} is negative")
    # (a size whose bounds let it be negative, computed from data with loose bounds: the size
    # from 0 up, checked equal to it when the call knows it)
    shape = tuple(d if least(d) >= 0 else
                  require_equal(define(f"{node.outputs[0]}[{i}]", ("max", d, 0), 0, greatest(d),
                                       f"dim {i} of {node.describe()}"), d,
                                f"{node.describe()}: dim {i} of its shape must not be negative")
                  for i, d in enumerate(shape))
    p["at_run_time"], p["fill"] = True, value.reshape(-1)[0].item()
    return TensorType(shape, str(as_kiln_array(value).dtype))


def _constant_of_shape_reader(b, node):
    fill, t = b.attrs(node)["fill"], b.compute(node.outputs[0])
    return {node.outputs[0]: lambda idx: Const(float(fill) if t in ("f32", "f64") else int(fill), t)}


def _from_value(evaluate, at_run_time: bool = False):
    """The type of a compile-time-only op is the type of its value (`at_run_time`: or of sizes
    read at run time, where its inputs' values are bounded: ir/value_symbols.py)."""
    def infer(g, node, p):
        missing = [i for i in node.inputs if i and i not in g.constants]
        if any(i in g.symbolic_values for i in missing):
            raise UnsupportedError(f"{node.describe()}: {node.op} with symbolic dimensions is not supported yet (its "
                                   f"inputs {', '.join(missing)} are sizes known at run time). Fix those dims with "
                                   "--shape to build this model")
        if missing:
            hint = bounds_hint(g, missing) if at_run_time else ""
            raise NotConstant(f"{node.describe()}: inputs {', '.join(repr(i) for i in missing)} must be known at "
                              f"compile time, but are computed at run time{hint}", missing)
        values = evaluate(node.attrs, [g.constants.get(i) if i else None for i in node.inputs], g, node)
        return [TensorType(tuple(v.shape), str(as_kiln_array(np.asarray(v)).dtype)) for v in values]
    return infer


def _constant_value(a, values, g, node):
    return [a["value"]]


# A tensor whose values are sizes known as expressions of the symbols, where a kernel reads
# it at run time (ir/ops/inference.py makes these): each element computed from the symbols.
SYMBOLIC_VALUE = "kiln.SymbolicValue"


def symbolic_value_node(name: str, values: np.ndarray, dtype: str) -> Node:
    # (a size a kernel counts is known once that kernel has run: the count is an input, so
    # the node runs after it; its kernel reads the size from the symbols, not the input)
    counts = sorted({t for v in values.reshape(-1) for t in counted_tensors_of(v)})
    return Node(SYMBOLIC_VALUE, counts, [name], {"values": [dim_to_json(v) for v in values.reshape(-1)],
                                             "shape": list(values.shape), "dtype": dtype}, f"{name}/value")


def symbolic_values_of(g, node) -> np.ndarray:
    values = [dim_from_json(v, g.symbols) for v in node.attrs["values"]]
    return np.array(values, dtype=object).reshape(node.attrs["shape"])


def _lower_symbolic_value(b, node) -> tuple:
    out, t = b.out_param(node.outputs[0]), b.compute(node.outputs[0])
    values = symbolic_values_of(b.g, node).reshape(-1)
    return tuple(Store(out, Const(i), Cast(t, b.dim(v)) if isinstance(v, Dim) and t != "i64" else
                       b.dim(v) if isinstance(v, Dim) else Const(int(v), t)) for i, v in enumerate(values))


CONSTANT = "Constant"  # the frontend turns these into graph constants directly
RANGE = "Range"
SHAPE = "Shape"
register(
    OpDef(SHAPE, OPAQUE, _shape, _shape_value, compile_time=True, shape_only=True),
    OpDef("Size", OPAQUE, _size, _size_value, compile_time=True, shape_only=True),
    OpDef(CONSTANT, OPAQUE, _from_value(_constant_value), _constant_value, compile_time=True),
    OpDef(RANGE, OPAQUE, _range_infer, _range_value, _range_reader, compile_time=True),
    OpDef("ConstantOfShape", OPAQUE, _constant_of_shape_infer, _constant_of_shape_value, _constant_of_shape_reader,
          compile_time=True),
    OpDef(SYMBOLIC_VALUE, OPAQUE, lambda g, node, p: TensorType(tuple(node.attrs["shape"]), node.attrs["dtype"]),
          alone=_lower_symbolic_value),
)
