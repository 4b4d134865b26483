"""integer_products: Conv, MatMul and Gemm between DequantizeLinear nodes become integer
products.

onnxruntime's QDQ format spells an int8 layer as float ops between quantize/dequantize pairs:

    x_q -> DequantizeLinear -> Conv <- DequantizeLinear <- w_q (a constant)

Computed as written, that is a float conv of dequantized values. Since DQ(x) = (x_q - zx) * sx
and DQ(w) = (w_q - zw) * sw, the conv equals sx * sw[c] * ConvInteger(x_q, w_q, zx, zw), so
this pass writes it that way: the integer product, a Cast, one multiply by the combined scale
and the bias add. Those, and what follows (an activation, the next QuantizeLinear), fuse as
the integer kernel's epilogue: one int8 kernel per layer, as onnxruntime's QDQ fusion builds.

It runs before fold_constants, which would otherwise dequantize the weights to float32.
Products whose operands are not dequantized 8-bit values (per tensor for the activation, per
tensor or per output channel for constant weights) are left as they are.
"""
from __future__ import annotations

import numpy as np

from ..graph import Graph, Node
from ..ops.conv_gemm import CONV, GEMM, MATMUL
from ..ops.elementwise import ADD, CAST, DIV, MUL
from ..ops.node_builder import NodeBuilder
from ..ops.quantize import BYTES, CONV_INTEGER, DEQUANTIZE_LINEAR, MATMUL_INTEGER, QUANTIZE_LINEAR, channel_view
from ..transform import graph_pass

FLOAT = 1  # onnx's code for float32, Cast's `to`


def _dequantized(g: Graph, producers: dict, name: str, constant: bool) -> Node | None:
    """The DequantizeLinear producing `name` from 8-bit values (constant ones if asked),
    with a constant or per-tensor scale and no blocks; else None."""
    dq = producers.get(name)
    if dq is None or dq.op != DEQUANTIZE_LINEAR or dq.attrs.get("block_size", 0):
        return None
    q = dq.inputs[0]
    if g.types[q].dtype not in BYTES or g.types[name].dtype != "float32" or (constant and q not in g.constants):
        return None
    if constant and any(i not in g.constants for i in dq.inputs[1:] if i):
        return None
    return dq


def _per_tensor(g: Graph, dq: Node) -> bool:
    return all(g.types[i].size == 1 for i in dq.inputs[1:] if i)


def _weight_axis_ok(g: Graph, dq: Node, axis: int) -> bool:
    """Per tensor, or one scale (and zero point) per slice along `axis` of the weights."""
    if _per_tensor(g, dq):
        return True
    rank = len(g.types[dq.inputs[0]].shape)
    return dq.attrs.get("axis", 1) % rank == axis


def _zero_point(dq: Node) -> str:
    return dq.inputs[2] if len(dq.inputs) > 2 else ""


def _integer_bias(g: Graph, producers: dict, bias: str, x: Node, w: Node) -> str:
    """The int32 values of a bias dequantized at the product's own scale (x's times w's, as
    onnxruntime's tool writes it), or ""."""
    dq = producers.get(bias)
    if dq is None or dq.op != DEQUANTIZE_LINEAR or g.types[dq.inputs[0]].dtype != "int32":
        return ""
    scales = [x.inputs[1], w.inputs[1], dq.inputs[1]]
    if any(s not in g.constants for s in scales + [dq.inputs[0]]):
        return ""
    sx, sw, sb = (g.constants[s].astype(np.float32).reshape(-1) for s in scales)
    zp = g.constants.get(_zero_point(dq)) if _zero_point(dq) else None
    if (zp is not None and zp.any()) or sb.shape != (sx * sw).shape or not np.allclose(sb, sx * sw, rtol=1e-6, atol=0):
        return ""
    return dq.inputs[0]


