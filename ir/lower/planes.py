"""Bordered copies of 2-D planes, for window kernels that run along output rows (the
depthwise convolution, pooling): once a plane is copied with its border filled, every tap
of a window reads a contiguous run of the copy, with no bounds checks. A size may be an int or,
over sizes known at run time only, an i64 expression of the symbols."""
from __future__ import annotations

from ..loop import Const, Deinterleave, For, If, Let, Load, Store, Var, add, cmp, fbin, flat_index, mul, sub
from .builder import KernelBuilder

# A window kernel (a depthwise conv, a strided pool) whose bordered copy of a channel's plane
# takes at least this many bytes copies into a ring of the last few padded rows instead,
# each output row's new rows just before it. Measured against the whole plane (static sizes,
# 1 thread, a 3x3 stride-2 depthwise conv): 96 x 256 x 256 0.35x its time, 96 x 160 x 160
# 0.59x, 64 x 128 x 128 (67 KB) 0.86x, 96 x 112 x 112 (52 KB) 0.96x, but 32 x 80 x 80 (27 KB)
# 1.10x and 576 x 14 x 14 2.8x: a plane within L1 copies faster whole, its rows' loops
# unrolled. Stride 1: 32 x 256 x 256 0.86x, 144 x 128 x 128 0.87x, 96 x 112 x 112 0.78x, 32
# x 160 x 160 1.01x.
RING_MIN_PLANE_BYTES = 48 * 1024


def ring_when(ring: int, plane_bytes, bound_bytes: int):
    """Whether a window kernel copies into a ring of `ring` rows rather than whole planes of
    `plane_bytes` (`bound_bytes` at the sizes' bounds): True or False when building, else
    (over run-time sizes that straddle RING_MIN_PLANE_BYTES) a condition each call decides."""
    if not ring or bound_bytes < RING_MIN_PLANE_BYTES:
        return False
    if isinstance(plane_bytes, int):
        return True
    return cmp("ge", plane_bytes, Const(RING_MIN_PLANE_BYTES))


def rows_through_a_ring(b: KernelBuilder, copy_row: tuple, i: str, r: str, oh, sh: int, ring: int,
                        output_row: tuple) -> tuple:
    """Output rows r < oh over a ring of the last `ring` padded rows: before output row r, the
    padded rows its window reaches that no earlier row did (copy_row copies padded row Var(i)
    into its ring slot): the first ring - fresh before row 0, then fresh = min(sh, ring) a row.
    A ring of a few rows stays in L1, where a whole plane's copy went to L2 and back
    (MobileNetV2's 96-channel stride-2 depthwise conv at 512 x 512: 3.23 -> 1.12 ms)."""
    fresh, k = min(sh, ring), b.fresh("k")
    before = For(k, fresh, (Let(i, add(mul(Var(r), sh), add(Var(k), ring - fresh))), *copy_row))
    return For(k, ring - fresh, (Let(i, Var(k)), *copy_row)), For(r, oh, (before, *output_row))


def _least(a, b):
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else fbin("min", a, b)


def size_max(a, b):
    """The greater of two sizes: an int, or over run-time sizes an expression."""
    return max(a, b) if isinstance(a, int) and isinstance(b, int) else fbin("max", a, b)


def _minus(a, b):
    return a - b if isinstance(a, int) and isinstance(b, int) else sub(a, b)


def phase_split_size(h, w, pads, sw: int) -> tuple:
    """(rows, slots a phase) of phase_split_copy's copy of a plane of [h, w] with `pads`
    (top, left, bottom, right) at column stride sw: ints, or expressions of run-time sizes
    (// a division of non-negative sizes)."""
    pt, pl, pb, pr = pads
    return h + pt + pb, (w + pl + pr + sw - 1) // sw


def plane_rows(src: str, first_channel, h, w) -> tuple:
    """(row_start, read) of float32 planes of [h, w] in `src` from channel `first_channel` on,
    as phase_split_copy takes them: row_start(c, i) is (src, the offset of element (c, i, 0)),
    read(c, i, j) that element."""
    def row_start(c, i):
        return src, add(mul(add(first_channel, c), mul(h, w)), mul(i, w))

    def read(c, i, j):
        return Load(src, add(row_start(c, i)[1], j))
    return row_start, read


