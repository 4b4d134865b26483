"""weight_only_blocks: a MatMul of a block-quantized 4-bit constant weight becomes MatMulNBits.

The QDQ spelling of a 4-bit weight-only layer (onnxruntime's MatMulNBitsQuantizer in QDQ
format, and other tools') is

    A -> MatMul <- DequantizeLinear(axis=0, block_size) <- W (int4 or uint4 [K, N], a constant)

Computed as written, constant folding would dequantize W to float. This pass writes the pair
as the com.microsoft.MatMulNBits node it means, whose 4-bit codes Kiln keeps as codes
(ir/lower/matmul_nbits.py): B's codes, scales and zero points laid out as that op takes
them (an int4 value v is the code v + 8 with zero point z + 8: the same weight). It runs
before fold_constants. A DequantizeLinear that something else reads too is left as it is.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..graph import Graph, Node
from ..ops.conv_gemm import MATMUL
from ..ops.matmul_nbits import MATMUL_NBITS
from ..ops.node_builder import NodeBuilder
from ..ops.quantize import DEQUANTIZE_LINEAR
from ..transform import graph_pass

_FOUR_BITS = ("int4", "uint4")


def _blocked_weight(g: Graph, dq: Node) -> bool:
    """A DequantizeLinear of a constant 4-bit [K, N] weight in blocks along K, as MatMulNBits
    takes them (a power of two of 16 or more filling K), with constant scales (and zero points)."""
    w = g.types[dq.inputs[0]]
    block = int(dq.attrs.get("block_size", 0))
    if w.dtype not in _FOUR_BITS or len(w.shape) != 2 or dq.attrs.get("axis", 1) % 2 != 0:
        return False
    if block < 16 or block & (block - 1) or w.shape[0] % block:
        return False
    return all(i in g.constants for i in dq.inputs if i) and g.types[dq.outputs[0]].dtype in ("float32", "float16")


def _pack_low_first(codes: np.ndarray) -> np.ndarray:
    """uint8 codes [..., 2m] (0..15) as [..., m] bytes, the first of each pair in the low nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def _matmul_nbits(g: Graph, matmul: Node, dq: Node) -> list[Node]:
    w = g.constants[dq.inputs[0]].astype(np.int16)
    k, n = w.shape
    block = int(dq.attrs["block_size"])
    blocks = k // block
    signed = g.types[dq.inputs[0]].dtype == "int4"
    zp = g.constants[dq.inputs[2]].astype(np.int16) if len(dq.inputs) > 2 and dq.inputs[2] else np.zeros((blocks, n))
    codes = (w + 8 if signed else w).T.reshape(n, blocks, block).astype(np.uint8)  # [N, blocks, block]
    zero_points = (np.broadcast_to(zp, (blocks, n)) + (8 if signed else 0)).T.astype(np.uint8)  # [N, blocks]
    padded = np.zeros((n, blocks + blocks % 2), np.uint8)
    padded[:, :blocks] = zero_points
    scales = np.broadcast_to(g.constants[dq.inputs[1]], (blocks, n)).T
    body = NodeBuilder(g, matmul)
    inputs = [matmul.inputs[0], body.const(_pack_low_first(codes)),
              body.const(np.ascontiguousarray(scales).astype(g.types[dq.inputs[1]].dtype)),
              body.const(_pack_low_first(padded).reshape(-1))]
    return [replace(matmul, op=MATMUL_NBITS, inputs=inputs, attrs={"K": k, "N": n, "bits": 4, "block_size": block})]


@graph_pass(opt_level=1)
def weight_only_blocks(g: Graph, ctx) -> Graph:
    producers, consumers = g.producers(), g.consumers()
    rewritten, out = set(), []
    for node in g.nodes:
        dq = producers.get(node.inputs[1]) if node.op == MATMUL and len(node.inputs) > 1 else None
        a = g.types[node.inputs[0]] if dq is not None else None
        if dq is None or dq.op != DEQUANTIZE_LINEAR or not _blocked_weight(g, dq) or len(a.shape) < 2 or \
                a.dtype != g.types[dq.outputs[0]].dtype or dq.outputs[0] in g.outputs or \
                any(c.op != MATMUL or c.inputs[1] != dq.outputs[0] for c in consumers.get(dq.outputs[0], [])):
            out.append(node)
            continue
        out.extend(_matmul_nbits(g, node, dq))
        rewritten.add(id(dq))
    g.nodes = [node for node in out if id(node) not in rewritten]
    return g
