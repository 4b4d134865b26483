"""AMX micro-kernels: an 8-bit Gemm's register tile on Intel's tile unit (Gemm.tiles).

A register tile of `rows` x nr (rows <= mr) is ceil(rows / 16) x nr / 16 accumulator tiles
of 16 x 16 int32, summed over k in steps of up to 64 bytes (16 quads): per step, A's tiles
(16 rows by the step's bytes, at A's row stride) and B's (the step's quads by 16 columns of
the packed panel, at the panel's row stride of nr * 4 bytes), one tdpb[su][su]d per
accumulator. The dimension with fewer tiles stays loaded through the step and the other
streams past it, so a step holds at most 4 accumulators + 2 + 1 of the 8 tile registers
(a 1 x 4 tile: 4 + 1 + 1). The accumulators are then stored to the stack tile the Gemm's
write-back reads, row-major, or transposed in vector registers for a conv's NCHW stores.

Every tile shape is a constant: the last step of a run of k (its quads modulo 16) and the
last tile of rows get shapes of their own. LLVM writes the tile configuration (ldtilecfg)
on the function's entry from those shapes and releases the tiles (tilerelease) before it
returns, so each thread configures its own tiles per call and holds no tile state between
calls. The process must have asked Linux for the tile data state first (the entry does, on
load: artifacts/link.py).
"""
from __future__ import annotations

from math import prod

from ..ir.loop import Gemm

TILE_ROWS = 16   # rows of an accumulator or A tile
STEP_QUADS = 16  # k quads per step: a tile row's 64 bytes
ROW_BYTES = 64
DOT = {"u8s8": "tdpbusd", "s8u8": "tdpbsud", "s8s8": "tdpbssd"}  # (A's signedness, then B's)
# A run of k with more whole steps than this is a loop; fewer are unrolled.
UNROLLED_STEPS = 4

TILE_DECLS = (
    "declare x86_amx @llvm.x86.tilezero.internal(i16, i16)",
    "declare x86_amx @llvm.x86.tileloadd64.internal(i16, i16, ptr, i64)",
    "declare void @llvm.x86.tilestored64.internal(i16, i16, ptr, i64, x86_amx)",
)


def declarations(g: Gemm) -> set:
    return {*TILE_DECLS, f"declare x86_amx @llvm.x86.{DOT[g.kind]}.internal(i16, i16, i16, x86_amx, x86_amx, x86_amx)"}


