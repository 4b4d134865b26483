"""3x3 convolutions by Winograd's minimal filtering F(m x m, 3x3), m = 2 or 4: (m + 2)^2
multiplies per m x m outputs and input channel where the direct conv needs 9 m^2 (2.25x
fewer for m = 2, 4x for m = 4).

Each (m + 2) x (m + 2) tile of the (zero-bordered) input, m apart, becomes V = B^T d B; each
3x3 filter becomes U = G g G^T (at build time, in float64); the (m + 2)^2 positions of the
tiles are as many independent GEMMs, M[xi] = V[xi] (tiles x cin) x U[xi] (cin x cout), and
each tile's m x m outputs are Y = A^T M A, with the group's epilogue applied as they are
stored. The transforms cost a pass over the input and one over the output, so it pays where
channels are many (`winograd_pays`, the rule, and `winograd_tile`, which m; the tuner may
choose either elsewhere, `conv_path` = "winograd" or "winograd4"). Its sums are rounded in
another order, and bigger tiles' transforms have bigger coefficients: errors within float32
reassociation's bounds (tests/test_winograd.py measures them against float64).

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
from fractions import Fraction

import numpy as np

from ..graph import Node
from ..loop import Cmp, Const, For, If, Let, Load, Store, Var, add, cmp, div, fbin, loop, mul, rem, sub
from ..symbolic import greatest, least
from .builder import KernelBuilder
from .gemm import deferred_panels, gemm_stmt

def _toom_cook(points: list, m: int) -> tuple:
    """B^T, G and A^T of F(m x m, 3x3) over the interpolation points `points` and infinity
    (Toom-Cook; exact fractions). Each row of B^T is the polynomial that vanishes at every
    other point (the last: at all of them), G's rows the filter's values at the points over
    the product of their differences, A^T's columns the powers of each point."""
    pts = [Fraction(p) for p in points]
    alpha = m + 2
    at = [[p ** i for p in pts] + [Fraction(int(i == m - 1))] for i in range(m)]
    g = [[p ** k / math.prod(p - q for q in pts if q != p) for k in range(3)] for p in pts] + [[0, 0, 1]]
    bt = []
    for j in range(alpha):
        poly = [Fraction(1)]  # (coefficients, lowest power first)
        for q in (pts[:j] + pts[j + 1:] if j < alpha - 1 else pts):
            poly = [lower - q * same for same, lower in zip(poly + [0], [0] + poly)]  # (times x - q)
        bt.append(poly + [Fraction(0)] * (alpha - len(poly)))
    return bt, g, at


class Transform:
    """A matrix of Winograd's transforms applied to a list of expressions, sharing the work of
    each pair of points +p and -p: their columns (A^T: the values at +p and -p enter every
    output as p^i times their sum or their difference) or their rows (B^T: an even and an odd
    part, added and subtracted) go through a butterfly, so that F(4x4, 3x3)'s 6-point
    transforms take 12 operations a line, not 16."""

    def __init__(self, matrix: list, pairs: list, share: str):
        self.pairs, self.share = pairs, share
        size = len(matrix[0]) if share == "columns" else len(matrix)  # (of what the butterfly adds and subtracts)
        butterfly = [[Fraction(int(i == j)) for j in range(size)] for i in range(size)]
        for j, k in pairs:  # (v_j + v_k into j, v_j - v_k into k)
            butterfly[k][k] = Fraction(-1)
            butterfly[j][k] = butterfly[k][j] = Fraction(1)
        half = np.linalg.inv(np.array(butterfly, np.float64))  # (entries 0, 1, 1/2 and -1/2: exact)
        full = np.array(matrix, np.float64)
        self.matrix = full @ half if share == "columns" else half @ full
        assert np.allclose(self.matrix @ np.array(butterfly, np.float64) if share == "columns"
                           else np.array(butterfly, np.float64) @ self.matrix, full)

    def __call__(self, values: list) -> list:
        if self.share == "columns":
            return _combine(_butterfly(values, self.pairs), self.matrix)
        return _butterfly(_combine(values, self.matrix), self.pairs)


