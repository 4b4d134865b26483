"""3x3 convolutions by Winograd's minimal filtering F(2x2, 3x3): 16 multiplies per 2x2 outputs
and input channel where the direct conv needs 36.

Each 4x4 tile of the (zero-bordered) input, 2 apart, becomes V = B^T d B; each 3x3 filter
becomes U = G g G^T (at build time, in float64); the 16 positions of the tiles are 16
independent GEMMs, M[xi] = V[xi] (tiles x cin) x U[xi] (cin x cout), and each tile's 2x2
outputs are Y = A^T M A, with the group's epilogue applied as they are stored. The GEMMs do
2.25x fewer multiply-adds than the conv's; the transforms cost a pass over the input and
one over the output, so it pays where channels are many (`winograd_pays`, the rule; the
tuner may choose it elsewhere, `conv_path` = "winograd"). Its sums are rounded in another
order: errors within float32 reassociation's bounds (tests/test_winograd.py measures them
against float64).

A picture of many tiles runs a block of tile rows at a time (BLOCK_TILES), each block's
steps (copying its bordered input rows, V, the GEMMs, Y) one after the other on one thread
while its data are in cache; threads take *slots*, each with its own copy, V and M and a
run of the (image, block) units, so the workspace is at most WORKSPACE_SLOTS blocks'
whatever the batch, and a batch's images share the threads. One image of one block runs
each step as a phase that threads divide. Over run-time image sizes the kernel holds both
ways and each call takes the one a static build would: the whole picture as one block where
it has at most `block_tiles` tiles, else a block per tile row; the GEMMs' rows are then a
run-time count.
"""
from __future__ import annotations

import math

import numpy as np

from ..graph import Node
from ..loop import Cmp, Const, For, If, Let, Load, Store, Var, add, cmp, div, fbin, loop, mul, rem, sub
from ..symbolic import greatest, least
from .builder import KernelBuilder
from .gemm import deferred_panels, gemm_stmt

# F(2x2, 3x3)'s matrices (Lavin and Gray, 2015).
_BT = np.array([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], np.float64)
_G = np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]], np.float64)
_AT = np.array([[1, 1, 1, 0], [0, 1, -1, -1]], np.float64)


# A picture of more tiles than this is transformed, multiplied and transformed back a block
# of tile rows at a time, each block's V and M still in cache when the next step reads them
# (rather than a pass over all of V and M in memory between steps): 256 channels at 100x100
# 27.6 -> 24.6 ms, 64 at 112x112 4.26 -> 2.81 (AVX-512, 1 thread). Every block streams all 16
# transformed filters, so many channels take bigger blocks (512 at 28x28: 28 tiles 8.9 ms, 98 8.2).
BLOCK_TILES = 96
# Blocks enough that threads share them evenly: ResNet-18's 128 channels at 28x28 in 7 blocks
# of 2 tile rows ran 4 and 3 on two threads; in 14 blocks of 1, 7 and 7.
MIN_BLOCKS = 8
# Blocks in flight at once, each with V and M of its own: as many threads as take part.
WORKSPACE_SLOTS = 16
# The loops over channels, which threads divide, are never vectorized: over a row of one or
# two tiles LLVM would vectorize them instead, and a thread's range that is not whole
# vectors would round its last channels in the scalar remainder's order (ResNet-18 at
# 112x112: 512 channels at 4x4 differed in the last bit at 3 threads).
_ACROSS = "scalar"


def winograd_fits(b: KernelBuilder, node: Node) -> bool:
    """A 2-D 3x3 conv, stride and dilation 1, one group, constant float32 weights, an output
    of at least 2x2 where its sizes are known (a 1-wide one is a tile of 16 products for one
    output, where the direct conv takes 9); run-time sizes may be 1 (ResNet's last stage
    built for 32..640 pixels is 1x1 at the least, 7x7 at 224: it ran as the implicit GEMM,
    1.6x the static build's Winograd)."""
    a = b.attrs(node)
    xs = b.type(node.inputs[0]).shape
    return (len(xs) == 4 and list(a["kernel_shape"]) == [3, 3] and list(a["strides"]) == [1, 1]
            and list(a["dilations"]) == [1, 1] and a.get("group", 1) == 1 and node.inputs[1] in b.g.constants
            and b.type(node.inputs[0]).dtype == "float32"
            and all(d >= 2 if isinstance(d, int) else least(d) >= 1 for d in b.type(node.outputs[0]).shape[2:]))


