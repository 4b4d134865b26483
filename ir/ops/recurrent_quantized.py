"""onnxruntime's com.microsoft.DynamicQuantizeLSTM: an LSTM with 8-bit weights, as
`onnxruntime.quantization.quantize_dynamic` writes one for every LSTM.

W is [dirs, input, 4H] and R [dirs, H, 4H] (both already transposed), int8 or uint8, each
with a scale and a zero point per direction or per gate column. The activations are
quantized at run time the way onnxruntime's kernel does, so the results agree with it and
not only with a float LSTM:

  1. X (the steps up to the longest sequence) is one uint8 matrix: its range, widened to
     hold 0, gives scale = range / 255 (1 if the range is empty) and zero point
     round(-min / scale). X W sums in int32 (MatMulInteger) and is scaled by
     x_scale * W_scale[col], then the biases are added: the projection of every step.
  2. Each step quantizes h_prev the same way and multiplies it by R in int32 inside the
     recurrence kernel (ir/lower/recurrent.py, `_quantized_recurrent_product`).
The gates, peepholes, clip and sequence lengths are the float LSTM's (ir/ops/recurrent.py).
"""
from __future__ import annotations

import numpy as np

from ..attrs import const_input
from ..graph import Node, ShapeError, UnsupportedError
from .elementwise import ADD, CAST, CLIP, DIV, EQUAL, LESS, MAX, MIN, MUL, ROUND, SUB, WHERE
from .node_builder import NodeBuilder
from .quantize import CONTRIB, MATMUL_INTEGER, QUANTIZE_LINEAR
from .reduce import REDUCE_MAX, REDUCE_MIN
from .recurrent import (CELLS, LSTM, add_recurrence, check_hidden_size, recurrent_bias, recurrent_geometry,
                        steps_by_rows)
from .registry import OPAQUE, OpDef, expanded_only, register

DYNAMIC_QUANTIZE_LSTM = CONTRIB + "DynamicQuantizeLSTM"
_W_SCALE, _W_ZERO, _R_SCALE, _R_ZERO = 8, 9, 10, 11  # input indices after the LSTM's own eight


def _weights(g, node: Node, index: int, what: str, shape: tuple) -> np.ndarray:
    value = const_input(g, node, index, what, required=True)
    if value.dtype not in (np.int8, np.uint8):
        raise UnsupportedError(f"{node.describe()}: {what} is {value.dtype}, not int8 or uint8")
    if value.shape != shape:
        raise ShapeError(f"{node.describe()}: {what} is {list(value.shape)}, expected {list(shape)} "
                         "([directions, rows, 4 * hidden_size])")
    return value


def _per_column(g, node: Node, index: int, what: str, dirs: int, columns: int, dtype) -> np.ndarray:
    """A scale or zero point given per direction ([dirs]) or per gate column ([dirs, 4H]), as
    [dirs, 4H]."""
    value = const_input(g, node, index, what, required=True)
    if value.shape not in ((dirs,), (dirs, columns)):
        raise ShapeError(f"{node.describe()}: {what} is {list(value.shape)}, expected [{dirs}] (per direction) "
                         f"or [{dirs}, {columns}] (per column)")
    if np.dtype(value.dtype) != np.dtype(dtype):
        raise ShapeError(f"{node.describe()}: {what} is {value.dtype}, expected {np.dtype(dtype)}")
    return np.broadcast_to(value.reshape(dirs, -1), (dirs, columns)).astype(dtype)


