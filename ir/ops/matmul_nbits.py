"""onnxruntime's com.microsoft.MatMulNBits: a MatMul whose B is block-quantized to 2, 4 or 8
bits, as onnxruntime's `MatMulNBitsQuantizer` and onnxruntime-genai's model builder write
every linear layer of an int4 LLM.

B is uint8 [N, blocks, block_size * bits / 8]: column n of the [K, N] weight, `block_size`
codes a block, packed lowest bits first. Each block has a scale (`scales`, [N * blocks] or
[N, blocks], A's float type) and a zero point: packed codes like B's ([N * ceil(blocks *
bits / 8)], uint8), one float each (A's type, [N, blocks]), or, absent, 2^(bits - 1). The
weight is (code - zero point) * scale, Y = A W + bias ([N], optional). The quantized weight
must be a constant.

4-bit codes filling whole blocks of K (what the quantizer writes) stay codes: the node is
an anchor of its own (ir/lower/matmul_nbits.py), and the weights file holds half a byte a
weight. Other widths, and a K that ends inside a block, are dequantized when the model is
built, computing (code - zero point) * scale in float32 and rounding once to A's type
(exact for float32 and, the product of an 8-bit integer and a float16 scale fitting
float32, for float16 too): the node becomes that MatMul, whose weights file holds floats.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..attrs import const_input
from ..graph import Node, ShapeError, TensorType, UnsupportedError
from ..lower.matmul_nbits import lower_matmul_nbits
from .conv_gemm import MATMUL
from .elementwise import ADD
from .node_builder import NodeBuilder, input_at
from .quantize import CONTRIB
from .registry import OUT_EWISE_FUSABLE, OpDef, register

MATMUL_NBITS = CONTRIB + "MatMulNBits"
_A, _B, _SCALES, _ZERO_POINTS, _G_IDX, _BIAS = range(6)


@dataclass(frozen=True)
class Blocks:
    """A MatMulNBits node's weight as block-quantized codes."""
    codes: np.ndarray        # uint8 [N, K]: column n's codes along K
    scales: np.ndarray       # float32 [N, blocks]
    zero_points: np.ndarray  # float32 [N, blocks]
    block_size: int
    bits: int