def phase_split_copy(b: KernelBuilder, read, channels: int, h: int, w: int, pt: int, pl: int, sw: int,
                     hp: int, wq: int, dest: str, row_start=None, border=Const(0.0, "f32"), dest_off=Const(0),
                     least_width: int = 1) -> For:
    """Copy `channels` planes of [h, w] into dest[dest_off:] as [channel][hp][sw][wq] with a border of `border`:
    padded row i, column phase ph, slot t holds input (i - pt, t*sw + ph - pl), so along an
    output row of a window strided by sw, a tap's inputs are contiguous. `read(c, i, j)` is
    input element (c, i, j) as float32; where the input is float32 read as it is,
    `row_start(c, i)` gives (its buffer, the offset of element (c, i, 0)), and the slots
    every phase fills are one Deinterleave. `least_width`: the least w over run-time sizes.
    Returns the loop over channels (parallel)."""
    c, i = b.fresh("c"), b.fresh("y")
    row_in, inside, border_row = phase_split_row(b, read, c, i, Var(i), hp, channels, h, w, pt, pl, sw, wq, dest,
                                                 row_start, border, dest_off, least_width)
    if _rows_to_their_end(w, row_start, least_width, sw):
        # (the rows above, in and below the input as loops of their own: a test per row in
        # one loop left LLVM a dozen addresses to step and spill per row)
        j = b.fresh("y")
        below = (Let(i, add(Var(j), add(h, pt))), *border_row)
        rows = (For(i, pt, border_row), For(j, h, (Let(i, add(Var(j), pt)), *inside)),
                For(j, _minus(hp, add(h, pt)), below))
        return For(c, channels, rows, parallel=True)
    return For(c, channels, (For(i, hp, (If(row_in, inside, border_row),)),), parallel=True)


