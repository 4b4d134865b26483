"""How each kernel phase divides across threads, decided at compile time from its work.

A phase that divides (ir/loop.py, "Threads") is split only where each part is worth a
thread: handing a part to an awake worker costs a quarter of a microsecond, but the part
then reads data another core wrote (from that core's cache), so a part should hold several
microseconds of work. The entry function then uses
min(pieces, threads) parts at run time; a small kernel keeps pieces = 1 and never leaves
the calling thread. The work estimate is coarse on purpose: operations per element of the
loop nest (a call such as exp counts as several), multiply-adds for a Gemm.
"""
from __future__ import annotations

from .loop import (TRANSPOSE_LANES, Assign, Call, Deinterleave, Expr, For, Gemm, If, Kernel, Let, Local, Store,
                   TransposeBlock, WindowDot, extent_value, field_names, of_symbols, parallel_extent, phases)

MIN_PIECE_WORK = 150_000  # estimated operations in one part
MAX_PIECES = 64
VECTOR_GRAIN = 64  # a parallel loop that is also the vectorized one splits on multiples of this
_CALL_COST = 8
# A GEMM of one row (a batch-1 layer, a decoding step) streams B from L2 or memory: on an AVX2
# core (Zen 4, AVX-512 hidden) a 784 x 256 float32 B took 17.4 us, 11.5 G elements/s, where
# a GEMM that reuses its panels multiplies-adds at about 43 G/s (512 x 1024 x 1024 in 12.6 ms;
# work counts half an operation each): about 2 operations an element. Counted as 1, that
# layer ran on one thread; as 2 it divides, 0.028 -> 0.018 ms for the 3-layer MLP at 2 threads.
STREAMED_LOAD_WORK = 2


def _expr_work(e, seen: set) -> int:
    """Operations in an expression, each shared subexpression once (it is computed once)."""
    if id(e) in seen or not isinstance(e, Expr):
        return 0
    seen.add(id(e))
    own = _CALL_COST if isinstance(e, Call) else 1
    children = e.args if isinstance(e, Call) else [getattr(e, n) for n in field_names(e)]
    return own + sum(_expr_work(c, seen) for c in children)


def work(stmt, symbols: tuple = ()) -> int:
    """Estimated operations to run a statement (or a tuple of them) once; run-time extents
    count at the values `symbols` gives them (their bounds)."""
    if isinstance(stmt, tuple):
        return sum(work(s, symbols) for s in stmt)
    if isinstance(stmt, For):  # (a loop to a count the kernel computed: its body counted once)
        trips = extent_value(stmt.extent, symbols) if of_symbols(stmt.extent) else 1
        return trips * max(work(stmt.body, symbols), 1)
    if isinstance(stmt, Gemm):
        m, n = extent_value(stmt.m, symbols), extent_value(stmt.n, symbols)
        macs = m * n * stmt.k * {"f32": 1, "bf16": 2}.get(stmt.kind, 4)  # (k in elements, pairs or quads)
        # (a row or two stream all of B for a multiply-add or two per element: the load is
        # their cost, STREAMED_LOAD_WORK an element)
        return max(macs // 2, STREAMED_LOAD_WORK * n * stmt.k) + m * n * max(work(stmt.epilogue, symbols), 1)
    if isinstance(stmt, WindowDot):  # multiply-adds, counted as a Gemm's
        return stmt.width * (stmt.rows * stmt.taps // 2 + 1)
    if isinstance(stmt, Deinterleave):  # a load and a store per element, as the loop it replaces
        return 2 * extent_value(stmt.count, symbols) * stmt.phases
    if isinstance(stmt, TransposeBlock):  # a load, shuffles and a store per row
        return 6 * TRANSPOSE_LANES
    if isinstance(stmt, If):
        return 1 + max(work(stmt.then, symbols), work(stmt.orelse, symbols))
    if isinstance(stmt, Store):
        return 1 + _expr_work(stmt.value, set())
    if isinstance(stmt, (Let, Assign, Local)):
        return _expr_work(stmt.value if not isinstance(stmt, Local) else stmt.init, set())
    return 1


def thread_plan(kernel: Kernel, symbols: tuple = ()) -> list[tuple]:
    """(extent, pieces, grain) of each phase of the kernel, in order: pieces 1 runs it whole.

    A phase whose work depends on symbols (its extent, or a Gemm's m) gets a fourth item,
    (scale, its value at the bounds, the work at the bounds): at run time the work is that
    times scale / value, and the pieces follow it, up to those at the bounds (the fourth item
    is None where it does not). A guarded phase's plan has its condition as a fifth item.
    `symbols`: the symbols' greatest values."""
    plan = []
    per_piece = int(kernel.option("piece_work", MIN_PIECE_WORK))  # (a tuned schedule's, ir/schedule.py)
    for part in phases(kernel.body)[1]:
        guard = ()
        if isinstance(part, If):  # (a guarded phase: planned as its loop or Gemm)
            guard, part = (part.cond,), part.then[0]
        extent = parallel_extent(part)
        grain = VECTOR_GRAIN if isinstance(part, For) and part.kind == "vectorize" else 1
        scale = extent if isinstance(part, For) else 0
        if isinstance(part, Gemm):  # (a run-time m, or n: the pixels of a 1x1 conv read in place)
            scale = part.m if not isinstance(part.m, int) else part.n
        at_bound = extent_value(extent, symbols) if extent else 0
        total = work(part, symbols)
        pieces = min(at_bound // grain, total // per_piece, MAX_PIECES) if at_bound > 1 else 1
        if isinstance(scale, int) and not guard:
            plan.append((max(extent, 1), max(pieces, 1), grain))
        elif isinstance(scale, int):
            plan.append((max(extent, 1), max(pieces, 1), grain, None, *guard))
        else:
            plan.append((extent, max(pieces, 1), grain, (scale, max(extent_value(scale, symbols), 1), total), *guard))
    return plan