def tile_microkernel(fe, g: Gemm, a_ptr: str, a_off: str, b_ptr: str, bp: str, m0: str, rows: int, tile: str,
                     vt: str) -> None:
    """The register tile [m0, m0 + rows) x panel `bp` (in B's i32 lanes), its sums stored to
    `tile` for the write-back (FunctionEmitter.gemm): a call of the tile function of its
    whole k steps, then one of its last steps if k's runs leave some quads."""
    runs = g.a_kruns or ((1, 0),)
    run_quads = g.k // prod(count for count, _ in runs)
    whole, rest = divmod(run_quads, STEP_QUADS)
    sums = tile
    if g.stores_along == "m":  # (row-major from the tiles, then transposed into the write-back's)
        sums = f"%tilesums{len(fe.allocas)}"
        fe.allocas.append(f"{sums} = alloca [{g.mr * g.nr} x i32], align 64")
    a_row0 = fe.int_op("add nsw", fe.mul_const(m0, g.a_sm), a_off)  # (byte offset of row m0's k = 0)
    parts = ([(STEP_QUADS, 0, whole)] if whole else []) + ([(rest, whole * STEP_QUADS, 1)] if rest else [])
    for n, (step, first, count) in enumerate(parts):
        name = _tile_function(fe, g, rows, step, first, count, runs, run_quads, accumulate=n > 0)
        fe.emit(f"call void @{name}(ptr {a_ptr}, ptr {b_ptr}, ptr {sums}, i64 {a_row0}, i64 {bp})")
    if g.stores_along == "m":
        regs = [[fe.load_first(fe.gep(sums, "i32", str(r * g.nr + v * fe.vw)), "i32", fe.vw, fe.vw, 64)
                 for v in range(g.nr // fe.vw)] for r in range(rows)]
        fe.store_registers(g, tile, regs, rows, vt, "i32")


def _tile_function(fe, g: Gemm, rows: int, step: int, first: int, count: int, runs: tuple, run_quads: int,
                   accumulate: bool) -> str:
    """`void (ptr a, ptr b, ptr sums, i64 a_row0, i64 bp)`: over every run of k, `count` steps
    of `step` quads from the run's quad `first`, into accumulators that start at zero or, with
    `accumulate`, from `sums` (row-major [rows][nr] int32), where they are stored again.

    A function of its own for each tile shape: LLVM configures the tiles once per function
    and gives each tile register one shape for the whole function, so a tile of other rows
    or a step of other bytes beside these would need registers of its own (10 of the 8)."""
    key = ("tiles", id(g), rows, step, first, count, accumulate)
    name = fe.outlined.get(key)
    if name is not None:
        return name
    name = f"{fe.symbol}_amx{len(fe.outlined)}"
    fe.outlined[key] = name
    saved = (fe.lines, fe.block)
    fe.lines, fe.block = [], "entry"
    a_ptr, b_ptr, sums, a_row0, bp = "%amx.a", "%amx.b", "%amx.sums", "%amx.a_row0", "%amx.bp"
    heights = [min(TILE_ROWS, rows - r) for r in range(0, rows, TILE_ROWS)]
    widths = g.nr // TILE_ROWS
    kb = 4 * step

    def at_sums(i: int, j: int) -> str:
        return fe.gep(sums, "i32", str(i * TILE_ROWS * g.nr + j * TILE_ROWS))
    if accumulate:
        accs = [[_call(fe, f"tileloadd64.internal(i16 {h}, i16 {ROW_BYTES}, ptr {at_sums(i, j)}, i64 {g.nr * 4})")
                 for j in range(widths)] for i, h in enumerate(heights)]
    else:
        accs = [[_call(fe, f"tilezero.internal(i16 {h}, i16 {ROW_BYTES})") for _ in range(widths)] for h in heights]

    def one_step(accs: list, a_at: str, b_at: str) -> list:
        def a_tile(i: int) -> str:
            at = fe.int_op("add nsw", a_at, i * TILE_ROWS * g.a_sm) if i else a_at
            return _call(fe, f"tileloadd64.internal(i16 {heights[i]}, i16 {kb}, ptr {fe.gep(a_ptr, 'i8', at)}, "
                             f"i64 {g.a_sm})")

        def b_tile(j: int) -> str:
            at = fe.int_op("add nsw", b_at, j * TILE_ROWS) if j else b_at
            return _call(fe, f"tileloadd64.internal(i16 {step}, i16 {ROW_BYTES}, ptr {fe.gep(b_ptr, 'i32', at)}, "
                             f"i64 {g.nr * 4})")

        def dot(i: int, j: int, a: str, b: str) -> str:
            return _call(fe, f"{DOT[g.kind]}.internal(i16 {heights[i]}, i16 {ROW_BYTES}, i16 {kb}, "
                             f"x86_amx {accs[i][j]}, x86_amx {a}, x86_amx {b})")
        out = [[None] * widths for _ in heights]
        if len(heights) <= widths:  # A's tiles stay, B's stream
            a_tiles = [a_tile(i) for i in range(len(heights))]
            for j in range(widths):
                b = b_tile(j)
                for i, a in enumerate(a_tiles):
                    out[i][j] = dot(i, j, a, b)
        else:
            b_tiles = [b_tile(j) for j in range(widths)]
            for i in range(len(heights)):
                a = a_tile(i)
                for j, b in enumerate(b_tiles):
                    out[i][j] = dot(i, j, a, b)
        return out

    def run(accs: list, a_at: str, b_at: str) -> list:
        """A run's steps: A's bytes from a_at, B's lanes from b_at (its quad 0)."""
        if first:
            a_at, b_at = fe.int_op("add nsw", a_at, 4 * first), fe.int_op("add nsw", b_at, first * g.nr)
        if count <= UNROLLED_STEPS:
            for s in range(count):
                accs = one_step(accs, fe.int_op("add nsw", a_at, s * kb) if s else a_at,
                                fe.int_op("add nsw", b_at, s * step * g.nr) if s else b_at)
            return accs
        return carried_loop(fe, count, accs, lambda s, accs: one_step(
            accs, fe.int_op("add nsw", a_at, fe.mul_const(s, kb)), fe.int_op("add nsw", b_at, fe.mul_const(s, step * g.nr))))

    total = prod(c for c, _ in runs)
    if total == 1:
        accs = run(accs, a_row0, bp)
    else:
        def one_run(r: str, accs: list) -> list:
            # (run r's byte offset: its index in each of the runs' dimensions times the stride)
            offset, left = a_row0, r
            for d, (extent, stride) in enumerate(reversed(runs)):
                index = left if d == len(runs) - 1 else fe.int_op("urem", left, extent)
                if d < len(runs) - 1:
                    left = fe.int_op("udiv", left, extent)
                offset = fe.int_op("add nsw", offset, fe.mul_const(index, stride))
            return run(accs, offset, fe.int_op("add nsw", bp, fe.mul_const(r, run_quads * g.nr)))
        accs = carried_loop(fe, total, accs, one_run)
    for i, h in enumerate(heights):
        for j in range(widths):
            fe.emit(f"call void @llvm.x86.tilestored64.internal(i16 {h}, i16 {ROW_BYTES}, ptr {at_sums(i, j)}, "
                    f"i64 {g.nr * 4}, x86_amx {accs[i][j]})")
    body, (fe.lines, fe.block) = fe.lines, saved
    params = (f"ptr noalias nocapture readonly {a_ptr}, ptr noalias nocapture readonly {b_ptr}, "
              f"ptr noalias nocapture {sums}, i64 {a_row0}, i64 {bp}")
    fe.functions.append("\n".join([f"define internal void @{name}({params}) #2 {{", "entry:", *body, "  ret void",
                                   "}"]))
    return name


def _call(fe, call: str) -> str:
    v = fe.tmp("tl")
    fe.emit(f"{v} = call x86_amx @llvm.x86.{call}")
    return v


def carried_loop(fe, count: int, accs: list, body) -> list:
    """A loop of `count` (>= 1) iterations carrying the accumulator tiles in phis:
    body(i, accs) -> the next accumulators (it may emit blocks of its own)."""
    pred = fe.block
    fe.n += 1
    head, exit_ = f"T{fe.n}.body", f"T{fe.n}.exit"
    fe.emit(f"br label %{head}")
    fe.label(head)
    i, inext = fe.tmp("ti"), fe.tmp("tinext")
    flat = [a for row in accs for a in row]
    phis = [fe.tmp("tacc") for _ in flat]
    at = len(fe.lines)
    fe.lines += [None] * (1 + len(flat))  # (the phis: written once the latch block is known)
    shape = [len(row) for row in accs]
    nested, k = [], 0
    for width in shape:
        nested.append(phis[k:k + width])
        k += width
    out = body(i, nested)
    latch = fe.block
    fe.lines[at] = f"  {i} = phi i64 [0, %{pred}], [{inext}, %{latch}]"
    new = [a for row in out for a in row]
    for n, (phi, first, last) in enumerate(zip(phis, flat, new)):
        fe.lines[at + 1 + n] = f"  {phi} = phi x86_amx [{first}, %{pred}], [{last}, %{latch}]"
    fe.emit(f"{inext} = add nuw nsw i64 {i}, 1")
    more = fe.tmp("tmore")
    fe.emit(f"{more} = icmp ult i64 {inext}, {count}")
    fe.emit(f"br i1 {more}, label %{head}, label %{exit_}")
    fe.label(exit_)
    return out
