"""simplify_inference: fold BatchNormalization into the Conv or Gemm before it.

y = (x - mean) / sqrt(var + eps) * gamma + beta is one per-channel scale and shift. Where
the producer is a Conv or Gemm with constant weights and no other consumer, the scale
goes into its weights and the shift into its bias, and the BatchNorm disappears. In a
float16 model the producer is a float32 conv behind the Cast down to float16
(widen_half_products runs first): the BatchNorm folds into its float32 weights, before the
cast. (Folded into float16 weights, each scaled weight was rounded to float16: a random
MobileNetV3's output moved 0.135 of its range from float32's, 0.004 folded before the cast.) A
BatchNorm with no such producer becomes a Mul and an Add with constant operands, which
fusion then folds into whatever kernel comes before. Identity nodes are bypassed.
"""
from __future__ import annotations

import numpy as np

from ..dtypes import numpy_dtype
from ..graph import Graph, Node
from ..ops.conv_gemm import CONV, CONV_TRANSPOSE, GEMM
from ..ops.elementwise import ADD, BATCH_NORMALIZATION, CAST, MUL
from ..ops.shape import IDENTITY
from ..transform import graph_pass


def _scale_shift(g: Graph, bn: Node):
    # float64 for the per-channel factors (tiny); the weights themselves are scaled in float32.
    gamma, beta, mean, var = (g.constants[i].astype(np.float64) for i in bn.inputs[1:5])
    scale = gamma / np.sqrt(var + bn.attrs.get("epsilon", 1e-5))
    return scale, beta - mean * scale


def _fold_into_conv(g: Graph, conv: Node, scale, shift) -> tuple[list, dict]:
    w = g.constants[conv.inputs[1]]
    scale32 = scale.astype(np.float32)
    bias = g.constants[conv.inputs[2]].astype(np.float64) if len(conv.inputs) > 2 and conv.inputs[2] else 0.0
    if conv.op == CONV:
        new_w = w * scale32.reshape((-1,) + (1,) * (w.ndim - 1))
    else:  # ConvTranspose weights are [Cin, Cout/group, ...]; the output channel is dim 1 per group
        group = conv.attrs.get("group", 1)
        per = w.shape[1]
        s = scale32.reshape(group, 1, per, *([1] * (w.ndim - 2)))
        new_w = (w.reshape(group, -1, per, *w.shape[2:]) * s).reshape(w.shape)
    new_b = bias * scale + shift
    return conv.inputs[:1] + [g.add_constant(g.fresh_name(f"{conv.name}_w_bn"), new_w.astype(w.dtype)),
                              g.add_constant(g.fresh_name(f"{conv.name}_b_bn"), new_b.astype(w.dtype))], conv.attrs


def _fold_into_gemm(g: Graph, gemm: Node, scale, shift) -> tuple[list, dict]:
    dt = g.constants[gemm.inputs[1]].dtype
    b = g.constants[gemm.inputs[1]].astype(np.float64)
    b = b * (scale[:, None] if gemm.attrs.get("transB", 0) else scale[None, :])
    beta = gemm.attrs.get("beta", 1.0)
    c = g.constants[gemm.inputs[2]].astype(np.float64) * beta if len(gemm.inputs) > 2 and gemm.inputs[2] else 0.0
    new_c = np.asarray(c * scale + shift)
    return gemm.inputs[:1] + [g.add_constant(g.fresh_name(f"{gemm.name}_b_bn"), b.astype(dt)),
                              g.add_constant(g.fresh_name(f"{gemm.name}_c_bn"), new_c.astype(dt))], \
        {**gemm.attrs, "beta": 1.0}  # beta is folded into the new bias


def _narrowed(g: Graph, bn: Node, producers, uses) -> Node | None:
    """The Cast between a BatchNorm and the float32 product it narrows, where the BatchNorm
    is its only use (a float16 conv widened by widen_half_products)."""
    cast = producers.get(bn.inputs[0])
    if cast is None or cast.op != CAST or len(uses.get(bn.inputs[0], [])) != 1 or bn.inputs[0] in g.outputs:
        return None
    return cast if g.types[cast.inputs[0]].dtype == "float32" else None


def _foldable_producer(g: Graph, tensor: str, producers, uses) -> Node | None:
    p = producers.get(tensor)
    if p is None or len(uses.get(tensor, [])) != 1 or tensor in g.outputs:
        return None
    if p.op in (CONV, CONV_TRANSPOSE) and p.inputs[1] in g.constants and \
            (len(p.inputs) < 3 or not p.inputs[2] or p.inputs[2] in g.constants):
        return p
    if p.op == GEMM and p.inputs[1] in g.constants and \
            (len(p.inputs) < 3 or not p.inputs[2] or p.inputs[2] in g.constants) and len(g.types[tensor].shape) == 2:
        return p
    return None


@graph_pass(opt_level=1)
def simplify_inference(g: Graph, ctx) -> Graph:
    rename: dict[str, str] = {}
    producers, uses = g.producers(), g.consumers()
    kept = []
    for node in g.nodes:
        node.inputs = [rename.get(i, i) for i in node.inputs]
        if node.op == IDENTITY and node.outputs[0] not in g.outputs:
            rename[node.outputs[0]] = node.inputs[0]
            continue
        if node.op == BATCH_NORMALIZATION and all(i in g.constants for i in node.inputs[1:5]):
            scale, shift = _scale_shift(g, node)
            cast = _narrowed(g, node, producers, uses)
            p = _foldable_producer(g, cast.inputs[0] if cast else node.inputs[0], producers, uses)
            if p is not None:  # the producer is replaced by one computing the BatchNorm's output
                inputs, attrs = (_fold_into_gemm if p.op == GEMM else _fold_into_conv)(g, p, scale, shift)
                out = p.outputs[0] if cast else node.outputs[0]  # (behind a cast, the cast gives it)
                folded = Node(p.op, inputs, [out], attrs, p.name, p.guard)
                kept[next(i for i, k in enumerate(kept) if k is p)] = folded
                producers[out] = folded
                if cast:
                    narrow = Node(CAST, cast.inputs, [node.outputs[0]], cast.attrs, cast.name, cast.guard)
                    kept[next(i for i, k in enumerate(kept) if k is cast)] = narrow
                    producers[node.outputs[0]] = narrow
                g.types[node.outputs[0]] = g.types[node.inputs[0]]
                continue
            rank = len(g.types[node.inputs[0]].shape)
            bshape = (-1,) + (1,) * (rank - 2)
            dt = numpy_dtype(g.types[node.inputs[0]].dtype)  # Mul and Add take operands of one type
            s = g.add_constant(g.fresh_name(f"{node.name}_scale"), scale.astype(dt).reshape(bshape))
            b = g.add_constant(g.fresh_name(f"{node.name}_shift"), shift.astype(dt).reshape(bshape))
            mid = g.fresh_name(f"{node.name}_scaled")
            g.types[mid] = g.types[node.inputs[0]]
            kept.append(Node(MUL, [node.inputs[0], s], [mid], {}, f"{node.name}_mul", node.guard))
            kept.append(Node(ADD, [mid, b], list(node.outputs[:1]), {}, f"{node.name}_add", node.guard))
            continue
        kept.append(node)
    g.nodes = kept
    return g
