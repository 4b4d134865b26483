"""com.microsoft.GatherBlockQuantized: a Gather of rows of a block-quantized table, each
row dequantized. onnxruntime-genai's builder writes it for the token embedding of an int4
model whose embedding and LM head are one matrix (tie_word_embeddings: Llama 3.2, Qwen2.5,
Gemma, Phi-4-mini), reading the LM head's 4-bit codes.

The table (a weight, or genai's Reshape of the LM head's codes) is uint8 [rows, bytes]
holding `bits`-bit codes lowest bits first (onnxruntime's MatMulNBits layout), or
int4/uint4 [rows, columns]. Blocks of `block_size` run along the last axis
(quantize_axis), rows are gathered (gather_axis 0); scales [rows, blocks], zero points like
the codes (packed for uint8) or absent (2^(bits - 1) for uint8, 0 for int4/uint4). Built
from ONNX's ops: the gathered rows' bytes are unpacked and dequantized as (code - zero
point) * scale, so the weights file holds the codes as they are and a token reads its own
row only.
"""
from __future__ import annotations

import numpy as np

from ..dtypes import DTYPES
from ..graph import Node, ShapeError, UnsupportedError
from .elementwise import BITWISE_AND, BIT_SHIFT, CAST, MUL, SUB
from .node_builder import NodeBuilder
from .quantize import CONTRIB
from .registry import OPAQUE, OpDef, expanded_only, register
from .shape import CONCAT, GATHER, IDENTITY, PAD, SLICE, UNSQUEEZE

GATHER_BLOCK_QUANTIZED = CONTRIB + "GatherBlockQuantized"
_FLOATS = ("float32", "float16", "bfloat16")  # (the scales' types, and the output's)


def _unpacked(body: NodeBuilder, packed: str, bits: int, rank: int) -> str:
    """uint8 [..., bytes] -> uint8 [..., bytes * 8 / bits], each byte's codes lowest bits first."""
    if bits == 8:
        return packed
    mask = body.const(np.uint8((1 << bits) - 1))
    parts = []
    for shift in range(0, 8, bits):
        moved = body.add(BIT_SHIFT, [packed, body.const(np.uint8(shift))], direction="RIGHT") if shift else packed
        parts.append(body.add(UNSQUEEZE, [body.add(BITWISE_AND, [moved, mask]), body.const(np.array([-1], np.int64))]))
    return body.reshaped(body.add(CONCAT, parts, axis=-1), [0] * (rank - 1) + [-1])


def _last(body: NodeBuilder, x: str, count: int) -> str:
    return body.add(SLICE, [x, body.const(np.array([0], np.int64)), body.const(np.array([count], np.int64)),
                            body.const(np.array([-1], np.int64))])


def _expand(g, node: Node) -> list[Node]:
    data, indices, scales = node.inputs[:3]
    zero_points = node.inputs[3] if len(node.inputs) > 3 else ""
    a = node.attrs
    d, s = g.types[data], g.types[scales]
    if len(d.shape) != 2 or int(a.get("gather_axis", 0)) % 2 != 0 or int(a.get("quantize_axis", 1)) % 2 != 1:
        raise UnsupportedError(f"{node.describe()}: only a [rows, columns] table gathered by rows (gather_axis 0) "
                               "and quantized along its columns (quantize_axis 1) is supported")
    if d.dtype == "uint8":
        bits = int(a.get("bits", 4))
        if bits not in (2, 4, 8):
            raise ShapeError(f"{node.describe()}: bits={bits}; uint8 data holds 2-, 4- or 8-bit codes")
        default_zero = 1 << (bits - 1)
    elif d.dtype in ("int4", "uint4"):
        bits, default_zero = 8, 0  # (one code an element already)
    else:
        raise UnsupportedError(f"{node.describe()}: data of type {d.dtype} is not supported (uint8, int4, uint4)")
    if s.dtype not in _FLOATS:
        raise ShapeError(f"{node.describe()}: scales {s} must be float32, float16 or bfloat16")
    columns = d.shape[1] * 8 // bits
    block = int(a.get("block_size", 128))
    blocks = -(-columns // block)
    if block < 16 or block & (block - 1) or s.shape != (d.shape[0], blocks):
        raise ShapeError(f"{node.describe()}: scales {s} must be [{d.shape[0]}, {blocks}] for {columns} columns "
                         f"in blocks of {block} (a power of 2, at least 16)")
    rank = len(g.types[indices].shape) + 1
    body = NodeBuilder(g, node)
    to_float = DTYPES[s.dtype].onnx

    codes = _unpacked(body, body.add(GATHER, [data, indices], axis=0), bits, rank)  # [..., columns]
    if blocks * block != columns:  # (a last block that ends early: padded to whole blocks)
        codes = body.add(PAD, [codes, body.const(np.array([0] * rank + [0] * (rank - 1) + [blocks * block - columns],
                                                            np.int64))])
    codes = body.reshaped(body.add(CAST, [codes], to=to_float), [0] * (rank - 1) + [blocks, block])
    if zero_points:
        zero = body.add(GATHER, [zero_points, indices], axis=0)
        if d.dtype == "uint8":
            zero = _last(body, _unpacked(body, zero, bits, rank), blocks)
        zero = body.add(CAST, [zero], to=to_float)
    else:
        zero = body.const(np.array(default_zero, np.float32).astype(
            {"float32": np.float32, "float16": np.float16}.get(s.dtype, np.float32)))
        if s.dtype == "bfloat16":
            zero = body.add(CAST, [zero], to=to_float)
    column = body.const(np.array([-1], np.int64))
    if zero_points:
        zero = body.add(UNSQUEEZE, [zero, column])
    scale = body.add(UNSQUEEZE, [body.add(GATHER, [scales, indices], axis=0), column])
    values = body.reshaped(body.add(MUL, [body.add(SUB, [codes, zero]), scale]), [0] * (rank - 1) + [-1])
    if blocks * block != columns:
        values = _last(body, values, columns)
    body.add(IDENTITY, [values], node.outputs[0])
    return body.nodes


register(OpDef(GATHER_BLOCK_QUANTIZED, OPAQUE, expanded_only, expand=_expand))