def winograd_pays(vector_width: int, cin: int, cout: int, out_sp) -> bool:
    """Whether the rule takes Winograd for a conv that fits it: its transforms cost a pass per
    input and output channel, its GEMMs save 5/9 of the multiply-adds of every pair, so it pays
    where both counts are enough (bench/bench_convs.py's layers and a sweep of square 3x3
    convs, 1 thread, 2026-11-27). On 16 lanes: 64 -> 64 at 56x56 0.66x of the implicit GEMM's
    time, 256 at 28x28 0.58x, 512 at 7x7 0.82x; few channels only over big pictures (32 -> 32
    at 112x112 0.72x, 16 -> 32 0.83x, at 56x56 0.86x, but at 28x28 1.26x); 64 at 7x7 (16
    tiles) 1.30x, 8 -> 32 1.25x. On 8 lanes (AVX2) the implicit GEMM's smaller tiles lose at
    every size from 16 channels (16 -> 16 at 56x56 0.82x, 64 at 7x7 0.87x, 512 at 28x28 0.56x).
    Other widths are not measured: Winograd stays the tuner's there."""
    tiles, pairs = math.prod(-(-d // 2) for d in out_sp), cin * cout
    if vector_width >= 16:
        return min(cin, cout) >= 16 and (pairs >= 16384 or pairs >= 2048 and tiles >= 49 or
                                         pairs >= 512 and tiles >= 784)
    return vector_width == 8 and min(cin, cout) >= 16


def filter_transform(w: np.ndarray) -> np.ndarray:
    """[cout, cin, 3, 3] -> U as [16, cin, cout] float32: U[4r+s][c][o] = (G w[o,c] G^T)[r][s]."""
    u = np.einsum("ij,ocjk,lk->ilco", _G, w.astype(np.float64), _G)  # [4, 4, cin, cout]
    return np.ascontiguousarray(u.reshape(16, w.shape[1], w.shape[0]), dtype=np.float32)


def _combine(rows, matrix) -> list:
    """matrix (with entries 0, 1, -1) times the list of row expressions."""
    out = []
    for coefs in matrix:
        total = None
        for c, r in zip(coefs, rows):
            if c == 0:
                continue
            if total is None:
                total = r if c == 1 else fbin("sub", Const(0.0, "f32"), r)
            else:
                total = fbin("add" if c == 1 else "sub", total, r)
        out.append(total)
    return out


def block_tiles(cin: int, cout: int) -> int:
    """The most tiles a block holds: BLOCK_TILES, more where U (which every block streams) is big."""
    return max(BLOCK_TILES, cin * cout // 2048)


def block_rows(th: int, tw: int, cin: int, cout: int) -> int:
    """Tile rows a block holds: the most that divide th within the block's tiles (at least 1),
    leaving MIN_BLOCKS blocks where it can; th itself (one block, the steps as phases over
    the whole picture) when all fit."""
    most = block_tiles(cin, cout)
    if th * tw <= most:
        return th
    fit = [r for r in range(1, th + 1) if th % r == 0 and (r == 1 or r * tw <= most)]
    return max([r for r in fit if th // r >= MIN_BLOCKS] or fit)


def whole_picture_bounds(th_most: int, tw_most: int, most: int) -> tuple[int, int]:
    """Over run-time sizes, the most tiles and the most bordered-copy floats per channel of a
    picture of at most `most` tiles (which runs as one block)."""
    shapes = [(th, min(most // th, tw_most)) for th in range(1, min(th_most, most) + 1)]
    return (max(th * tw for th, tw in shapes), max((2 * th + 2) * (2 * tw + 2) for th, tw in shapes))


def spread(elements: int) -> int:
    """The float32 elements from one position's slice of V or M to the next: at least
    `elements`, 64 bytes past a multiple of 4 KiB, so the 16 slices a transform reads or
    writes together fall in 16 different L1 sets (128 channels x 56 tiles is exactly 7 pages:
    the 16 streams shared one set and the conv ran 1.35x slower)."""
    return -(-elements // 1024) * 1024 + 16


def _times(a, b):
    """a * b: an int where both are (a Gemm's build-time stride must be), else an expression."""
    return a * b if isinstance(a, int) and isinstance(b, int) else mul(a, b)


def lower_winograd(b: KernelBuilder, node: Node, store) -> tuple:
    x_name, w_name = node.inputs[0], node.inputs[1]
    batch_dim, cin, h_dim, w_dim = b.type(x_name).shape
    images, h, w_ = b.dim(batch_dim), b.dim(h_dim), b.dim(w_dim)
    cout = b.type(w_name).shape[0]
    pt, pl, _, _ = b.attrs(node)["pads"]
    out_dims = b.type(node.outputs[0]).shape[2:]
    oh, ow = (b.dim(d) for d in out_dims)
    th_most, tw_most = (-(-greatest(d) // 2) for d in out_dims)  # (tile rows and columns; at the bounds)
    static = all(isinstance(d, int) for d in out_dims)
    th, tw = (th_most, tw_most) if static else (div(add(oh, 1), 2), div(add(ow, 1), 2))
    wp_most = 2 * tw_most + 2  # (the bordered row; past the last whole tile, zeros too)
    wp = wp_most if static else add(mul(tw, 2), 2)
    bias = b.reader(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else None
    xparam = b.in_param(x_name)
    nr = b.tile(cout)[1]
    u = filter_transform(b.g.constants[w_name])
    uparam = b.constant_param(f"{w_name}_winograd", deferred_panels(u, nr))
    panel_stride = -(-cout // nr) * cin * nr
    most = block_tiles(cin, cout)
    # A block is `rows` tile rows: block_rows' over static sizes. Over run-time ones, the whole
    # picture where it is at most `most` tiles (its steps phases that threads divide, as a
    # static build's are: 512 channels at 7x7 in blocks of one 4-tile row took 0.78 ms, whole
    # 0.65), else one tile row; its GEMM reads V's channels a block's tiles apart through a
    # table the kernel fills (Gemm.a_ktab: a_sk is a build-time stride, and the bound's stride
    # spread a 14-tile panel of A over 64 lines: 64 channels at 56x56 ran 0.80 ms against the
    # static build's 0.57).
    if static:
        rows = block_rows(th, tw, cin, cout)
        block_most, copy_most = rows * tw_most, (2 * rows + 2) * wp_most
        blocks_most = th_most // rows
    else:
        whole_most, whole_copy = whole_picture_bounds(th_most, tw_most, most)
        block_most, copy_most = max(tw_most, whole_most), max(4 * wp_most, whole_copy)
        blocks_most = th_most
    v_step, m_step = spread(cin * block_most), spread(cout * block_most)  # (from one position xi to the next)
    copy_step = cin * copy_most
    slots = min(greatest(batch_dim) * blocks_most, WORKSPACE_SLOTS)
    xp = b.workspace(copy_step * slots)
    v_ws, m_ws = b.workspace(16 * v_step * slots), b.workspace(16 * m_step * slots)
    ktab_row = ktab_whole = ""  # (V's k offsets over run-time sizes: blocks of a tile row, the whole picture)
    table = ()
    if not static:
        ktab_row, ktab_whole, kv = b.workspace(cin, "i64"), b.workspace(cin, "i64"), b.fresh("k")
        table = (For(kv, cin, (Store(ktab_row, Var(kv), mul(Var(kv), tw)),
                               Store(ktab_whole, Var(kv), mul(Var(kv), mul(th, tw))))),)

    def steps(rows, blocks, image, blk, slot, parallel: bool) -> tuple:
        """One block's copy, input transform, GEMMs and output transform: `rows` tile rows
        (an int, or th) of the picture's `blocks`, in `slot`'s workspace."""
        per_block = _times(rows, tw)  # (one channel's tiles in V and M)
        window = 2 * rows + 2 if isinstance(rows, int) else add(mul(rows, 2), 2)  # (the bordered input rows)

        def copy() -> For:
            """The block's window of the zero-bordered input, into the slot's copy."""
            c, pr, j = b.fresh("c"), b.fresh("pr"), b.fresh("pj")
            y = sub(add(mul(blk, _times(rows, 2)), Var(pr)), pt)  # (the input row; outside the input: a border row)
            dest = add(mul(slot, copy_step), add(mul(Var(c), mul(wp, window)), mul(Var(pr), wp)))
            src = add(mul(image, mul(mul(h, w_), cin)), add(mul(Var(c), mul(h, w_)), mul(y, w_)))
            zero = Const(0.0, "f32")
            inside = (For(j, pl, (Store(xp, add(dest, Var(j)), zero),), "vectorize"),
                      For(j, w_, (Store(xp, add(dest, add(Var(j), pl)), Load(xparam, add(src, Var(j)))),), "masked"),
                      For(j, wp - w_ - pl if static else sub(sub(wp, w_), pl),
                          (Store(xp, add(dest, add(Var(j), add(w_, pl))), zero),), "vectorize"))
            border = (For(j, wp, (Store(xp, add(dest, Var(j)), zero),), "vectorize"),)
            ok = fbin("and", cmp("ge", y, Const(0)), cmp("lt", y, h))
            return For(c, cin, (For(pr, window, (If(ok, inside, border),)),), _ACROSS, parallel)

        def inputs() -> For:
            """V[xi][c][t] = (B^T d B)[xi] for the block's tile t = (ti, tj) of channel c."""
            c, ti, tj = b.fresh("c"), b.fresh("ti"), b.fresh("tj")
            plane = add(mul(slot, copy_step), mul(Var(c), mul(wp, window)))
            d = [[Load(xp, add(plane, add(mul(add(mul(Var(ti), 2), r), wp), add(mul(Var(tj), 2), s))))
                  for s in range(4)] for r in range(4)]
            cols = [_combine([d[r][s] for r in range(4)], _BT) for s in range(4)]  # B^T d, by column
            names = [[b.fresh("bt") for _ in range(4)] for _ in range(4)]
            lets = [Let(names[r][s], cols[s][r]) for r in range(4) for s in range(4)]
            rows_ = [_combine([Var(names[r][s], "f32") for s in range(4)], _BT) for r in range(4)]  # (B^T d) B
            base = add(mul(slot, 16 * v_step), add(mul(Var(c), per_block), add(mul(Var(ti), tw), Var(tj))))
            stores = [Store(v_ws, add(base, Const((4 * r + s) * v_step)), rows_[r][s])
                      for r in range(4) for s in range(4)]
            return For(c, cin, (For(ti, rows, (For(tj, tw, (*lets, *stores), "vectorize"),)),), _ACROSS, parallel)

        def products() -> For:
            """M[xi][o][t] = sum_c V[xi][c][t] U[xi][c][o]: 16 GEMMs, one per position xi."""
            xi = b.fresh("xi")
            v_off = add(mul(slot, 16 * v_step), mul(Var(xi), v_step))
            m_off = add(mul(slot, 16 * m_step), mul(Var(xi), m_step))
            return For(xi, 16, (gemm_stmt(
                b, v_ws, v_off, 1, per_block if static else 0, uparam, mul(Var(xi), panel_stride), per_block, cout, cin,
                lambda mm, nn, acc: [Store(m_ws, add(m_off, add(mul(nn, per_block), mm)), acc)],
                stores_along="m", split="m", a_ktab=ktab_row if isinstance(rows, int) else ktab_whole),),
                parallel=parallel)

        def results() -> For:
            """Y = A^T M A for each of the block's tiles, the epilogue applied to each output."""
            o, oi, oj = b.fresh("o"), b.fresh("oi"), b.fresh("oj")
            m_off = add(mul(slot, 16 * m_step), mul(Var(o), per_block))

            def outputs(ti, col, out_rows, out_cols: int) -> list:
                """The tile's outputs in rows `out_rows` (of 0, 1) and its first out_cols columns."""
                at = add(m_off, add(mul(ti, tw), col))
                m = [[Load(m_ws, add(at, Const((4 * r + s) * m_step))) for s in range(4)] for r in range(4)]
                names_ = [[b.fresh("at") for _ in range(4)] for _ in range(2)]
                cols_ = [_combine([m[r][s] for r in range(4)], _AT) for s in range(4)]  # A^T M, by column
                out = [Let(names_[r][s], cols_[s][r]) for r in out_rows for s in range(4)]
                for r in out_rows:
                    ys = _combine([Var(names_[r][s], "f32") for s in range(4)], _AT)
                    for s in range(out_cols):
                        value = ys[s] if bias is None else fbin("add", ys[s], bias([Var(o)]))
                        y, x = add(mul(add(mul(blk, rows), ti), 2), r), add(mul(col, 2), s)
                        idx = [add(mul(y, ow), x)] if b.conv_collapsed else [y, x]
                        out += store([image, Var(o)] + idx, value)
                return out

            def tile_row(ti, out_rows: int) -> list:
                if static:
                    body = [For(oj, ow // 2, tuple(outputs(ti, Var(oj), range(out_rows), 2)), "vectorize")]
                    return body + (outputs(ti, Const(ow // 2), range(out_rows), 1) if ow % 2 else [])
                # A loop per output row: one storing two rows ow apart (ow known at run time
                # only) is vectorized behind a run-time check that the rows' ranges do not
                # overlap, and LLVM checks each row's even and odd columns as ranges of their
                # own, which do: every call ran the scalar loop (64 channels at 56x56: 0.15 ms
                # against 0.03).
                body = [For(oj, div(ow, 2), tuple(outputs(ti, Var(oj), (r,), 2)), "vectorize")
                        for r in range(out_rows)]
                # (the last tile column holds one output column where ow is odd)
                return body + [If(cmp("eq", rem(ow, 2), Const(1)), tuple(outputs(ti, div(ow, 2), range(out_rows), 1)))]

            if not static:  # (the picture's last tile row holds one output row where oh is odd)
                last = sub(rows, 1)
                short = fbin("and", cmp("eq", blk, sub(blocks, 1)), cmp("eq", rem(oh, 2), Const(1)))
                per_channel = [] if isinstance(rows, int) else [For(oi, last, tuple(tile_row(Var(oi), 2)))]
                per_channel.append(If(short, tuple(tile_row(last, 1)), tuple(tile_row(last, 2))))
                return For(o, cout, tuple(per_channel), _ACROSS, parallel)
            per_channel = [For(oi, rows - 1, tuple(tile_row(Var(oi), 2)))] if rows > 1 else []
            last = Const(rows - 1)
            if oh % 2 == 0:
                per_channel += tile_row(last, 2)
            elif blocks == 1:
                per_channel += tile_row(last, 1)
            else:
                per_channel.append(If(cmp("eq", blk, Const(blocks - 1)), tuple(tile_row(last, 1)),
                                      tuple(tile_row(last, 2))))
            return For(o, cout, tuple(per_channel), _ACROSS, parallel)

        return copy(), inputs(), products(), results()

    def as_phases(rows) -> tuple:
        """Image 0 as one block of `rows` tile rows (the whole picture), each step a phase
        that threads divide."""
        zero = Const(0)
        return steps(rows, 1, zero, zero, zero, True)

    def in_slots(rows, blocks, count, most: int) -> tuple:
        """`count` units (at most `most`) of an image's block in slots: each slot its own
        copy, V and M and a run of the units, whichever thread runs it."""
        slots = min(most, WORKSPACE_SLOTS)
        sv, j = b.fresh("slot"), b.fresh("unit")
        unit = add(div(mul(Var(sv), count), slots), Var(j))
        image, blk = (unit, Const(0)) if blocks == 1 else (div(unit, blocks), rem(unit, blocks))
        body = steps(rows, blocks, image, blk, Var(sv), False)
        if not (isinstance(count, int) and count % slots == 0):  # (runs of different lengths)
            body = (If(cmp("lt", unit, div(mul(add(Var(sv), 1), count), slots)), body),)
        return (For(sv, slots, loop(j, -(-most // slots), body), parallel=True),)

    batch_most = greatest(batch_dim)
    if static:
        blocks = blocks_most  # (th is th_most here)
        one = as_phases(rows) if blocks == 1 else in_slots(rows, blocks, blocks, blocks)
        if images == 1:
            return one
        many = in_slots(rows, blocks, _times(images, blocks), batch_most * blocks)
        if isinstance(images, int):
            return many
        # A run-time batch: a call of one image runs as a build for one would (guarded phases,
        # ir/loop.py "Threads"), where the loop over images would leave threads idle.
        return (If(cmp("ne", images, Const(1)), many), *(If(cmp("eq", images, Const(1)), (part,)) for part in one))
    # Over run-time sizes, the same choices made at run time: one image whose picture is one
    # block runs as phases, other calls in slots (a block per image or per tile row). Each is
    # a guarded phase, whose condition is one comparison of extents (ir/loop.py, "Threads").
    over = sub(mul(th, tw), most)  # (> 0: more tiles than a block holds)
    variants = [(cmp("gt", over, Const(0)), in_slots(1, th, mul(images, th), batch_most * th_most))]
    if images == 1:
        variants += [(cmp("le", over, Const(0)), (part,)) for part in as_phases(th)]
    else:
        off_one = fbin("max", sub(images, 1), sub(1, images))  # (|images - 1|)
        variants.append((_all_at_most_zero(over, sub(1, off_one)), in_slots(th, 1, images, batch_most)))
        variants += [(_all_at_most_zero(over, off_one), (part,)) for part in as_phases(th)]
    return (*table, *(If(cond, body) for cond, body in variants))


def _all_at_most_zero(*terms) -> Cmp:
    """One comparison that holds where every term (an extent) is at most 0."""
    most = terms[0]
    for t in terms[1:]:
        most = fbin("max", most, t)
    return cmp("le", most, Const(0))
