"""MatMulInteger and ConvInteger: 8-bit products summed exactly in int32.

The fast path is the Gemm statement's 8-bit kinds (ir/loop.py), the shape of AVX-512
VNNI's vpdpbusd: A's bytes unsigned, B's signed, four products per int32 lane. Zero points
are taken out algebraically, so the inner loop multiplies raw bytes:

    sum_k (a - za)(w - zw) = sum_k a * w'  -  za * sum_k w'      with w' = w - zw

w' is computed at compile time (weights are constants) and must fit a signed byte, which
it does for onnxruntime's symmetric int8 weights and for uint8 weights around 128. Signed
activations are read as unsigned by adding 128 (a flip of the top bit), and za grows by 128
to match. The epilogue subtracts za * column sum (a constant, or a run-time za times a
constant) and then runs whatever the group fuses after the product: the dequantizing
multiply, bias, activation and requantize.

- MatMul reads A (activations, [M, K]) in place when K is a multiple of 4, else through a
  padded copy; B (weights) is packed [panel][k/4][nr][4] at compile time. On 8-lane x86
  without a byte dot product (AVX2) both operands are 16-bit for vpmaddwd (Gemm.b_words;
  exact, where AVX2's byte multiply saturates): B packed in pairs, A always copied, widened.
- Conv first copies the input, once, into a zero-point-bordered channels-last workspace
  (`[row][column][channel]`, channels padded to 4, signed bytes shifted to unsigned; 16x16
  blocks of channel quads x pixels transposed in registers), so
  that for one output row the micro-kernel reads A in place: pixel m at stride*C bytes,
  quad q at a compile-time offset (`a_ktab`, the (ky, kx, c/4) position). No im2col. The
  epilogue writes NCHW. (On AVX2 the workspace holds 16-bit elements.) A grouped conv whose
  groups hold 4k channels runs one such GEMM per group and row over the same copy.
- A 1x1 stride-1 conv instead packs the input into 4-channel panels and makes the weights
  the broadcast operand ("s8u8"): the tile's columns are pixels, stored contiguously. (On
  AVX2: the weights as 16-bit rows, the input packed in 16-bit pairs.)
- A depthwise conv sums bytes along output rows (`WindowDot`: four taps of 16 outputs per
  vpdpbusd) over a zero-point-bordered byte copy of each plane; where that does not apply,
  the float32 direct kernel on x - zx and w - zw, exactly.

Everything else (a weight computed at run time, per-row zero points, groups of other
sizes, weights whose centred values do not fit a byte) runs a plain int32 dot-product loop:
exact, scalar, and slower.
"""
from __future__ import annotations

import math

import numpy as np

from ..graph import Node
from ..loop import (TRANSPOSE_LANES, WINDOW_DOT_LANES, Assign, Cast, Const, For, If, Let, Load, Local, Store,
                    TransposeBlock, Var, WindowDot, add, cmp, div, fbin, flat_index, loop, mul, select, sub, unflatten,
                    window_dot_fits, window_dot_reach)
from .builder import KernelBuilder
from .gemm import conv_operands, gemm_stmt, is_depthwise, lower_depthwise, split_by_run_time_rows
from .planes import padded_copy
from .tile_rules import TILE_STEP_BYTES, tile_shape, tile_unit, whole_steps


def _input(node: Node, index: int) -> str:
    return node.inputs[index] if index < len(node.inputs) and node.inputs[index] else ""


def _zero_point(b: KernelBuilder, node: Node, index: int):
    """(its values as int32, or None when computed at run time; its name)."""
    name = _input(node, index)
    if not name:
        return np.zeros(1, np.int32), ""
    if name in b.g.constants:
        return b.g.constants[name].astype(np.int32).reshape(-1), name
    return None, name


def centered_weights(w: np.ndarray, zw: np.ndarray, axis: int, fits=np.int8) -> np.ndarray | None:
    """w - zw (per tensor, or per slice along `axis`) as `fits` (None: int32), or None if a
    value does not fit."""
    shape = [1] * w.ndim
    shape[axis] = -1
    wc = w.astype(np.int32) - (zw.reshape(shape) if zw.size > 1 else zw.reshape(()))
    if fits is None:
        return wc
    if wc.size and (wc.min() < np.iinfo(fits).min or wc.max() > np.iinfo(fits).max):
        return None
    return wc.astype(fits)


