"""quantized_moves: an order-preserving op between a DequantizeLinear and a QuantizeLinear
of the same scale and zero point runs on the 8-bit values themselves.

In onnxruntime's QDQ format a max pool of int8 activations is spelled

    x_q -> DequantizeLinear(s, z) -> MaxPool -> QuantizeLinear(s, z) -> y_q

With s > 0, dequantizing is increasing, so the largest dequantized value is the
dequantized largest value, and quantizing it again with the same s and z gives back that
8-bit value: y_q = MaxPool(x_q) exactly (a window wholly in the padding gives the type's
least value either way). Copies and reshapes (Reshape, Flatten, Transpose, Squeeze,
Unsqueeze) move values without looking at them, which is the same argument with no max.
onnxruntime's QDQ transformer drops these pairs too. The 8-bit pool reads a quarter of
the bytes and compares 64 lanes at a time.
"""
from __future__ import annotations

import numpy as np

from ..graph import Graph, Node
from ..ops.quantize import BYTES, DEQUANTIZE_LINEAR, QUANTIZE_LINEAR
from ..ops.reduce import MAX_POOL
from ..ops.shape import FLATTEN, RESHAPE, SQUEEZE, TRANSPOSE, UNSQUEEZE
from ..transform import graph_pass

ORDER_PRESERVING = (MAX_POOL, RESHAPE, FLATTEN, TRANSPOSE, SQUEEZE, UNSQUEEZE)


def _constant_params(g: Graph, node: Node):
    """(scale, zero point) of a per-tensor Q/DQ node as arrays, or None when either is not
    a constant, is not per tensor, or the scale is not positive."""
    if node.attrs.get("block_size", 0):
        return None
    scale = g.constants.get(node.inputs[1])
    zp = g.constants.get(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else None
    if scale is None or scale.size != 1 or not float(scale.reshape(-1)[0]) > 0:
        return None
    if len(node.inputs) > 2 and node.inputs[2] and (zp is None or zp.size != 1):
        return None
    return scale, zp


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and np.array_equal(a.reshape(-1), b.reshape(-1))


@graph_pass(opt_level=1)
def quantized_moves(g: Graph, ctx) -> Graph:
    producers, consumers = g.producers(), g.consumers()
    outputs = set(g.outputs)
    dropped = set()
    for node in g.nodes:
        if node.op not in ORDER_PRESERVING or node.outputs[0] in outputs or len(node.outputs) != 1:
            continue
        dq, users = producers.get(node.inputs[0]), consumers.get(node.outputs[0], [])
        if dq is None or dq.op != DEQUANTIZE_LINEAR or len(users) != 1 or users[0].op != QUANTIZE_LINEAR:
            continue
        q = users[0]
        if g.types[dq.inputs[0]].dtype not in BYTES or g.types[q.outputs[0]].dtype != g.types[dq.inputs[0]].dtype:
            continue
        dq_params, q_params = _constant_params(g, dq), _constant_params(g, q)
        if dq_params is None or q_params is None or not all(map(_same, dq_params, q_params)):
            continue
        node.inputs = [dq.inputs[0], *node.inputs[1:]]
        node.outputs = [q.outputs[0]]
        dropped.add(id(q))
    g.nodes = [n for n in g.nodes if id(n) not in dropped]
    return g
