"""widen_half_products: a float16 or bfloat16 MatMul, Gemm, Conv or ConvTranspose computes
on float32 operands: a Cast up in front of each run-time operand, constant weights turned
into float32 constants here, at build time, and a Cast back down behind.

Kiln computes 16-bit floats in float32 and rounds where it stores them, so these ops give
the numbers they gave before (a Cast up from a 16-bit float reads the value as stored:
ops/elementwise.py). What changes is where the conversions run. Read in place, a half
operand was converted at every broadcast of the micro-kernel, once per panel of weights,
and the GEMM and conv paths that need float32 (pointwise convs, packed inputs) were shut:
a float16 BERT ran at 3x its float32 build, a MobileNetV2 at 1.6x. Cast up, an activation
converts once, in the kernel that produces it (the Cast fuses there as one more output),
and the products take the float32 paths. onnxruntime's CPU provider does the same around
the ops it has no float16 kernel for. It runs before simplify_inference, so that a BatchNorm
folds into the float32 weights behind the Cast down, not into float16 ones.
"""
from __future__ import annotations

import numpy as np

from ..dtypes import dtype as dtype_of
from ..graph import Graph, Node, TensorType
from ..ops.conv_gemm import CONV, CONV_TRANSPOSE, GEMM, MATMUL
from ..ops.elementwise import CAST
from ..transform import graph_pass

HALF_TYPES = ("float16", "bfloat16")
PRODUCTS = (MATMUL, GEMM, CONV, CONV_TRANSPOSE)


@graph_pass(opt_level=1)
def widen_half_products(g: Graph, ctx) -> Graph:
    taken = set(g.types) | {o for n in g.nodes for o in n.outputs}
    widened: dict[tuple, str] = {}  # (tensor, guard) -> its float32 copy

    def fresh(base: str) -> str:
        i = 0
        while f"{base}_{i}" in taken:
            i += 1
        taken.add(f"{base}_{i}")
        return f"{base}_{i}"

    nodes = []
    for node in g.nodes:
        if node.op not in PRODUCTS or g.types[node.outputs[0]].dtype not in HALF_TYPES:
            nodes.append(node)
            continue
        dtype = g.types[node.outputs[0]].dtype
        inputs = []
        for name in node.inputs:
            if not name:
                inputs.append(name)
            elif (name, node.guard) in widened:
                inputs.append(widened[(name, node.guard)])
            elif isinstance(g.constants.get(name), np.ndarray):
                wide = g.add_constant(fresh(f"{name}_f32"), g.constants[name].astype(np.float32))
                inputs.append(widened.setdefault((name, node.guard), wide))
            else:
                wide = fresh(f"{name}_f32")
                g.types[wide] = TensorType(g.types[name].shape, "float32")
                nodes.append(Node(CAST, [name], [wide], {"to": dtype_of("float32").onnx}, fresh(f"{node.name or name}_up"),
                                  node.guard))
                inputs.append(widened.setdefault((name, node.guard), wide))
        out, narrow = fresh(f"{node.outputs[0]}_f32"), node.outputs[0]
        g.types[out] = TensorType(g.types[narrow].shape, "float32")
        if node.key in g.params:  # (passes before the next type inference read a conv's)
            g.params[out] = g.params[node.key]
        nodes.append(Node(node.op, inputs, [out], dict(node.attrs), node.name, node.guard))
        nodes.append(Node(CAST, [out], [narrow], {"to": dtype_of(dtype).onnx}, fresh(f"{node.name or narrow}_down"),
                          node.guard))
    g.nodes = nodes
    return g

