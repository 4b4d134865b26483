"""bfloat16 products for float32 models: the `precision="bf16"` build option.

The contract, on every target: a GEMM's operands are rounded to bfloat16 (to nearest, ties to
even), their products (exact in float32: 8 significant bits each) are summed in float32, and
everything around them (the epilogue's bias, activation and residual, softmax,
normalizations, elementwise chains) stays float32. The weights are rounded once, here.

- On a target with AMX-BF16 the GEMM runs on the tile unit (Gemm kind "bf16" on tiles:
  `tdpbf16ps`): A is converted once per call into a bfloat16 workspace, its rows padded to
  whole 64-byte steps (32 elements), and B is packed at build time as bfloat16 pairs,
  [panel][k / 2][nr][2] (two consecutive k of one column per 32-bit lane, zero past K and
  N): half the weight bytes of float32.
- Elsewhere the same numbers through the float32 kernel: A rounded (`round_bf16`) into a
  float32 workspace, B's rounded values packed as float32. No faster than float32 there yet.

MatMul and Gemm with constant weights take it (ir/lower/gemm.py, bf16_product); convs and
products of two activations stay float32. This module holds the numbers: rounding and
packing, in numpy, at build time.
"""
from __future__ import annotations

import numpy as np


PAIR_STEP = 32  # bfloat16 elements in a tile row's 64 bytes: A's rows are padded to whole steps


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> the bits of the nearest bfloat16 (ties to even), as uint16; NaN stays NaN."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), bits)


def bf16_rounded(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16, as float32."""
    return (bf16_bits(x).astype(np.uint32) << 16).view(np.float32)


def pack_pair_panels(mat: np.ndarray, k_padded: int, nr: int) -> np.ndarray:
    """[K, N] float32 -> uint16 bfloat16 bits [ceil(N/nr), k_padded/2, nr, 2]: each 32-bit lane
    of a panel row holds two consecutive k of one column. Zero past K and N."""
    k, n = mat.shape
    panels = -(-n // nr)
    padded = np.zeros((k_padded, panels * nr), np.uint16)
    padded[:k, :n] = bf16_bits(mat)
    return np.ascontiguousarray(padded.reshape(k_padded // 2, 2, panels, nr).transpose(2, 0, 3, 1))
