"""onnxruntime's com.microsoft.MatMulNBits: a MatMul whose B is block-quantized to 2, 4 or 8
bits, as onnxruntime's `MatMulNBitsQuantizer` and onnxruntime-genai's model builder write
every linear layer of an int4 LLM.

B is uint8 [N, blocks, block_size * bits / 8]: column n of the [K, N] weight, `block_size`
codes a block, packed lowest bits first. Each block has a scale (`scales`, [N * blocks] or
[N, blocks], A's float type) and a zero point: packed codes like B's ([N * ceil(blocks *
bits / 8)], uint8), one float each (A's type, [N, blocks]), or, absent, 2^(bits - 1). The
weight is (code - zero point) * scale, Y = A W + bias ([N], optional).

The quantized weight must be a constant; Kiln dequantizes it when it builds, computing
(code - zero point) * scale in float32 and rounding once to A's type (exact for float32
and, the product of an 8-bit integer and a float16 scale fitting float32, for float16 too),
and the op is that MatMul. The weights file then holds the weight in A's type: 8 times the
bytes of 4-bit codes for float32.
"""
from __future__ import annotations

import numpy as np

from ..attrs import const_input
from ..graph import Node, ShapeError, UnsupportedError
from .conv_gemm import MATMUL
from .elementwise import ADD
from .quantize import CONTRIB, NodeBuilder
from .registry import OPAQUE, OpDef, expanded_only, register

MATMUL_NBITS = CONTRIB + "MatMulNBits"
_A, _B, _SCALES, _ZERO_POINTS, _G_IDX, _BIAS = range(6)


def _input(node: Node, index: int) -> str:
    return node.inputs[index] if index < len(node.inputs) else ""


def unpack_codes(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """The first `count` codes of each row of `packed` (uint8 [..., bytes]), lowest bits first."""
    shifts = np.arange(0, 8, bits, dtype=np.uint8)
    codes = (packed[..., :, None] >> shifts) & np.uint8((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], -1)[..., :count]


def _zero_points(g, node: Node, n: int, blocks: int, bits: int, float_type) -> np.ndarray:
    """The zero point of every block, [N, blocks], as float32."""
    if not _input(node, _ZERO_POINTS):
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


def dequantized_weight(g, node: Node) -> np.ndarray:
    """B as the [K, N] weight it encodes, in A's float type."""
    a = g.types[node.inputs[_A]]
    k, n, bits, block = (int(node.attrs.get(name, 0)) for name in ("K", "N", "bits", "block_size"))
    if bits not in (2, 4, 8):
        raise UnsupportedError(f"{node.describe()}: bits={bits} is not supported (2, 4, 8)")
    if block < 16 or block & (block - 1):
        raise ShapeError(f"{node.describe()}: block_size={block} must be a power of two, at least 16")
    if a.shape[-1] != k:
        raise ShapeError(f"{node.describe()}: A's last dim is {a.shape[-1]}, attribute K is {k}")
    if _input(node, _G_IDX):
        raise UnsupportedError(f"{node.describe()}: g_idx (act-order) is not supported")
    blocks = -(-k // block)
    b = const_input(g, node, _B, "B", required=True)
    if b.dtype != np.uint8 or b.size != n * blocks * block * bits // 8:
        raise ShapeError(f"{node.describe()}: B is {b.dtype} {list(b.shape)}, expected uint8 "
                         f"[{n}, {blocks}, {block * bits // 8}] (N, blocks, block_size * bits / 8)")
    float_type = np.dtype(a.dtype)
    scales = const_input(g, node, _SCALES, "scales", required=True)
    if scales.dtype != float_type or scales.size != n * blocks:
        raise ShapeError(f"{node.describe()}: scales is {scales.dtype} {list(scales.shape)}, expected "
                         f"{float_type} [{n}, {blocks}] like A")
    codes = unpack_codes(b.reshape(n, blocks, -1), bits, block).astype(np.float32)
    zero_points = _zero_points(g, node, n, blocks, bits, float_type)
    w = (codes - zero_points[:, :, None]) * scales.reshape(n, blocks, 1).astype(np.float32)
    return np.ascontiguousarray(w.reshape(n, blocks * block)[:, :k].T).astype(float_type)


def _expand_matmul_nbits(g, node: Node) -> list[Node]:
    if g.types[node.inputs[_A]].dtype not in ("float32", "float16"):
        raise UnsupportedError(f"{node.describe()}: A of {g.types[node.inputs[_A]].dtype} is not supported "
                               "(float32, float16)")
    body = NodeBuilder(g, node)
    weight = body.const(dequantized_weight(g, node))
    bias = _input(node, _BIAS)
    body.add(MATMUL, [node.inputs[_A], weight], "" if bias else node.outputs[0])
    if bias:
        body.add(ADD, [body.nodes[-1].outputs[0], bias], node.outputs[0])
    return body.nodes


register(OpDef(MATMUL_NBITS, OPAQUE, expanded_only, expand=_expand_matmul_nbits))