def phase_split_row(b: KernelBuilder, read, c: str, i: str, slot, rows, channels: int, h, w, pt: int, pl: int,
                    sw: int, wq, dest: str, row_start=None, border=Const(0.0, "f32"), dest_off=Const(0),
                    least_width: int = 1) -> tuple:
    """phase_split_copy's copy of padded row Var(i) of channel Var(c) into row `slot` of its
    channel's `rows` (all hp of them, or a ring of the last few): (whether the row is one of the
    input's, its statements if it is, its statements if it is border)."""
    t = b.fresh("t")
    row = sub(Var(i), pt)

    def slots(ph: int, first, count, load: bool) -> tuple:
        if isinstance(count, int) and count <= 0:
            return ()
        at = add(dest_off, flat_index([Var(c), slot, Const(ph), add(Var(t), first)], [channels, rows, sw, wq]))
        col = sub(add(mul(add(Var(t), first), sw), ph), pl)
        return (For(t, count, (Store(dest, at, read(Var(c), row, col) if load else border),), "vectorize"),)
    border_row = tuple(s for ph in range(sw) for s in slots(ph, 0, wq, False))
    row_in = fbin("and", cmp("ge", Var(i), Const(pt)), cmp("lt", Var(i), add(h, pt)))
    if _rows_to_their_end(w, row_start, least_width, sw):
        inside = _row_to_its_end(slots, row_start(Var(c), row), dest, dest_off, [Var(c), slot], [channels, rows],
                                 w, pl, sw, wq, border)
        return row_in, inside, border_row
    spans = []  # per phase, the slots [lo, hi) that hold input
    for ph in range(sw):
        # (lo <= wq: a phase's first input slot is within the padded row, whose input is not empty)
        lo = max(-(-(pl - ph) // sw), 0) if not isinstance(wq, int) else min(max(-(-(pl - ph) // sw), 0), wq)
        last = (w + sw - 1 - ph + pl) // sw  # (the phase's slots up to its last input column; non-negative)
        spans.append((lo, _least(size_max(last, lo), wq)))
    # The slots every phase loads are one loop storing all phases: LLVM reads a run of the
    # row as whole vectors and deinterleaves them, where a loop per phase was a strided
    # gather it chose to run as scalar moves.
    lo_all, hi_all = max(lo for lo, _ in spans), spans[0][1]
    for _, hi in spans[1:]:
        hi_all = _least(hi_all, hi)
    if isinstance(hi_all, int) and hi_all <= lo_all:
        lo_all = hi_all = wq
    elif not isinstance(hi_all, int):
        hi_all = size_max(hi_all, lo_all)  # (no slot every phase loads: an empty run)
    inside = []
    for ph, (lo, hi) in enumerate(spans):
        inside += [*slots(ph, 0, lo, False), *slots(ph, lo, size_max(_minus(_least(hi, lo_all), lo), 0), True),
                   *slots(ph, size_max(hi_all, lo), _minus(hi, size_max(hi_all, lo)), True),
                   *slots(ph, hi, _minus(wq, hi), False)]
    # (over a row whose length is known at run time only, the run may be empty)
    some = not isinstance(hi_all, int) or hi_all > lo_all
    if some and row_start is not None:
        src, start = row_start(Var(c), row)
        inside.append(Deinterleave(src, add(start, lo_all * sw - pl), dest,
                                   add(dest_off, flat_index([Var(c), slot, Const(0), Const(lo_all)],
                                                            [channels, rows, sw, wq])), wq, sw, _minus(hi_all, lo_all)))
    elif some:
        every = tuple(s for ph in range(sw) for s in slots(ph, lo_all, _minus(hi_all, lo_all), True)[0].body)
        inside.append(For(t, _minus(hi_all, lo_all), every, "forced_vector"))
    return row_in, tuple(inside), border_row


def _rows_to_their_end(w, row_start, least_width: int, sw: int) -> bool:
    """Whether a row is copied by _row_to_its_end: a run-time width of float32 input read as
    it is, every width at least sw - 1 (the slots before the Deinterleave within the row)."""
    return not isinstance(w, int) and row_start is not None and least_width >= sw - 1


def _row_to_its_end(slots, source: tuple, dest: str, dest_off, at: list, sizes: list, w, pl: int, sw: int, wq,
                    border: Const) -> tuple:
    """A padded row's copy over a run-time width w: the few slots before the first that every
    phase loads, one by one (a count known when compiling), then one Deinterleave of every
    phase's slots from there to the row's end, which reads the input only up to its last
    column: the slots past it (the right border) take the border value in the same stores.
    Split into runs of run-time length, the right end took four more loops a row (two of
    them gathers): a 14-wide stride-2 row's copy cost more than its output row."""
    lo = [-(-(pl - ph) // sw) for ph in range(sw)]
    lo_all = max(lo)
    stmts = [s for ph in range(sw) for s in (*slots(ph, 0, lo[ph], False), *slots(ph, lo[ph], lo_all - lo[ph], True))]
    src, start = source
    first = lo_all * sw - pl  # (the input column of slot lo_all's phase 0; in [0, sw))
    stmts.append(Deinterleave(src, add(start, first), dest,
                              add(dest_off, flat_index([*at, Const(0), Const(lo_all)], [*sizes, sw, wq])), wq, sw,
                              _minus(wq, lo_all), src_count=_minus(w, first), border=border.value))
    return tuple(stmts)


def padded_copy(b: KernelBuilder, src: str, src_off, channels: int, spatial: list, pads: list, dest: str,
                value=lambda v: v, border=Const(0.0, "f32"), row_kind: str = "masked", dest_off=Const(0)) -> For:
    """Copy `channels` planes of `spatial` from src[src_off:] into dest[dest_off:] with borders holding
    `border` (zero), each element through `value` (an int8 input becomes float x - zero point).
    Rows inside the input copy contiguously (vectorized) between two border runs; rows in the
    padding are all border: no per-element bounds checks or clamped loads."""
    nsp = len(spatial)
    padded = [spatial[i] + pads[i] + pads[nsp + i] for i in range(nsp)]
    ci = b.fresh("ci")
    rv = [b.fresh("pr") for _ in range(nsp - 1)]
    j = b.fresh("pj")
    row = [Var(ci)] + [Var(v) for v in rv]
    dest_row = add(dest_off, flat_index(row + [Const(0)], [channels] + padded))
    src_row = add(src_off, flat_index([Var(ci)] + [sub(Var(v), pads[i]) for i, v in enumerate(rv)] + [Const(0)],
                                      [channels] + list(spatial)))
    left, width, right = pads[nsp - 1], spatial[-1], pads[2 * nsp - 1]
    fill = (For(j, left, (Store(dest, add(dest_row, Var(j)), border),), "vectorize"),
            For(j, width, (Store(dest, add(dest_row, add(Var(j), left)), value(Load(src, add(src_row, Var(j))))),),
                row_kind),
            For(j, right, (Store(dest, add(dest_row, add(Var(j), left + width)), border),), "vectorize"))
    inside = None
    for i, v in enumerate(rv):
        pos = sub(Var(v), pads[i])
        ok = fbin("and", cmp("ge", pos, Const(0)), cmp("lt", pos, spatial[i]))
        inside = ok if inside is None else fbin("and", inside, ok)
    body = fill if inside is None else (If(inside, fill, (For(j, padded[-1], (Store(dest, add(dest_row, Var(j)),
                                                                                      border),), "vectorize"),)),)
    for i in range(nsp - 2, -1, -1):
        body = (For(rv[i], padded[i], body),)
    return For(ci, channels, body, parallel=True)
