"""AMX micro-kernels: an 8-bit or bf16 Gemm's register tile on Intel's tile unit (Gemm.tiles).

A register tile of `rows` x nr (rows <= mr) is ceil(rows / 16) x nr / 16 accumulator tiles
of 16 x 16 int32 or float32 (2 x 2, or 4 x 1 for a 16-column panel), summed over k in steps
of 64 bytes (16 quads, or 16 pairs of bfloat16): per step, A's tiles (16 rows of the step's
bytes, at A's row stride) and B's (the step's quads by 16 columns of the packed panel, at the
panel's row stride of nr * 4 bytes, or B read in place at its row stride b_sk), one
tdpb[su][su]d (tdpbf16ps for bfloat16) per accumulator. The accumulators are then stored to
the stack tile the Gemm's write-back reads, row-major, or for a conv's NCHW stores through a
scratch tile, transposed in vector registers.

The tile registers are named, as onnxruntime's MLAS and oneDNN name them: tmm0 and tmm1 hold
B's tiles, tmm2 and tmm3 A's, tmm4-7 the accumulators. Each register's shape is set by the
tile configuration (ldtilecfg), which a row block loads once before its panels (a shape per
count of rows: the last block of a row may be shorter) and the Gemm releases (tilerelease)
when it ends, so each thread configures its own tiles per phase and holds no tile state
between calls. (LLVM's shape-inferring `.internal` intrinsics instead configure the tiles on
every function's entry and give each register one shape per function: a tile per function
call, with the configuration's 350 cycles each time, ran a 128 x 768 x 768 GEMM at 24% of
the unit's peak.) Every k step is a whole 64 bytes: the lowering pads each run of k to
whole steps with zero weights and leaves A readable that far (ir/loop.py, Gemm.tiles).
The process must have asked Linux for the tile data state first (the entry does, on load:
artifacts/link.py).
"""
from __future__ import annotations

from math import prod

from ..ir.loop import Gemm

TILE_ROWS = 16   # rows of an accumulator or A tile
STEP_QUADS = 16  # k quads per step: a tile row's 64 bytes
ROW_BYTES = 64
DOT = {"u8s8": "tdpbusd", "s8u8": "tdpbsud", "s8s8": "tdpbssd",  # (A's signedness, then B's)
       "bf16": "tdpbf16ps"}  # (pairs of bfloat16 into float32)
B_TILES, A_TILES, ACCUMULATORS = (0, 1), (2, 3), (4, 5, 6, 7)
# A run of k with at most this many steps is unrolled; longer ones are a loop.
UNROLLED_STEPS = 4

TILE_DECLS = (
    "declare void @llvm.x86.ldtilecfg(ptr)",
    "declare void @llvm.x86.tilerelease()",
    "declare void @llvm.x86.tilezero(i8)",
    "declare void @llvm.x86.tileloadd64(i8, ptr, i64)",
    "declare void @llvm.x86.tilestored64(i8, ptr, i64)",
)


def declarations(g: Gemm) -> set:
    return {*TILE_DECLS, f"declare void @llvm.x86.{DOT[g.kind]}(i8, i8, i8)"}