def _requantizer(g: Graph, consumers: dict, out: str) -> Node | None:
    """The per-tensor QuantizeLinear that alone reads `out`, if any (its scale a constant)."""
    readers = consumers.get(out, [])
    if len(readers) != 1 or readers[0].op != QUANTIZE_LINEAR or out in g.outputs:
        return None
    q = readers[0]
    return q if q.inputs[0] == out and q.inputs[1] in g.constants and _per_tensor(g, q) else None


def _rewrite(g: Graph, node: Node, x: Node, w: Node, producers: dict, consumers: dict):
    """The integer form of `node` (and the QuantizeLinear it absorbs, or None), or None
    where its attributes do not allow one.

    With an int32 bias and a QuantizeLinear after it, the form is onnxruntime's QLinearConv
    arithmetic exactly: round(float(acc + bias) * (sx * sw / sy)) + zy."""
    body = NodeBuilder(g, node)
    w_q, w_scale, w_zp = w.inputs[0], w.inputs[1], _zero_point(w)
    rank = len(g.types[node.inputs[0]].shape)
    bias = ""
    if node.op == CONV:
        if not _weight_axis_ok(g, w, 0):
            return None
        acc = body.add(CONV_INTEGER, [x.inputs[0], w_q, _zero_point(x), w_zp], **node.attrs)
        w_scale = channel_view(body, w_scale, rank)
        bias = node.inputs[2] if len(node.inputs) > 2 else ""
        bias = bias and channel_view(body, bias, rank)
    else:
        trans_b = node.op == GEMM and node.attrs.get("transB", 0)
        if node.op == GEMM and (node.attrs.get("transA", 0) or node.attrs.get("alpha", 1.0) != 1.0
                                or node.attrs.get("beta", 1.0) != 1.0):
            return None
        if len(g.types[w_q].shape) != 2 or rank < 2 or not _weight_axis_ok(g, w, 0 if trans_b else 1):
            return None
        if trans_b:  # MatMulInteger takes B as [K, N]
            w_q = body.const(np.ascontiguousarray(g.constants[w_q].T))
        acc = body.add(MATMUL_INTEGER, [x.inputs[0], w_q, _zero_point(x), w_zp])
        bias = node.inputs[2] if node.op == GEMM and len(node.inputs) > 2 else ""
    q = _requantizer(g, consumers, node.outputs[0])
    int_bias = _integer_bias(g, producers, node.inputs[2], x, w) if len(node.inputs) > 2 and node.inputs[2] else ""
    scale = body.add(MUL, [x.inputs[1], w_scale])
    if q is not None and (int_bias or not bias):
        if int_bias:
            acc = body.add(ADD, [acc, channel_view(body, int_bias, rank) if node.op == CONV else int_bias])
        multiplier = body.add(DIV, [scale, q.inputs[1]])
        value = body.add(MUL, [body.add(CAST, [acc], to=FLOAT), multiplier])
        zero = q.inputs[2] if len(q.inputs) > 2 else ""
        body.add(QUANTIZE_LINEAR, [value, body.const(np.float32(1))] + ([zero] if zero else []), q.outputs[0])
        return body.nodes, q
    value = body.add(MUL, [body.add(CAST, [acc], to=FLOAT), scale], "" if bias else node.outputs[0])
    if bias:
        body.add(ADD, [value, bias], node.outputs[0])
    return body.nodes, None


@graph_pass(opt_level=1)
def integer_products(g: Graph, ctx) -> Graph:
    producers, consumers = g.producers(), g.consumers()
    out, absorbed = [], set()
    for node in g.nodes:
        if id(node) in absorbed:
            continue
        new = None
        if node.op in (CONV, MATMUL, GEMM) and g.types[node.outputs[0]].dtype == "float32":
            x = _dequantized(g, producers, node.inputs[0], constant=False)
            w = _dequantized(g, producers, node.inputs[1], constant=True)
            if x is not None and w is not None and _per_tensor(g, x):
                new = _rewrite(g, node, x, w, producers, consumers)
        if new is None:
            out.append(node)
            continue
        nodes, q = new
        out.extend(nodes)
        if q is not None:
            absorbed.add(id(q))
    g.nodes = out
    return g