def pack_byte_panels(mat: np.ndarray, nr: int) -> np.ndarray:
    """[K, N] bytes -> [ceil(N/nr), ceil(K/4), nr, 4]: each int32 lane of a panel row holds
    four consecutive k of one column. Zero past K and N."""
    k, n = mat.shape
    quads, panels = -(-k // 4), -(-n // nr)
    padded = np.zeros((quads * 4, panels * nr), mat.dtype)
    padded[:k, :n] = mat
    return np.ascontiguousarray(padded.reshape(quads, 4, panels, nr).transpose(2, 0, 3, 1))


def pack_word_panels(mat: np.ndarray, nr: int) -> np.ndarray:
    """[K, N] signed bytes -> int16 [ceil(N/nr), ceil(K/4), 2, nr, 2]: per quad of k, two
    rows of nr int32 lanes, each holding two consecutive k of one column (Gemm.b_words)."""
    k, n = mat.shape
    quads, panels = -(-k // 4), -(-n // nr)
    padded = np.zeros((quads * 4, panels * nr), np.int16)
    padded[:k, :n] = mat
    return np.ascontiguousarray(padded.reshape(quads, 2, 2, panels, nr).transpose(3, 0, 1, 4, 2))


def _packed_weights(b: KernelBuilder, name: str, mats: np.ndarray, nr: int) -> tuple[str, int]:
    """B of an 8-bit GEMM as the target multiplies it, bytes in quads or 16-bit pairs: one
    [K, N] matrix, or [groups, K, N] packed one group after another. Returns the parameter
    and one matrix's size in 32-bit lanes (the unit of Gemm.b_off)."""
    pack, kind = (pack_word_panels, "words") if b.config.int8_pairs else (pack_byte_panels, "bytes")
    per_matrix = [pack(m, nr) for m in mats] if mats.ndim == 3 else [pack(mats, nr)]
    packed = np.stack(per_matrix) if mats.ndim == 3 else per_matrix[0]
    return b.constant_param(f"{name}_packed_{kind}", packed), per_matrix[0].nbytes // 4


def _za_correction(b: KernelBuilder, za, za_name: str, signed_a: bool, wsum: np.ndarray, base: str):
    """i -> za_u * wsum[i] as an i32 expression: the activations' zero point as the
    micro-kernel sees them (shifted by 128 for signed bytes) times the centred weights' sum
    over k for output column (or channel) i."""
    shift = 128 if signed_a else 0
    if za is not None:
        table = b.constant_param(f"{base}_zero_point_terms", ((int(za[0]) + shift) * wsum).astype(np.int32))
        return lambda nn: Load(table, nn)
    sums = b.constant_param(f"{base}_weight_sums", wsum.astype(np.int32))
    z = b.reader(za_name)([Const(0)] * len(b.shape(za_name)))
    za_u = fbin("add", Cast("i32", z), Const(shift, "i32"))
    return lambda nn: fbin("mul", za_u, Load(sums, nn))


def _unsigned_zero_point(b: KernelBuilder, za, za_name: str, signed_a: bool):
    """The activations' zero point as the unsigned byte the 8-bit kernels see (signed bytes
    shifted by 128): what the padding of a bordered copy holds, so that it adds nothing."""
    shift = 128 if signed_a else 0
    if za is not None:
        return Const(int(za[0]) + shift, "u8")
    z = b.reader(za_name)([Const(0)] * len(b.shape(za_name)))
    return Cast("u8", fbin("add", Cast("i32", z), Const(shift, "i32")))


def _padded_rows(mat: np.ndarray, rows: int, axis: int = -2) -> np.ndarray:
    """`mat` with zero rows appended along `axis` up to `rows` (weights past k meet A's padding)."""
    pad = [(0, 0)] * mat.ndim
    pad[axis] = (0, rows - mat.shape[axis])
    return np.pad(mat, pad) if rows > mat.shape[axis] else mat


# ---- MatMulInteger ------------------------------------------------------------------------

def lower_matmul_integer(b: KernelBuilder, node: Node, store) -> tuple:
    a_name, w_name = node.inputs[0], node.inputs[1]
    sa, sw = list(b.type(a_name).shape), list(b.type(w_name).shape)
    za, za_name = _zero_point(b, node, 2)
    zw, _ = _zero_point(b, node, 3)
    wc = None
    if (w_name in b.g.constants and len(sw) == 2 and len(sa) >= 2 and zw is not None
            and (za is None and b.type(za_name).size == 1 or za is not None and za.size == 1)):
        wc = centered_weights(b.g.constants[w_name], zw, 1)
    if wc is None:
        return _plain_matmul(b, node, store)
    k, n = sw
    lead = list(b.shape(a_name)[:-1])  # (ints, or expressions of run-time sizes)
    m, rows = math.prod(lead), math.prod(sa[:-1])  # (the rows as the kernel computes them; as a Dim)
    symbolic = not isinstance(m, int)
    signed_a = b.type(a_name).dtype == "int8"
    words = b.config.int8_pairs
    tiles = not words and tile_unit(b, m, k, whole_steps(k), n)
    tile = tile_shape(b, n) if tiles else b.tile(n)
    quads = whole_steps(k) // 4 if tiles else -(-k // 4)  # (A's rows in the GEMM)
    w_param, _ = _packed_weights(b, w_name, _padded_rows(wc, quads * 4), tile[1])
    # (signed A on tiles is multiplied as it is: tdpbssd; elsewhere it is shifted to unsigned)
    correction = _za_correction(b, za, za_name, signed_a and not tiles, wc.astype(np.int32).sum(axis=0), w_name)
    a_param = b.in_param(a_name)
    stmts = []
    if k != quads * 4 or words:
        # Rows padded to whole quads, or on tiles whole 64-byte steps (the pad elements meet
        # zero weights); for 16-bit pairs, widened once here rather than in every column
        # panel's pass over a row.
        storage = "i16" if words else "i8" if signed_a else "u8"
        a_buf = b.workspace(rows * quads * 4, storage)
        i, j = b.fresh("r"), b.fresh("k")
        value = Load(a_param, add(mul(Var(i), k), fbin("min", Var(j), Const(k - 1)) if k != quads * 4 else Var(j)))
        if words:
            value = Cast("i16", fbin("add", Cast("i32", value), Const(128, "i32")) if signed_a else value)
        if k != quads * 4:
            value = select(cmp("lt", Var(j), Const(k)), value, Const(0, storage))
        stmts.append(For(i, m, (For(j, quads * 4, (Store(a_buf, add(mul(Var(i), quads * 4), Var(j)), value),),
                                    "vectorize"),), parallel=True))
    else:
        a_buf = a_param

    def epilogue(mm, nn, acc):
        return store(unflatten(mm, lead) + [nn], fbin("sub", acc, correction(nn)))
    # (over run-time rows, divided among threads as a float MatMul's: lower_matmul_rows)
    return tuple(stmts) + split_by_run_time_rows(gemm_stmt(
        b, a_buf, Const(0), quads * 4, 1, w_param, Const(0), m, n, quads, epilogue,
        kind="s8s8" if signed_a and not words else "u8s8", b_words=words, split="n" if symbolic else "",
        tile=tile, tiles=tiles))


def _centered_reader(b: KernelBuilder, node: Node, index: int, zp_index: int, zp_axis_of):
    """idx -> int32 (operand - zero point) for the plain loops; zp_axis_of(idx) picks the
    zero point's element where it has one per row or column."""
    r = b.reader(node.inputs[index])
    zp = _input(node, zp_index)
    if not zp:
        return lambda idx: Cast("i32", r(idx))
    zr, per = b.reader(zp), b.type(zp).size > 1
    zshape = b.shape(zp)
    return lambda idx: fbin("sub", Cast("i32", r(idx)), Cast("i32", zr([zp_axis_of(idx)] if per else
                                                                       [Const(0)] * len(zshape))))


def _plain_matmul(b: KernelBuilder, node: Node, store) -> tuple:
    sa, sb = list(b.type(node.inputs[0]).shape), list(b.type(node.inputs[1]).shape)
    va, vb = len(sa) == 1, len(sb) == 1
    sa = [1] + sa if va else sa
    sb = sb + [1] if vb else sb
    k = sa[-1]
    oshape = b.type(node.outputs[0]).shape
    batch = list(np.broadcast_shapes(tuple(sa[:-2]), tuple(sb[:-2])))
    nb = len(batch)
    ra = _centered_reader(b, node, 0, 2, lambda idx: idx[-2])
    rb = _centered_reader(b, node, 1, 3, lambda idx: idx[-1])
    oa, ob = len(batch) - len(sa[:-2]), len(batch) - len(sb[:-2])

    def point(idx):
        rest = list(idx[nb:])
        mi = None if va else rest.pop(0)
        ni = None if vb else rest.pop(0)
        bi = list(idx[:nb])
        a_b = [Const(0) if d == 1 else bi[oa + i] for i, d in enumerate(sa[:-2])]
        b_b = [Const(0) if d == 1 else bi[ob + i] for i, d in enumerate(sb[:-2])]
        acc, kv = b.fresh("acc"), b.fresh("k")
        av = ra(([] if va else a_b + [mi]) + [Var(kv)]) if not va else ra([Var(kv)])
        bv = rb([Var(kv)] if vb else b_b + [Var(kv), ni])
        return [Local(acc, "i32", Const(0)), For(kv, k, (Assign(acc, fbin("add", Var(acc, "i32"), fbin("mul", av, bv))),)),
                *store(idx, Var(acc, "i32"))]
    return b.loops(oshape, point, inner_kind="serial", parallel=True)


# ---- ConvInteger --------------------------------------------------------------------------

def lower_conv_integer(b: KernelBuilder, node: Node, store) -> tuple:
    x_name, w_name = node.inputs[0], node.inputs[1]
    xs, wsh = b.type(x_name).shape, b.type(w_name).shape
    a = b.attrs(node)
    zx, zx_name = _zero_point(b, node, 2)
    zw, _ = _zero_point(b, node, 3)
    if w_name in b.g.constants and zw is not None and is_depthwise(b, node):
        return _depthwise(b, node, store, zx, zx_name, centered_weights(b.g.constants[w_name], zw, 0, fits=None))
    groups = a.get("group", 1)
    wc = None
    # (A group's channels start a quad of the channels-last copy when there are 4k of them.)
    if w_name in b.g.constants and len(xs) == 4 and zw is not None and (groups == 1 or wsh[1] % 4 == 0):
        wc = centered_weights(b.g.constants[w_name], zw, 0)
    if wc is None:
        return _plain_conv(b, node, store)
    # (its pixel panels are counted when it builds: over a run-time plane, the channels-last path)
    if groups == 1 and list(wsh[2:]) == [1, 1] and a["strides"] == [1, 1] and not any(a["pads"]) and \
            isinstance(math.prod(xs[2:]), int):
        return _pointwise(b, node, store, wc.reshape(wsh[0], -1), zx, zx_name)
    batch, cin, h, w_ = xs
    batch = b.dim(batch)  # (an int, or a run-time batch's expression)
    cout, cg = wsh[0], wsh[1]
    cog = cout // groups
    (kh, kw), (sh, sw), (dh, dw) = a["kernel_shape"], a["strides"], a["dilations"]
    pt, pl, pb, pr = a["pads"]
    oh, ow = b.type(node.outputs[0]).shape[2:]
    hp, wp = h + pt + pb, w_ + pl + pr  # (Dims over a run-time plane: the workspace's size)
    run_time_plane = not isinstance(hp * wp, int)
    plane = h, w_  # (ints, or Dims: what sizes workspaces)
    if run_time_plane:  # (from here on, the sizes as the kernel computes them)
        h, w_, oh, ow = b.dim(h), b.dim(w_), b.dim(oh), b.dim(ow)
    cp = -(-cin // 4) * 4
    signed_x = b.type(x_name).dtype == "int8"
    # Each group's weights as B[k][cog] with k = (ky, kx, c): channels innermost, as the input
    # copy lays them (one group: its channels padded to the copy's cp).
    cgp = cp if groups == 1 else cg
    wk = np.zeros((groups, kh, kw, cgp, cog), np.int8)
    wk[:, :, :, :cg, :] = wc.reshape(groups, cog, cg, kh, kw).transpose(0, 3, 4, 2, 1)
    quads = kh * kw * cgp // 4
    # On tiles, a stride-1 conv is one GEMM over the padded plane's rows laid end to end
    # (virtual_rows): A's pixels are then cp bytes apart throughout, so tiles fill 16 rows
    # across output rows, and each weight panel is read once per block of them, not once
    # per output row. The wp - ow pixels between rows are computed and not stored.
    virtual_rows = (oh - 1) * wp + ow if sh == sw == 1 and not run_time_plane else 0
    # (A's k in runs read in place on tiles: a window row's kw * cp bytes where dw is 1 and
    # one group spans the copy's channels, else each tap's cg; each run padded to whole steps)
    kruns = ((kh, dh * wp * cp),) if groups == 1 and dw == 1 else ((kh, dh * wp * cp), (kw, dw * cp))
    runs = math.prod(c for c, _ in kruns)
    run_bytes = whole_steps(kh * kw * cgp // runs)
    tiles = (not b.config.int8_pairs and not run_time_plane
             and tile_unit(b, virtual_rows or ow, kh * kw * cg, runs * run_bytes, cog))
    tile = tile_shape(b, cog) if tiles else b.tile(cog)
    wk = wk.reshape(groups, kh * kw * cgp, cog)
    tables, ktab_param = (), ""
    if tiles:
        wk = _padded_rows(wk.reshape(groups, runs, -1, cog), run_bytes).reshape(groups, -1, cog)
        quads = runs * run_bytes // 4
    else:
        kruns = ()
    w_param, group_panels = _packed_weights(b, w_name, wk, tile[1])
    if run_time_plane:  # (each quad's offset from its window's first, a row being wp pixels: at run time)
        ktab_param, (ky, kx, c4) = b.workspace(quads, "i64"), (b.fresh(v) for v in ("ky", "kx", "c4"))
        offset = add(mul(add(mul(mul(Var(ky), dh), b.dim(wp)), mul(Var(kx), dw)), cp), mul(Var(c4), 4))
        tables = (For(ky, kh, (For(kx, kw, (For(c4, cgp // 4, (
            Store(ktab_param, flat_index([Var(ky), Var(kx), Var(c4)], [kh, kw, cgp // 4]), offset),)),)),)),)
    elif not tiles:  # (on tiles, the runs instead)
        ktab = np.array([((ky * dh) * wp + kx * dw) * cp + 4 * c4 for ky in range(kh) for kx in range(kw)
                         for c4 in range(cgp // 4)], np.int64)
        ktab_param = b.constant_param("conv_quad_offsets", ktab)
    correction = _za_correction(b, zx, zx_name, signed_x, wc.reshape(cout, -1).astype(np.int32).sum(axis=1), w_name)
    za_u = _unsigned_zero_point(b, zx, zx_name, signed_x)
    xparam = b.in_param(x_name)
    # (on tiles, a run's last step may read past the copy's last pixel into padded weights' range)
    nhwc = b.workspace(hp * wp * cp + (TILE_STEP_BYTES if tiles else 0), "i16" if b.config.int8_pairs else "u8")
    if run_time_plane:
        hp, wp = b.dim(hp), b.dim(wp)
    bv = b.fresh("b")

    if b.config.vector_width >= TRANSPOSE_LANES:
        copy = _channels_last_copy(b, xparam, mul(Var(bv), mul(h, cin * w_) if run_time_plane else cin * h * w_), cin,
                                   *plane, a["pads"], cp, signed_x, za_u, nhwc)
    else:
        copy = _channels_last_gather(b, xparam, Var(bv), cin, batch, h, w_, a["pads"], cp, signed_x, za_u, nhwc,
                                     b.config.int8_pairs)

    orow, gv = b.fresh("oy"), b.fresh("g")
    if tiles:
        # One GEMM over the output plane: over a stride-1 conv's virtual rows (Gemm.m_rows, see
        # virtual_rows above), else in rows of ow pixels (Gemm.a_rows: tiles stay within a row,
        # each row's start from a table), so that a chunk of weight panels in L2 serves every
        # output row (one GEMM per output row read a 7 x 7 stage's 1.2 MB of weights 7 times).
        def at_pixel(mm, nn, acc):  # (mm: the output pixel)
            channel = add(mul(Var(gv), cog), nn) if groups > 1 else nn
            return store([Var(bv), channel] + unflatten(mm, [oh, ow]), fbin("sub", acc, correction(channel)))
        rows = dict(m_rows=(wp, ow)) if virtual_rows else dict(
            a_mtab=b.constant_param("conv_row_starts", np.arange(oh, dtype=np.int64) * (sh * wp * cp)), a_rows=ow)
        gemm = gemm_stmt(b, nhwc, mul(Var(gv), cg), cp if virtual_rows else sw * cp, 0, w_param,
                         mul(Var(gv), group_panels), virtual_rows or oh * ow, cog, quads, at_pixel, kind="u8s8",
                         stores_along="m", tile=tile, tiles=True, a_kruns=kruns, **rows)
        return loop(bv, batch, (copy, *loop(gv, groups, (gemm,))))

    def epilogue(mm, nn, acc):
        channel = add(mul(Var(gv), cog), nn) if groups > 1 else nn
        return store([Var(bv), channel, Var(orow), mm], fbin("sub", acc, correction(channel)))
    gemm = gemm_stmt(b, nhwc, add(mul(Var(orow), mul(wp, sh * cp)), mul(Var(gv), cg)), sw * cp, 0, w_param,
                     mul(Var(gv), group_panels), ow, cog, quads, epilogue, a_ktab=ktab_param, kind="u8s8",
                     stores_along="m", b_words=b.config.int8_pairs, split="n" if run_time_plane else "",
                     tile=tile)
    return tables + loop(bv, batch, (copy, For(orow, oh, loop(gv, groups, (gemm,)), parallel=True)))


def _channels_last_copy(b: KernelBuilder, xparam: str, base, cin: int, h: int, w_: int, pads: list, cp: int,
                        signed_x: bool, za_u, nhwc: str) -> For:
    """The int8 conv's input, NCHW, into the zero-point-bordered channels-last workspace
    [row][column][cp channels] as unsigned bytes, per input row in two steps: each quad of 4
    channels into one i32 per pixel, [quad][pixel] (contiguous loads and stores), then
    16 x 16 blocks of those transposed in registers into [pixel][quad] (TransposeBlock).
    Read element by element, the copy was a byte gather per channel: a tenth of ResNet-18
    int8's 3x3 conv time."""
    pt, pl, pb, pr = pads
    quads = cp // 4
    quad_rows = b.workspace(h * quads * w_, "i32")  # [input row][quad][column]
    h, w_ = b.dim(h), b.dim(w_)  # (over a run-time plane, from here on expressions)
    hp, wp = (h + pt + pb, w_ + pl + pr) if isinstance(h, int) and isinstance(w_, int) else \
        (add(h, pt + pb), add(w_, pl + pr))
    y, c4, x, j = b.fresh("y"), b.fresh("c4"), b.fresh("x"), b.fresh("j")
    iy = sub(Var(y), pt)
    fill_u8 = Cast("i32", za_u)

    def channel_byte(kk: int):  # channel 4*c4 + kk at (iy, x) as an unsigned byte, in an i32
        c = add(mul(Var(c4), 4), kk)
        v = Cast("i32", Load(xparam, add(base, add(mul(fbin("min", c, Const(cin - 1)) if cin % 4 else c, mul(h, w_)),
                                                   add(mul(iy, w_), Var(x))))))
        if signed_x:
            v = fbin("add", v, Const(128, "i32"))
        if cin % 4:
            v = select(cmp("lt", c, Const(cin)), v, fill_u8)
        return v
    shifted = [fbin("shl", channel_byte(kk), Const(8 * kk, "i32")) if kk else channel_byte(kk) for kk in range(4)]
    quad = fbin("or", fbin("or", shifted[0], shifted[1]), fbin("or", shifted[2], shifted[3]))
    pack = For(c4, quads, (For(x, w_, (Store(quad_rows, add(mul(add(mul(iy, quads), Var(c4)), w_), Var(x)), quad),),
                               "vectorize"),))
    blocks = []
    if quads == 1:  # (a stem's 3 channels: each pixel's 4 bytes are its whole channels-last entry)
        pixel = mul(add(mul(Var(y), wp), add(Var(x), pl)), 4)
        pixel_bytes = tuple(Store(nhwc, add(pixel, kk), Cast("u8", channel_byte(kk))) for kk in range(4))
        pack = For(c4, 1, (For(x, w_, pixel_bytes, "vectorize"),))

    def block(q0: int, x0, cols) -> TransposeBlock:
        return TransposeBlock(quad_rows, mul(add(mul(add(mul(iy, quads), q0), w_), x0), 4),
                              w_ * 4 if isinstance(w_, int) else mul(w_, 4),
                              nhwc, add(mul(add(mul(Var(y), wp), add(x0, pl)), cp), 4 * q0), cp,
                              min(TRANSPOSE_LANES, quads - q0), cols)
    for q0 in range(0, quads if quads > 1 else 0, TRANSPOSE_LANES):
        if isinstance(w_, int):
            blocks += [block(q0, x0, min(TRANSPOSE_LANES, w_ - x0)) for x0 in range(0, w_, TRANSPOSE_LANES)]
        else:  # (a run-time width: a loop of blocks, the last one's columns counted when it runs)
            xb = b.fresh("xb")
            x0 = mul(Var(xb), TRANSPOSE_LANES)
            blocks.append(For(xb, div(add(w_, TRANSPOSE_LANES - 1), TRANSPOSE_LANES),
                              (block(q0, x0, fbin("min", sub(w_, x0), Const(TRANSPOSE_LANES))),)))

    def fill(first_pixel, pixels) -> tuple:
        if isinstance(pixels, int) and pixels <= 0:
            return ()
        at = add(mul(add(mul(Var(y), wp), first_pixel), cp), Var(j))
        return (For(j, pixels * cp if isinstance(pixels, int) else mul(pixels, cp), (Store(nhwc, at, za_u),),
                    "vectorize"),)
    inside = fbin("and", cmp("ge", Var(y), Const(pt)), cmp("lt", Var(y), add(h, pt)))
    return For(y, hp, (If(inside, (*fill(0, pl), pack, *blocks, *fill(add(w_, pl), pr)), fill(0, wp)),), parallel=True)


def _channels_last_gather(b: KernelBuilder, xparam: str, bv, cin: int, batch, h: int, w_: int, pads: list,
                          cp: int, signed_x: bool, za_u, nhwc: str, words: bool) -> For:
    """The same copy element by element, for targets with narrower vectors; with `words`,
    each byte widened to 16 bits (the GEMM's B is packed in 16-bit pairs)."""
    pt, pl, pb, pr = pads
    hp, wp = (h + pt + pb, w_ + pl + pr) if isinstance(h, int) and isinstance(w_, int) else \
        (add(h, pt + pb), add(w_, pl + pr))  # (a run-time plane's expressions)
    y, xx, c = b.fresh("y"), b.fresh("x"), b.fresh("c")
    iy, ix = sub(Var(y), pt), sub(Var(xx), pl)
    inside = fbin("and", fbin("and", cmp("ge", iy, Const(0)), cmp("lt", iy, h)),
                  fbin("and", fbin("and", cmp("ge", ix, Const(0)), cmp("lt", ix, w_)),
                       cmp("lt", Var(c), Const(cin))))
    src = flat_index([add(mul(bv, cin), fbin("min", Var(c), Const(cin - 1))),
                      fbin("min", fbin("max", iy, Const(0)), sub(h, 1)),
                      fbin("min", fbin("max", ix, Const(0)), sub(w_, 1))], [mul(batch, cin), h, w_])
    loaded = Load(xparam, src)
    as_unsigned = Cast("u8", fbin("add", Cast("i32", loaded), Const(128, "i32"))) if signed_x else loaded
    value = select(inside, as_unsigned, za_u)
    if words:  # (Gemm.b_words: A in 16-bit elements)
        value = Cast("i16", value)
    return For(y, hp, (For(xx, wp, (For(c, cp, (Store(nhwc, flat_index([Var(y), Var(xx), Var(c)], [hp, wp, cp]),
                                                      value),), "vectorize"),)),),
               parallel=True)


def _pointwise(b: KernelBuilder, node: Node, store, wc: np.ndarray, zx, zx_name: str) -> tuple:
    """A 1x1 stride-1 conv as C[cout][pixel] = W'[cout][c] x X[c][pixel] ("s8u8": the weights
    are the broadcast operand): the input is packed once into panels of 4 interleaved
    channels, and the tile's columns are pixels, so the epilogue writes NCHW rows
    contiguously (the channels-last path would scatter them)."""
    x_name = node.inputs[0]
    batch, cin, h, w_ = b.type(x_name).shape
    batch = b.dim(batch)  # (an int, or a run-time batch's expression)
    cout, pixels = wc.shape[0], h * w_
    signed_x = b.type(x_name).dtype == "int8"
    words = b.config.int8_pairs  # (Gemm.b_words: both operands in 16-bit elements)
    tiles = not words and tile_unit(b, cout, cin, whole_steps(cin), h * w_)
    cp = whole_steps(cin) if tiles else -(-cin // 4) * 4  # (k, padded)
    quads = cp // 4
    a_rows = np.zeros((cout, cp), np.int16 if words else np.int8)
    a_rows[:, :cin] = wc
    w_param = b.constant_param(f"{node.inputs[1]}_rows_{'words' if words else 'bytes'}", a_rows)
    correction = _za_correction(b, zx, zx_name, signed_x, wc.astype(np.int32).sum(axis=1), node.inputs[1])
    tile = tile_shape(b, pixels) if tiles else b.tile(pixels)
    nr = tile[1]
    panels = -(-pixels // nr)
    packed = b.workspace(panels * quads * nr * 4, "i16" if words else "u8")
    xparam = b.in_param(x_name)
    bv, q, p, j = b.fresh("b"), b.fresh("q"), b.fresh("p"), b.fresh("j")

    def lanes(panel, col, inside: bool) -> tuple:
        """Channels 4q..4q+3 of pixel panel*nr + col, as unsigned bytes (zero past the edges)."""
        out = []
        for kk in range(4):
            c = add(mul(Var(q), 4), kk)
            v = Const(0, "u8")
            if inside:
                v = Load(xparam, add(mul(add(mul(Var(bv), cin), fbin("min", c, Const(cin - 1)) if cin < cp else c),
                                         pixels), add(mul(panel, nr), col)))
                if signed_x:
                    v = Cast("u8", fbin("add", Cast("i32", v), Const(128, "i32")))
                if cin < cp:
                    v = select(cmp("lt", c, Const(cin)), v, Const(0, "u8"))
            row = add(mul(panel, quads), Var(q))
            if words:  # [panel][quad][pair][column][2]
                at = add(mul(add(mul(add(mul(row, 2), kk // 2), nr), col), 2), kk % 2)
                v = Cast("i16", v)
            else:  # [panel][quad][column][4]
                at = add(mul(add(mul(row, nr), col), 4), kk)
            out.append(Store(packed, at, v))
        return tuple(out)
    # The partial last panel has loops of its own: a clamped pixel index in one loop over
    # every panel made each load a byte gather (MobileNetV2's 784-pixel layers).
    full, rest = divmod(pixels, nr)
    per_quad = [For(p, full, (For(j, nr, lanes(Var(p), Var(j), True), "vectorize"),))] if full else []
    if rest:
        per_quad += [For(j, rest, lanes(Const(full), Var(j), True), "vectorize"),
                     For(j, nr - rest, lanes(Const(full), add(Var(j), rest), False), "vectorize")]
    pack = For(q, quads, tuple(per_quad), parallel=True)

    def epilogue(mm, nn, acc):
        return store([Var(bv), mm] + unflatten(nn, [h, w_]), fbin("sub", acc, correction(mm)))
    # (Divided by rows of channels: by pixel panels, this few-quad GEMM ran 4x slower, measured.)
    gemm = gemm_stmt(b, w_param, Const(0), cp, 1, packed, Const(0), cout, pixels, quads, epilogue, kind="s8u8",
                     split="m", b_words=words, tile=tile, tiles=tiles)
    return loop(bv, batch, (pack, gemm))


def _depthwise(b: KernelBuilder, node: Node, store, zx, zx_name: str, wc: np.ndarray) -> tuple:
    """Depthwise ConvInteger on bytes (`_depthwise_bytes`) where a 64-byte register holds 16
    outputs' inputs for a quad of taps, the centred weights fit a signed byte and the plane's
    size is known when it builds; otherwise
    as the float32 depthwise kernel on x - zx and w - zw: each product is an integer below
    2^16 and a window's sum below 2^24 for windows up to 16x16, so float32 holds every sum
    exactly, and the direct kernel vectorizes along output rows."""
    a = b.attrs(node)
    static_plane = isinstance(math.prod(b.type(node.inputs[0]).shape[2:]), int)  # (WindowDot's rows are)
    if (b.config.vector_width >= WINDOW_DOT_LANES and wc.min() >= -128 and wc.max() <= 127 and static_plane
            and window_dot_fits(a["strides"][1], a["dilations"][1], a["kernel_shape"][1])):
        return _depthwise_bytes(b, node, store, zx, zx_name, wc.astype(np.int8))
    if wc.shape[2] * wc.shape[3] * 255 * 255 >= 1 << 24:
        return _plain_conv(b, node, store)
    weights = b.constant_param(f"{node.inputs[1]}_float", wc.astype(np.float32))
    zero = Const(float(zx[0]), "f32") if zx is not None else \
        Cast("f32", b.reader(zx_name)([Const(0)] * len(b.shape(zx_name))))
    centred = lambda v: fbin("sub", Cast("f32", v), zero)  # noqa: E731
    # (exact integers within int32's range: the clamp lets the conversion skip saturation)
    as_int = lambda total: Cast("i32", fbin("min", fbin("max", total, Const(-2.0 ** 31, "f32")),  # noqa: E731
                                            Const(2.0 ** 31 - 128, "f32")))
    return lower_depthwise(b, node, store, centred, weights, as_int)


def _depthwise_bytes(b: KernelBuilder, node: Node, store, zx, zx_name: str, wc: np.ndarray) -> tuple:
    """Depthwise ConvInteger summed in int32 by WindowDot: per input channel, a bordered copy
    of its plane in unsigned bytes (the border holds the zero point, signed bytes shifted by
    128), then per output row 16 outputs at a time, four taps per vpdpbusd, into a row of
    int32 sums; the epilogue subtracts zx * (the channel's weight sum) and runs the group's
    fused ops. The float32 kernel converts every input and multiplies one tap at a time."""
    x_name, w_name = node.inputs[0], node.inputs[1]
    batch, cin, h, w_ = b.type(x_name).shape
    batch = b.dim(batch)  # (an int, or a run-time batch's expression)
    cout, _, kh, kw = wc.shape
    mult = cout // cin
    a = b.attrs(node)
    (sh, sw), (dh, dw) = a["strides"], a["dilations"]
    pt, pl, pb, pr = a["pads"]
    oh, ow = b.type(node.outputs[0]).shape[2:]
    hp, wp = h + pt + pb, w_ + pl + pr
    quads = -(-kw // 4)
    taps = np.zeros((cout, kh, quads * 4), np.int8)  # each i32 holds 4 taps of a window row, byte j = tap 4q+j
    taps[:, :, :kw] = wc[:, 0]
    w_param = b.constant_param(f"{w_name}_tap_quads", taps.view("<i4").astype(np.int32).reshape(-1))
    signed_x = b.type(x_name).dtype == "int8"
    correction = _za_correction(b, zx, zx_name, signed_x, wc.astype(np.int32).reshape(cout, -1).sum(axis=1), w_name)
    border = _unsigned_zero_point(b, zx, zx_name, signed_x)
    as_unsigned = (lambda v: Cast("u8", fbin("add", Cast("i32", v), Const(128, "i32")))) if signed_x else None
    bv, m, co, r, q = b.fresh("b"), b.fresh("m"), b.fresh("co"), b.fresh("r"), b.fresh("q")
    # The last channel's last window row is read up to `reach` bytes from its start.
    last_start = (cin - 1) * hp * wp + ((oh - 1) * sh) * wp + (kh - 1) * dh * wp
    planes = b.workspace(max(cin * hp * wp, last_start + window_dot_reach(sw, dw, kw, ow)), "u8")
    width = -(-ow // WINDOW_DOT_LANES) * WINDOW_DOT_LANES
    sums = b.workspace(cout * width, "i32")  # one row per output channel: channels run in parallel
    copy = padded_copy(b, b.in_param(x_name), mul(Var(bv), cin * h * w_), cin, [h, w_], [pt, pl, pb, pr], planes,
                       as_unsigned or (lambda v: v), border, row_kind="vector_masked")
    c = copy.var
    dot = WindowDot(planes, add(mul(Var(c), hp * wp), mul(Var(r), sh * wp)), dh * wp, sw, dw, w_param,
                    mul(Var(co), kh * quads), kh, kw, ow, sums, mul(Var(co), width))
    point = store([Var(bv), Var(co), Var(r), Var(q)],
                  fbin("sub", Load(sums, add(mul(Var(co), width), Var(q))), correction(Var(co))))
    rows = For(r, oh, (dot, For(q, ow, tuple(point), "masked")))
    per_output = For(m, mult, (Let(co, add(mul(Var(c), mult), Var(m))), rows))
    return loop(bv, batch, (For(c, cin, (*copy.body, per_output), parallel=True),))


def _plain_conv(b: KernelBuilder, node: Node, store) -> tuple:
    """Direct convolution in int32, any group and rank: exact, for what the fast path skips."""
    _, _, xs, wsh, groups, kernel, strides, dil, pads = conv_operands(b, node)
    nsp = len(kernel)
    cg, cog = wsh[1], wsh[0] // groups
    rx = _centered_reader(b, node, 0, 2, lambda idx: Const(0))
    rw = _centered_reader(b, node, 1, 3, lambda idx: idx[0])
    oshape = b.type(node.outputs[0]).shape

    def point(oidx):
        acc, ci = b.fresh("acc"), b.fresh("ci")
        chan = add(mul(fbin("div", oidx[1], Const(cog)), cg), Var(ci))

        def tap(kidx):
            ok, pos = None, []
            for i in range(nsp):
                p = add(sub(mul(oidx[2 + i], strides[i]), pads[i]), mul(kidx[i], dil[i]))
                inb = fbin("and", cmp("ge", p, Const(0)), cmp("lt", p, Const(xs[2 + i])))
                ok = inb if ok is None else fbin("and", ok, inb)
                pos.append(fbin("min", fbin("max", p, Const(0)), Const(xs[2 + i] - 1)))
            term = fbin("mul", rx([oidx[0], chan] + pos), rw([oidx[1], Var(ci)] + list(kidx)))
            return [Assign(acc, fbin("add", Var(acc, "i32"), select(ok, term, Const(0, "i32"))))]
        taps = b.loops(kernel, tap, inner_kind="unroll")
        return [Local(acc, "i32", Const(0)), For(ci, cg, tuple(taps)), *store(oidx, Var(acc, "i32"))]
    return b.loops(oshape, point, inner_kind="serial", parallel=True)