class _Layout:
    """Which tile register holds what for a register tile of `rows` rows."""

    def __init__(self, g: Gemm, rows: int):
        self.heights = [min(TILE_ROWS, rows - r) for r in range(0, rows, TILE_ROWS)]
        self.widths = g.nr // TILE_ROWS
        if len(self.heights) * self.widths > len(ACCUMULATORS) or self.widths > len(B_TILES):
            raise ValueError(f"tile gemm of {rows} x {g.nr}: more than 4 accumulator tiles")

    def accumulator(self, i: int, j: int) -> int:
        return ACCUMULATORS[i * self.widths + j]

    def a_tile(self, i: int) -> int:
        """A's tile i: its own register where there are two B tiles (A stays loaded through the
        step); one per shape where A streams past one B tile (the last may be shorter)."""
        if self.widths > 1:
            return A_TILES[i]
        return A_TILES[0] if self.heights[i] == TILE_ROWS else A_TILES[1]

    def config(self) -> bytes:
        """The 64-byte tile configuration: palette 1, then each register's bytes per row and rows."""
        shapes = {b: (STEP_QUADS, ROW_BYTES) for b in B_TILES[:self.widths]}
        for i, h in enumerate(self.heights):
            shapes[self.a_tile(i)] = (h, ROW_BYTES)
            for j in range(self.widths):
                shapes[self.accumulator(i, j)] = (h, ROW_BYTES)
        cfg = bytearray(64)
        cfg[0] = 1
        for reg, (rows, colsb) in shapes.items():
            cfg[16 + 2 * reg:18 + 2 * reg] = colsb.to_bytes(2, "little")
            cfg[48 + reg] = rows
        return bytes(cfg)


def configure(fe, g: Gemm, rows: int) -> None:
    """Load the tile configuration of a register tile of `rows` rows (before a row block)."""
    cfg = _Layout(g, rows).config()
    name = fe.outlined.get(("tile config", cfg))
    if name is None:
        name = f"@{fe.symbol}_tilecfg{len(fe.outlined)}"
        fe.outlined[("tile config", cfg)] = name
        data = ", ".join(f"i8 {b}" for b in cfg)
        fe.functions.append(f"{name} = private unnamed_addr constant [64 x i8] [{data}], align 64")
    fe.emit(f"call void @llvm.x86.ldtilecfg(ptr {name})")


def release(fe) -> None:
    fe.emit("call void @llvm.x86.tilerelease()")