def unpack_codes(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """The first `count` codes of each row of `packed` (uint8 [..., bytes]), lowest bits first."""
    shifts = np.arange(0, 8, bits, dtype=np.uint8)
    codes = (packed[..., :, None] >> shifts) & np.uint8((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], -1)[..., :count]


def _zero_points(g, node: Node, n: int, blocks: int, bits: int, float_type) -> np.ndarray:
    """The zero point of every block, [N, blocks], as float32."""
    if not input_at(node, _ZERO_POINTS):
        return np.full((n, blocks), 1 << (bits - 1), np.float32)
    zp = const_input(g, node, _ZERO_POINTS, "zero_points", required=True)
    if zp.dtype == np.uint8:
        per_column = -(-blocks * bits // 8)
        if zp.size != n * per_column:
            raise ShapeError(f"{node.describe()}: packed zero_points has {zp.size} bytes, expected {n * per_column} "
                             f"(N={n} columns of ceil({blocks} blocks * {bits} bits / 8))")
        return unpack_codes(zp.reshape(n, per_column), bits, blocks).astype(np.float32)
    if zp.dtype != float_type:
        raise UnsupportedError(f"{node.describe()}: zero_points of {zp.dtype} is not supported (uint8 codes, or "
                               f"{np.dtype(float_type)} like A)")
    if zp.size != n * blocks:
        raise ShapeError(f"{node.describe()}: zero_points has {zp.size} values, expected N * blocks = {n * blocks}")
    return zp.reshape(n, blocks).astype(np.float32)


def _layout(g, node: Node) -> tuple[int, int, int, int]:
    """(K, N, bits, block_size), the inputs' types and shapes checked against them; nothing
    unpacked (type inference runs this on every call of a big model's layers)."""
    a = g.types[node.inputs[_A]]
    k, n, bits, block = (int(node.attrs.get(name, 0)) for name in ("K", "N", "bits", "block_size"))
    if bits not in (2, 4, 8):
        raise UnsupportedError(f"{node.describe()}: bits={bits} is not supported (2, 4, 8)")
    if block < 16 or block & (block - 1):
        raise ShapeError(f"{node.describe()}: block_size={block} must be a power of two, at least 16")
    if len(a.shape) < 2 or a.shape[-1] != k:
        raise ShapeError(f"{node.describe()}: A is {a}; MatMulNBits takes [..., K] with K={k} (attribute K)")
    if a.dtype not in ("float32", "float16"):
        raise UnsupportedError(f"{node.describe()}: A of {a.dtype} is not supported (float32, float16)")
    if input_at(node, _G_IDX):
        raise UnsupportedError(f"{node.describe()}: g_idx (act-order) is not supported")
    blocks = -(-k // block)
    b = const_input(g, node, _B, "B", required=True)
    if b.dtype != np.uint8 or b.size != n * blocks * block * bits // 8:
        raise ShapeError(f"{node.describe()}: B is {b.dtype} {list(b.shape)}, expected uint8 "
                         f"[{n}, {blocks}, {block * bits // 8}] (N, blocks, block_size * bits / 8)")
    scales = const_input(g, node, _SCALES, "scales", required=True)
    if scales.dtype != np.dtype(a.dtype) or scales.size != n * blocks:
        raise ShapeError(f"{node.describe()}: scales is {scales.dtype} {list(scales.shape)}, expected "
                         f"{a.dtype} [{n}, {blocks}] like A")
    return k, n, bits, block


def quantized_blocks(g, node: Node) -> Blocks:
    """The node's weight as its codes, scales and zero points."""
    k, n, bits, block = _layout(g, node)
    blocks = -(-k // block)
    b = const_input(g, node, _B, "B", required=True)
    scales = const_input(g, node, _SCALES, "scales", required=True)
    codes = unpack_codes(b.reshape(n, blocks, -1), bits, block).reshape(n, blocks * block)[:, :k]
    return Blocks(np.ascontiguousarray(codes), scales.reshape(n, blocks).astype(np.float32),
                  _zero_points(g, node, n, blocks, bits, np.dtype(g.types[node.inputs[_A]].dtype)), block, bits)


def dequantized_weight(g, node: Node, blocks: Blocks) -> np.ndarray:
    """The [K, N] weight the codes encode, in A's float type."""
    n, k = blocks.codes.shape
    per_element = np.repeat(np.arange(blocks.scales.shape[1]), blocks.block_size)[:k]
    w = (blocks.codes.astype(np.float32) - blocks.zero_points[:, per_element]) * blocks.scales[:, per_element]
    return np.ascontiguousarray(w.T).astype(g.types[node.inputs[_A]].dtype)


def _keeps_codes(g, node: Node) -> bool:
    """Whether the node runs on its codes (ir/lower/matmul_nbits.py) rather than as a MatMul
    of the dequantized weight: 4 bits in whole blocks."""
    k, _, bits, block = _layout(g, node)
    return bits == 4 and k % block == 0


def _infer_matmul_nbits(g, node, p):
    _layout(g, node)
    a = g.types[node.inputs[_A]]
    return TensorType(a.shape[:-1] + (int(node.attrs["N"]),), a.dtype)


def _fold_matmul_nbits(a, values, g, node):
    out = values[_A].astype(np.float32) @ dequantized_weight(g, node, quantized_blocks(g, node)).astype(np.float32)
    if len(values) > _BIAS and values[_BIAS] is not None:
        out = out + values[_BIAS].astype(np.float32)
    return [out.astype(values[_A].dtype)]


def _expand_matmul_nbits(g, node: Node) -> list[Node] | None:
    if _keeps_codes(g, node):
        return None
    body = NodeBuilder(g, node)
    weight = body.const(dequantized_weight(g, node, quantized_blocks(g, node)))
    bias = input_at(node, _BIAS)
    body.add(MATMUL, [node.inputs[_A], weight], "" if bias else node.outputs[0])
    if bias:
        body.add(ADD, [body.nodes[-1].outputs[0], bias], node.outputs[0])
    return body.nodes


register(OpDef(MATMUL_NBITS, OUT_EWISE_FUSABLE, _infer_matmul_nbits, _fold_matmul_nbits, expand=_expand_matmul_nbits,
               anchor=lambda b, node, store, out: lower_matmul_nbits(b, node, store, quantized_blocks(b.g, node))))