def _butterfly(values: list, pairs: list) -> list:
    out = list(values)
    for j, k in pairs:
        out[j], out[k] = fbin("add", values[j], values[k]), fbin("sub", values[j], values[k])
    return out


# The points: F(2x2, 3x3)'s 0, 1, -1 (Lavin and Gray, 2015); F(4x4, 3x3)'s the usual 0, +-1,
# +-2 scaled by 3/4, which balances the sizes of the transforms' coefficients (every one a
# short binary fraction, so B^T and A^T stay exact): against a float64 conv, 256 channels at
# 16x16, 0.4-1.3e-6 of the largest output where +-1, +-2 gave 0.7-3.9e-6 and F(2x2, 3x3)
# 0.2-0.4e-6 (a float32 sum in channel order: 1.2-4e-6). Among all five-point sets from
# 0, +-1/4 .. +-4 in quarters and thirds, none was better by more than 10%.
_POINTS = {2: [0, 1, -1], 4: [0, Fraction(3, 4), Fraction(-3, 4), Fraction(3, 2), Fraction(-3, 2)]}
# The conv paths (`conv_path`) of F(m x m, 3x3), by m.
WINOGRAD_PATHS = {"winograd": 2, "winograd4": 4}


def _transforms(m: int) -> tuple:
    """(B^T, G as float64, A^T) of F(m x m, 3x3)."""
    bt, g, at = _toom_cook(_POINTS[m], m)
    pairs = [(j, j + 1) for j in range(1, m + 1, 2)]  # (the points +p, -p)
    return Transform(bt, pairs, "rows"), np.array(g, np.float64), Transform(at, pairs, "columns")


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
    input and output channel, its GEMMs save 5/9 (4x4 tiles: 3/4) of the multiply-adds of every
    pair, so it pays where both counts are enough (bench/bench_convs.py's layers and sweeps of
    square 3x3 convs, 1 thread, 2026-11-27 and 28). On 16 lanes, 2x2 tiles: 64 -> 64 at 56x56
    0.66x of the implicit GEMM's time, 256 at 28x28 0.58x, 512 at 7x7 0.82x; few channels only
    over big pictures (32 -> 32 at 112x112 0.72x, 16 -> 32 0.83x, at 56x56 0.86x, but at 28x28
    1.26x); 64 at 7x7 (16 tiles) 1.30x, 8 -> 32 1.25x. 4x4 tiles take 32 -> 32 at 28x28 (0.87x)
    but not 16 -> 32 (1.06x) nor 64 at 7x7 (1.03x). On 8 lanes (AVX2) the implicit GEMM's
    smaller tiles lose at every size from 16 channels (16 -> 16 at 56x56 0.82x, 64 at 7x7 0.77x
    as 4x4 tiles, 512 at 28x28 0.56x). Other widths are not measured: Winograd stays the
    tuner's there."""
    tiles, pairs = math.prod(-(-d // 2) for d in out_sp), cin * cout
    if vector_width >= 16:
        return min(cin, cout) >= 16 and (pairs >= 16384 or pairs >= 2048 and tiles >= 49 or
                                         pairs >= 512 and tiles >= 784 or
                                         min(cin, cout) >= 32 and math.prod(-(-d // 4) for d in out_sp) >= 49)
    return vector_width == 8 and min(cin, cout) >= 16


def winograd_tile(vector_width: int, cin: int, cout: int, out_sp) -> int:
    """m of F(m x m, 3x3) where the rule takes Winograd: 4 (36 multiplies for 16 outputs, where
    F(2x2, 3x3) takes 64) where 32 input channels or more, and 1024 pairs of channels or more,
    repay the bigger transforms (48 -> 16 at 64x64: 1.17x 2x2 tiles' time, 64 -> 16 0.83x), its
    tiles waste little of that (their multiplies at most 3/4 of 2x2 tiles': 7x7 and 13x13
    yes, 9x9 and 2x2 not), and its transformed filters (36 x cin x cout, 2.25x 2x2 tiles')
    are read by 16 tiles or more, or are at most 256 x 256 channels' (9 MiB). Over run-time
    sizes `out_sp` is the least output. On bench_convs.py's 3x3 stride-1 layers and sweeps
    of square ones (1 thread, 2026-11-28), F(4x4)'s time over F(2x2)'s: on 16 lanes 0.64-0.91
    (ResNet's 128 at 28x28 0.64, 64 at 56x56 0.84, 256 at 14x14 0.85; FCOS's 256 at 100x100
    0.64; 256 at 7x7 0.63), but 512 at 7x7 1.50 (its 37 MiB of filters for 4 tiles), 384 at
    7x7 1.02 and 16 -> 64 at 55x55 0.97; on 8 lanes 0.67-0.94, 512 at 7x7 0.99, 16 -> 64
    1.15."""
    tiles, tiles_2x2 = (math.prod(-(-d // m) for d in out_sp) for m in (4, 2))
    return 4 if (vector_width in (8, 16) and cin >= 32 and cin * cout >= 1024 and 36 * tiles <= 12 * tiles_2x2 and
                 (tiles >= 16 or cin * cout <= 256 * 256)) else 2


def filter_transform(w: np.ndarray, m: int = 2) -> np.ndarray:
    """[cout, cin, 3, 3] -> U as [(m + 2)^2, cin, cout] float32: U[(m+2)r+s][c][o] = (G w[o,c] G^T)[r][s]."""
    g = _transforms(m)[1]
    cout, cin = w.shape[:2]
    # G w G^T of every filter as one product, kron(G, G) times the filters as columns of 9: 13 ms
    # for 256 x 256 filters where the four-index einsum took 33 (a third of ResNet-18's lowering).
    # (An einsum, not `@`: BLAS would start its thread pool, whose spinning threads made two
    # models planned at once, or a plan beside a compile, take twice as long on 2 cores.)
    columns = np.ascontiguousarray(w.transpose(2, 3, 1, 0).reshape(9, cin * cout), dtype=np.float64)
    return np.einsum("ij,jn->in", np.kron(g, g), columns).astype(np.float32).reshape(-1, cin, cout)


def _combine(values: list, matrix) -> list:
    """matrix times the list of expressions (a coefficient 1 or -1 an add or a subtract, others
    a multiply-add)."""
    out = []
    for coefs in matrix:
        total = None
        for c, v in sorted(zip(coefs, values), key=lambda cv: cv[0] < 0):  # (a positive term first)
            if c == 0:
                continue
            term = v if abs(c) == 1 else fbin("mul", Const(float(abs(c)), "f32"), v)
            if total is None:
                total = term if c > 0 else fbin("sub", Const(0.0, "f32"), term)
            else:
                total = fbin("add" if c > 0 else "sub", total, term)
        out.append(total if total is not None else Const(0.0, "f32"))
    return out


def block_tiles(cin: int, cout: int) -> int:
    """The most tiles a block holds: BLOCK_TILES, more where U (which every block streams) is big.
    (The same for F(4x4, 3x3)'s tiles: blocks of 24, 42, 64 or 96 ran within 3% of each other,
    except 128 channels at 28x28, 49 tiles, on x86-64-v3: 0.82 ms in blocks of tile rows, 0.72
    as one.)"""
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


def whole_picture_bounds(th_most: int, tw_most: int, most: int, m: int = 2) -> tuple[int, int]:
    """Over run-time sizes, the most tiles and the most bordered-copy floats per channel of a
    picture of at most `most` tiles (which runs as one block)."""
    shapes = [(th, min(most // th, tw_most)) for th in range(1, min(th_most, most) + 1)]
    return (max(th * tw for th, tw in shapes), max((m * th + 2) * (m * tw + 2) for th, tw in shapes))


def spread(elements: int) -> int:
    """The float32 elements from one position's slice of V or M to the next: at least
    `elements`, 64 bytes past a multiple of 4 KiB, so the 16 (or 36) slices a transform reads
    or writes together fall in different L1 sets (128 channels x 56 tiles is exactly 7 pages:
    the 16 streams shared one set and the conv ran 1.35x slower)."""
    return -(-elements // 1024) * 1024 + 16


def _times(a, b):
    """a * b: an int where both are (a Gemm's build-time stride must be), else an expression."""
    return a * b if isinstance(a, int) and isinstance(b, int) else mul(a, b)


def lower_winograd(b: KernelBuilder, node: Node, store, m: int = 2) -> tuple:
    """The conv as F(m x m, 3x3): tiles of m x m outputs from (m + 2) x (m + 2) inputs."""
    alpha = m + 2  # (a tile's inputs along each axis)
    positions = alpha * alpha  # (the GEMMs)
    bt, _, at = _transforms(m)
    x_name, w_name = node.inputs[0], node.inputs[1]
    batch_dim, cin, h_dim, w_dim = b.type(x_name).shape
    images, h, w_ = b.dim(batch_dim), b.dim(h_dim), b.dim(w_dim)
    cout = b.type(w_name).shape[0]
    pt, pl, _, _ = b.attrs(node)["pads"]
    out_dims = b.type(node.outputs[0]).shape[2:]
    oh, ow = (b.dim(d) for d in out_dims)
    th_most, tw_most = (-(-greatest(d) // m) for d in out_dims)  # (tile rows and columns; at the bounds)
    static = all(isinstance(d, int) for d in out_dims)
    th, tw = (th_most, tw_most) if static else (div(add(oh, m - 1), m), div(add(ow, m - 1), m))
    wp_most = m * tw_most + 2  # (the bordered row; past the last whole tile, zeros too)
    wp = wp_most if static else add(mul(tw, m), 2)
    bias = b.reader(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else None
    xparam = b.in_param(x_name)
    nr = b.tile(cout)[1]
    uparam = b.packed_param(f"{w_name}_winograd{m}", ("winograd", w_name, m, nr),
                            lambda: deferred_panels(filter_transform(b.g.constants[w_name], m), nr))
    panel_stride = -(-cout // nr) * cin * nr
    # The GEMMs' columns: over run-time sizes, whole panels where that adds at most 1/16 more
    # (the filters' panels are zero past cout, and M's extra channels are never read): a
    # partial panel doubles the code of a GEMM whose rows are a run-time count, one tile for
    # each count of its last rows (RetinaNet's 256 -> 720 head conv: LLVM 3.8 -> 2.0 s).
    columns = -(-cout // nr) * nr if not static and 16 * (-cout % nr) <= cout else cout
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
        block_most, copy_most = rows * tw_most, (m * rows + 2) * wp_most
        blocks_most = th_most // rows
    else:
        whole_most, whole_copy = whole_picture_bounds(th_most, tw_most, most, m)
        block_most, copy_most = max(tw_most, whole_most), max(alpha * wp_most, whole_copy)
        blocks_most = th_most
    v_step, m_step = spread(cin * block_most), spread(columns * block_most)  # (from one position xi to the next)
    copy_step = cin * copy_most
    slots = min(greatest(batch_dim) * blocks_most, WORKSPACE_SLOTS)
    xp = b.workspace(copy_step * slots)
    v_ws, m_ws = b.workspace(positions * v_step * slots), b.workspace(positions * m_step * slots)
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
        window = m * rows + 2 if isinstance(rows, int) else add(mul(rows, m), 2)  # (the bordered input rows)

        def copy() -> For:
            """The block's window of the zero-bordered input, into the slot's copy."""
            c, pr, j = b.fresh("c"), b.fresh("pr"), b.fresh("pj")
            y = sub(add(mul(blk, _times(rows, m)), Var(pr)), pt)  # (the input row; outside the input: a border row)
            dest = add(mul(slot, copy_step), add(mul(Var(c), mul(wp, window)), mul(Var(pr), wp)))
            src = add(mul(image, mul(mul(h, w_), cin)), add(mul(Var(c), mul(h, w_)), mul(y, w_)))
            zero = Const(0.0, "f32")
            inside = (For(j, pl, (Store(xp, add(dest, Var(j)), zero),), "vectorize"),
                      For(j, w_, (Store(xp, add(dest, add(Var(j), pl)), Load(xparam, add(src, Var(j)))),), "masked"),
                      For(j, wp - w_ - pl if static else sub(sub(wp, w_), pl),
                          (Store(xp, add(dest, add(Var(j), add(w_, pl))), zero),), "vectorize"))
            border = (For(j, wp, (Store(xp, add(dest, Var(j)), zero),), "vectorize"),)
            ok = fbin("and", cmp("ge", y, Const(0)), cmp("lt", y, h))
            # (rolled: a block of one tile row has a window of 4 or 6 rows, and LLVM copied the
            # row's three loops for each)
            return For(c, cin, (For(pr, window, (If(ok, inside, border),), "rolled"),), _ACROSS, parallel)

        def inputs() -> For:
            """V[xi][c][t] = (B^T d B)[xi] for the block's tile t = (ti, tj) of channel c."""
            c, ti, tj = b.fresh("c"), b.fresh("ti"), b.fresh("tj")
            plane = add(mul(slot, copy_step), mul(Var(c), mul(wp, window)))
            d = [[Load(xp, add(plane, add(mul(add(mul(Var(ti), m), r), wp), add(mul(Var(tj), m), s))))
                  for s in range(alpha)] for r in range(alpha)]
            cols = [bt([d[r][s] for r in range(alpha)]) for s in range(alpha)]  # B^T d, by column
            names = [[b.fresh("bt") for _ in range(alpha)] for _ in range(alpha)]
            lets = [Let(names[r][s], cols[s][r]) for r in range(alpha) for s in range(alpha)]
            rows_ = [bt([Var(names[r][s], "f32") for s in range(alpha)]) for r in range(alpha)]  # (B^T d) B
            base = add(mul(slot, positions * v_step), add(mul(Var(c), per_block), add(mul(Var(ti), tw), Var(tj))))
            stores = [Store(v_ws, add(base, Const((alpha * r + s) * v_step)), rows_[r][s])
                      for r in range(alpha) for s in range(alpha)]
            return For(c, cin, (For(ti, rows, (For(tj, tw, (*lets, *stores), "vectorize"),)),), _ACROSS, parallel)

        def products() -> For:
            """M[xi][o][t] = sum_c V[xi][c][t] U[xi][c][o]: a GEMM per position xi."""
            xi = b.fresh("xi")
            v_off = add(mul(slot, positions * v_step), mul(Var(xi), v_step))
            m_off = add(mul(slot, positions * m_step), mul(Var(xi), m_step))
            return For(xi, positions, (gemm_stmt(
                b, v_ws, v_off, 1, per_block if static else 0, uparam, mul(Var(xi), panel_stride), per_block, columns, cin,
                lambda mm, nn, acc: [Store(m_ws, add(m_off, add(mul(nn, per_block), mm)), acc)],
                stores_along="m", split="m", a_ktab=ktab_row if isinstance(rows, int) else ktab_whole),),
                parallel=parallel)

        def results() -> For:
            """Y = A^T M A for each of the block's tiles, the epilogue applied to each output."""
            o, oi, oj = b.fresh("o"), b.fresh("oi"), b.fresh("oj")
            m_off = add(mul(slot, positions * m_step), mul(Var(o), per_block))

            def outputs(ti, col, out_rows, out_cols: int, bottom=None, present=None) -> list:
                """The tile's outputs in rows `out_rows` (of 0 .. m-1), stored in that order, and
                its first out_cols columns (with `present`, a run-time count: the columns from 1
                on only where fewer); with `bottom`, no row below that one."""
                tile = add(m_off, add(mul(ti, tw), col))
                mm = [[Load(m_ws, add(tile, Const((alpha * r + s) * m_step))) for s in range(alpha)]
                      for r in range(alpha)]
                names_ = [[b.fresh("at") for _ in range(alpha)] for _ in range(m)]
                cols_ = [at([mm[r][s] for r in range(alpha)]) for s in range(alpha)]  # A^T M, by column
                out = [Let(names_[r][s], cols_[s][r]) for r in out_rows for s in range(alpha)]
                for r in out_rows:
                    ys = at([Var(names_[r][s], "f32") for s in range(alpha)])
                    for s in range(out_cols):
                        value = ys[s] if bias is None else fbin("add", ys[s], bias([Var(o)]))
                        y, x = add(mul(add(mul(blk, rows), ti), m), r), add(mul(col, m), s)
                        y = y if bottom is None else fbin("min", y, bottom)
                        idx = [add(mul(y, ow), x)] if b.conv_collapsed else [y, x]
                        stored = store([image, Var(o)] + idx, value)
                        out += stored if present is None or s == 0 else [If(cmp("lt", Const(s), present), tuple(stored))]
                return out

            if not static:
                # A tile row is one loop over its whole tiles and one copy of their code for the
                # last tile's ow % m columns (if any), whatever the picture's size: each count of
                # rows and columns a last tile could hold once had code of its own (F(4x4): 29
                # copies of A^T M A per way of running, and 256 channels took LLVM 4.3 s). The
                # picture's last tile row may hold fewer than m output rows: its rows past the
                # last store into the last (min(y, oh - 1)) before that row's own values do, its
                # rows stored last first. The loop is `independent`: its m stores a run-time ow
                # apart made LLVM guard the vector loop with an overlap check between each row's
                # even and odd columns as ranges of their own, which do overlap, and every call
                # ran the scalar loop (64 channels at 56x56: 0.15 ms against 0.03).
                last_first, bottom = range(m - 1, -1, -1), sub(oh, 1)

                def tile_row(ti) -> list:
                    return [For(oj, div(ow, m), tuple(outputs(ti, Var(oj), last_first, m, bottom)), "independent"),
                            If(cmp("gt", rem(ow, m), Const(0)),
                               tuple(outputs(ti, div(ow, m), last_first, m - 1, bottom, present=rem(ow, m))))]
                body = tile_row(Const(0)) if isinstance(rows, int) and rows == 1 else \
                    [For(oi, rows, tuple(tile_row(Var(oi))))]
                return For(o, cout, tuple(body), _ACROSS, parallel)

            def tile_row(ti, out_rows: int) -> list:
                body = [For(oj, ow // m, tuple(outputs(ti, Var(oj), range(out_rows), m)), "vectorize")]
                return body + (outputs(ti, Const(ow // m), range(out_rows), ow % m) if ow % m else [])

            per_channel = [For(oi, rows - 1, tuple(tile_row(Var(oi), m)))] if rows > 1 else []
            last, short = Const(rows - 1), oh - (th - 1) * m  # (the output rows of the picture's last tile row)
            if short == m:
                per_channel += tile_row(last, m)
            elif blocks == 1:
                per_channel += tile_row(last, short)
            else:
                per_channel.append(If(cmp("eq", blk, Const(blocks - 1)), tuple(tile_row(last, short)),
                                      tuple(tile_row(last, m))))
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
        # (rolled: LLVM copied a slot's few units whole, each a block's every step)
        return (For(sv, slots, loop(j, -(-most // slots), body, "rolled"), parallel=True),)

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
