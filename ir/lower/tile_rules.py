"""When a GEMM runs on AMX's tile unit, and in what register tiles: the cost rules.

One place for the choice between the tile unit and the vector units (AVX-512 VNNI for int8):
lowering asks `tile_unit` per GEMM (a `tile_unit` knob, so `kiln tune` can overrule the rule)
and `tile_shape` for the register tile the packing and the codegen (codegen_worker/tile_gemm.py)
then share.
"""
from __future__ import annotations

from .builder import KernelBuilder

TILE_STEP_BYTES = 64  # a k step on tiles: each run of k is padded to whole steps (Gemm.tiles)

# The cost rule between AMX's tiles and VNNI (`tile_unit`). Below TILE_MIN_ROWS rows, VNNI: a
# decoding step's one row streams each weight tile through the unit for a single row of
# products. Below TILE_MIN_K_BYTES of k, VNNI: the tiles' one step is 64 cycles against the
# write-back's 1,024 elements, and storing the accumulators from the tiles only adds to it
# (a pointwise conv of 32 channels: 0.188 ms on tiles, 0.140 on VNNI). Below TILE_MIN_USEFUL
# of the products real (the rest meet the zero padding of k's runs to 64 bytes and of columns
# to 16), VNNI: RegNet's convs in groups of 8 channels (runs of 8 bytes padded to 64, 8 of
# 16 columns; 6%) took twice as long on tiles; ResNet's stem (runs of 28 bytes, 44%) 0.6x.
# Measured on an Emerald Rapids Xeon, 2026-12-02.
TILE_MIN_ROWS = 4
TILE_MIN_K_BYTES = 64
TILE_MIN_USEFUL = 0.3


def tile_unit(b: KernelBuilder, m, k_bytes: int, padded_k_bytes: int, n: int, bf16: bool = False) -> bool:
    """Whether an 8-bit GEMM (with bf16, a bfloat16 one) of m rows (an int, or an expression
    of run-time sizes), k_bytes of products per output (padded_k_bytes on tiles) and n columns
    runs on AMX's tile unit (Gemm.tiles), where the target has one: the rule above, or the
    schedule's."""
    if not (b.config.bf16_tiles if bf16 else b.config.int8_tiles):
        return False
    useful = k_bytes / padded_k_bytes * n / (-(-n // 16) * 16)
    pays = (not isinstance(m, int) or m >= TILE_MIN_ROWS) and k_bytes >= TILE_MIN_K_BYTES and useful >= TILE_MIN_USEFUL
    return b.knob("tile_unit", "on" if pays else "off", ("on", "off")) == "on"


def whole_steps(nbytes: int) -> int:
    """nbytes rounded up to whole k steps on tiles."""
    return -(-nbytes // TILE_STEP_BYTES) * TILE_STEP_BYTES


def tile_shape(b: KernelBuilder, n: int) -> tuple[int, int]:
    """(mr, nr) of an 8-bit GEMM on tiles: B's panels as VNNI's (one or two 16-column tiles),
    and rows for 4 accumulator tiles: 2 x 2, or 4 x 1 for a narrow GEMM. (1 x 4 where a tile
    has one tile of rows, panels of 64 columns, was slower, timed interleaved on Emerald
    Rapids: an 8 x 768 x 3072 GEMM 0.058 -> 0.069 ms, ResNet-18's stride-2 14 x 14 conv with
    its rows of 7 pixels 0.072 -> 0.082.)"""
    nr = b.config.tile(n)[1]
    return 4 * 16 * 16 // nr, nr