def tile_microkernel(fe, g: Gemm, a_ptr: str, a_off: str, b_ptr: str, bp: str, m0: str, rows: int, tile: str,
                     vt: str) -> None:
    """The register tile [m0, m0 + rows) x panel `bp` (in B's i32 lanes), its sums stored to
    `tile` for the write-back (FunctionEmitter.gemm), under the configuration `configure`
    loaded for `rows`."""
    lay = _Layout(g, rows)
    for i in range(len(lay.heights)):
        for j in range(lay.widths):
            fe.emit(f"call void @llvm.x86.tilezero(i8 {lay.accumulator(i, j)})")
    runs = g.a_kruns or ((1, 0),)
    total = prod(count for count, _ in runs)
    run_quads = g.k // total
    steps = run_quads // STEP_QUADS
    if g.a_rows:  # (row m0 = row * a_rows + column: its row's offset from the table, then its column's)
        row = fe.int_op("udiv", m0, g.a_rows)
        start = fe.tmp("rowstart")
        fe.emit(f"{start} = load i64, ptr {fe.gep(fe.bufs[g.a_mtab][0], 'i64', row)}, align 8")
        column = fe.int_op("sub nsw", m0, fe.mul_const(row, g.a_rows))
        a_row0 = fe.int_op("add nsw", fe.int_op("add nsw", start, fe.mul_const(column, g.a_sm)), a_off)
    else:  # (the offset of row m0's k = 0, in A's elements)
        a_row0 = fe.int_op("add nsw", fe.mul_const(m0, g.a_sm), a_off)
    a_type, a_bytes = ("bf16", 2) if g.kind == "bf16" else ("i8", 1)  # (A's elements)
    step_elements = ROW_BYTES // a_bytes
    b_row = g.b_sk or g.nr  # (lanes from one k quad or pair of B to the next: packed, or read in place)

    def step(a_at: str, b_at: str) -> None:
        def load(reg: int, ptr: str, typ: str, at: str, stride: int) -> None:
            fe.emit(f"call void @llvm.x86.tileloadd64(i8 {reg}, ptr {fe.gep(ptr, typ, at)}, i64 {stride})")

        def a_tile(i: int) -> int:
            load(lay.a_tile(i), a_ptr, a_type, fe.int_op("add nsw", a_at, i * TILE_ROWS * g.a_sm) if i else a_at,
                 g.a_sm * a_bytes)
            return lay.a_tile(i)

        def b_tile(j: int) -> int:
            load(B_TILES[j], b_ptr, "i32", fe.int_op("add nsw", b_at, j * TILE_ROWS) if j else b_at, b_row * 4)
            return B_TILES[j]

        def dot(i: int, j: int, a: int, b: int) -> None:
            fe.emit(f"call void @llvm.x86.{DOT[g.kind]}(i8 {lay.accumulator(i, j)}, i8 {a}, i8 {b})")
        if lay.widths > 1:  # A's tiles stay through the step, B's two pass them
            a_tiles = [a_tile(i) for i in range(len(lay.heights))]
            for j in range(lay.widths):
                b = b_tile(j)
                for i, a in enumerate(a_tiles):
                    dot(i, j, a, b)
        else:  # one B tile stays, A's stream past it
            b = b_tile(0)
            for i in range(len(lay.heights)):
                dot(i, 0, a_tile(i), b)

    def run(a_at: str, b_at: str) -> None:
        """A run's steps: A's bytes from a_at, B's lanes from b_at (its quad 0)."""
        def at(s) -> tuple:
            if s == 0:
                return a_at, b_at
            if isinstance(s, int):
                return (fe.int_op("add nsw", a_at, s * step_elements),
                        fe.int_op("add nsw", b_at, s * STEP_QUADS * b_row))
            return (fe.int_op("add nsw", a_at, fe.mul_const(s, step_elements)),
                    fe.int_op("add nsw", b_at, fe.mul_const(s, STEP_QUADS * b_row)))
        if steps <= UNROLLED_STEPS:
            for s in range(steps):
                step(*at(s))
            return
        var = f"{g.m_var}.ks{fe.n}"
        fe.loop(var, steps, lambda: step(*at(fe.lookup(var)[1])), "scalar")

    if total == 1:
        run(a_row0, bp)
    else:
        var = f"{g.m_var}.kr{fe.n}"

        def one_run() -> None:
            # (run r's byte offset: its index in each of the runs' dimensions times the stride)
            r = fe.lookup(var)[1]
            offset, left = a_row0, r
            for d, (extent, stride) in enumerate(reversed(runs)):
                index = left if d == len(runs) - 1 else fe.int_op("urem", left, extent)
                if d < len(runs) - 1:
                    left = fe.int_op("udiv", left, extent)
                offset = fe.int_op("add nsw", offset, fe.mul_const(index, stride))
            run(offset, fe.int_op("add nsw", bp, fe.mul_const(r, run_quads * g.nr)))
        fe.loop(var, total, one_run, "scalar")

    sums = tile
    acc, acc_ll = ("f32", "float") if g.kind == "bf16" else ("i32", "i32")  # (the accumulators' element)
    if g.stores_along == "m":  # (row-major from the tiles, then transposed into the write-back's)
        sums = f"%tilesums{len(fe.allocas)}"
        fe.allocas.append(f"{sums} = alloca [{g.mr * g.nr} x {acc_ll}], align 64")
    for i in range(len(lay.heights)):
        for j in range(lay.widths):
            at = fe.gep(sums, acc, str(i * TILE_ROWS * g.nr + j * TILE_ROWS))
            fe.emit(f"call void @llvm.x86.tilestored64(i8 {lay.accumulator(i, j)}, ptr {at}, i64 {g.nr * 4})")
    if g.stores_along == "m":
        regs = [[fe.load_first(fe.gep(sums, acc, str(r * g.nr + v * fe.vw)), acc_ll, fe.vw, fe.vw, 64)
                 for v in range(g.nr // fe.vw)] for r in range(rows)]
        fe.store_registers(g, tile, regs, rows, vt, acc_ll)