def _quantization_parameters(body: NodeBuilder, x: str) -> tuple[str, str]:
    """onnxruntime's uint8 scale and zero point of a whole float tensor (see the module doc)."""
    zero = body.const(np.float32(0))
    lo = body.add(MIN, [body.add(REDUCE_MIN, [x], keepdims=0), zero])
    hi = body.add(MAX, [body.add(REDUCE_MAX, [x], keepdims=0), zero])
    spread = body.add(SUB, [hi, lo])
    scale = body.add(WHERE, [body.add(EQUAL, [hi, lo]), body.const(np.float32(1)),
                             body.add(DIV, [spread, body.const(np.float32(255))])])
    start = body.add(CLIP, [body.add(SUB, [zero, body.add(DIV, [lo, scale])]), zero, body.const(np.float32(255))])
    return scale, body.add(CAST, [body.add(ROUND, [start])], to=2)  # to uint8


def _steps_in_use(body: NodeBuilder, node: Node, xs: str, seq: int) -> str:
    """X with the steps past the longest sequence zeroed (onnxruntime quantizes only the
    steps it runs; zero is in the range anyway)."""
    lens = node.inputs[4] if len(node.inputs) > 4 else ""
    if not lens:
        return xs
    longest = body.add(REDUCE_MAX, [lens], keepdims=0)
    steps = body.const(np.arange(seq, dtype=np.int32).reshape(seq, 1, 1))
    return body.add(WHERE, [body.add(LESS, [steps, longest]), xs, body.const(np.float32(0))])


def expand_dynamic_quantize_lstm(g, node: Node) -> list[Node]:
    geo = recurrent_geometry(g, node, "DynamicQuantizeLSTM")
    dirs, width, gates = geo["dirs"], geo["width"], CELLS[LSTM]["gates"]
    r_type = g.types[node.inputs[2]]
    if len(r_type.shape) != 3:
        raise ShapeError(f"{node.describe()}: R is {r_type}, expected [directions, hidden_size, 4 * hidden_size]")
    hidden = r_type.shape[1]
    check_hidden_size(node, hidden, r_type.shape)
    gh = gates * hidden
    w = _weights(g, node, 1, "W", (dirs, width, gh))
    r = _weights(g, node, 2, "R", (dirs, hidden, gh))
    w_scale = _per_column(g, node, _W_SCALE, "W_scale", dirs, gh, np.float32)
    w_zero = _per_column(g, node, _W_ZERO, "W_zero_point", dirs, gh, w.dtype)
    r_scale = _per_column(g, node, _R_SCALE, "R_scale", dirs, gh, np.float32)
    r_zero = _per_column(g, node, _R_ZERO, "R_zero_point", dirs, gh, r.dtype)
    bias = recurrent_bias(g, node, dirs, gates, hidden)

    body = NodeBuilder(g, node)
    xs = _steps_in_use(body, node, steps_by_rows(body, node, geo), geo["seq"])
    flat = body.reshaped(xs, [geo["seq"] * geo["batch"], width])
    x_scale, x_zero = _quantization_parameters(body, flat)
    q = body.add(QUANTIZE_LINEAR, [flat, x_scale, x_zero])
    w_all = np.ascontiguousarray(np.concatenate(list(w), axis=1))  # [input, dirs * 4H]
    sums = body.add(MATMUL_INTEGER, [q, body.const(w_all), x_zero, body.const(w_zero.reshape(-1))])
    multiplier = body.add(MUL, [x_scale, body.const(w_scale.reshape(-1))])
    projected = body.add(MUL, [body.add(CAST, [sums], to=1), multiplier])  # to float
    xw = body.add(ADD, [projected, body.const((bias[:, :gh] + bias[:, gh:]).reshape(-1))])
    # R^T less its zero points, as int32: the recurrence sums its products exactly.
    r_centred = r.astype(np.int32) - r_zero.astype(np.int32)[:, None, :]
    recurrent = [body.const(np.ascontiguousarray(r_centred)), body.const(np.zeros((dirs, hidden), np.float32))]
    return add_recurrence(body, node, LSTM, geo, hidden, xw, recurrent, extra=[body.const(r_scale)], quantized=True)


register(OpDef(DYNAMIC_QUANTIZE_LSTM, OPAQUE, expanded_only, expand=expand_dynamic_quantize_lstm))
