"""Convolutions in bf16 precision on AMX's tile unit (`precision="bf16"`, Gemm kind "bf16").

The contract is the bf16 GEMM's (ir/lower/bf16_gemm.py): input and weights rounded to
bfloat16 (to nearest, ties to even), their products summed in float32, the bias and
whatever the group fuses after the conv in float32. The structure is the int8 conv's on
tiles (ir/lower/integer_gemm.py, lower_conv_integer):

- The input is copied once per image into a zero-bordered channels-last workspace of
  bfloat16, [row][column][cp channels] (cp: the channels rounded up to a pair), per input row
  in two steps: each pair of channels into one 32-bit lane per pixel, [pair][pixel]
  (contiguous loads), then 16 x 16 blocks of lanes transposed in registers into
  [pixel][pair] (TransposeBlock).
- The GEMM reads that copy in place: k runs along a window row (kw * cp elements where the
  conv has one group and no column dilation, else each tap's channels), each run padded to
  whole 64-byte steps with zero weights (Gemm.a_kruns). A stride-1 conv is one GEMM over the
  padded plane's rows laid end to end (Gemm.m_rows), a strided one over rows of ow pixels
  (Gemm.a_rows, each row's start from a table).
- The weights are packed at build time as bfloat16 pairs, [group][panel][k / 2][nr][2].
- A 1x1 stride-1 conv of one group is the other way round (_lower_pointwise): the weights
  are A and the input B, so the tiles' columns are pixels and their rows reach NCHW as they
  are, with no transpose in the write-back.
- Where a window row's k is not whole 64-byte steps (a stem's 7 pixels of 4 channels), its
  padded steps read the next pixel against zero weights: a NaN or infinite input value
  there makes its neighbours' outputs NaN (docs/targets-and-precision.md says so).

Convs that do not take this path (depthwise ones, convs over run-time sizes, convs with
groups of odd channel counts, those the cost rule keeps off the tiles, and every conv on a
target without AMX-BF16) compute in float32, as in an fp32 build.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..graph import Node
from ..loop import TRANSPOSE_LANES, Const, For, If, Load, Store, TransposeBlock, Var, add, cmp, fbin, loop, mul, \
    select, sub, unflatten
from .bf16_gemm import PAIR_STEP, bf16_bits, pack_pair_panels
from .builder import KernelBuilder
from .gemm import gemm_stmt, is_depthwise
from .tile_rules import tile_shape, tile_unit, whole_steps


def _whole_steps(elements: int) -> int:
    """bfloat16 elements rounded up to whole 64-byte k steps on tiles."""
    return whole_steps(2 * elements) // 2


@dataclass(frozen=True)
class _Geometry:
    """How a conv's GEMM on tiles reads its copy: channels padded to pairs (cp; a group's cgp),
    A's runs of k (Gemm.a_kruns, strides in elements), each run's real and padded elements,
    and the rows of the GEMM (virtual rows for stride 1, else 0 and rows of ow pixels)."""
    cp: int
    cgp: int
    kruns: tuple
    run: int
    run_padded: int
    virtual_rows: int

    @property
    def count(self) -> int:  # (runs of k per output)
        return math.prod(c for c, _ in self.kruns)


def _geometry(b: KernelBuilder, node: Node) -> _Geometry:
    cin, w_ = b.type(node.inputs[0]).shape[1], b.type(node.inputs[0]).shape[3]
    a = b.attrs(node)
    groups = a.get("group", 1)
    _, cg, kh, kw = b.type(node.inputs[1]).shape
    (dh, dw), (pl, pr) = a["dilations"], (a["pads"][1], a["pads"][3])
    oh, ow = b.type(node.outputs[0]).shape[2:]
    wp, cp = w_ + pl + pr, -(-cin // 2) * 2
    cgp = cp if groups == 1 else cg
    if groups == 1 and dw == 1:  # (a window row's kw * cp elements are contiguous in the copy)
        kruns, run = ((kh, dh * wp * cp),), kw * cp
    else:
        kruns, run = ((kh, dh * wp * cp), (kw, dw * cp)), cgp
    virtual_rows = (oh - 1) * wp + ow if a["strides"] == [1, 1] else 0
    return _Geometry(cp, cgp, kruns, run, _whole_steps(run), virtual_rows)


def conv_on_tiles(b: KernelBuilder, node: Node) -> bool:
    """Whether a conv runs as a bf16 GEMM on tiles: a bf16 build for a target with AMX-BF16,
    a 2-D float32 conv over static planes with constant weights, not depthwise, each group's
    channels a whole number of pairs, and the tiles' cost rule (tile_rules.tile_unit)."""
    if not (b.in_bf16() and b.config.bf16_tiles):
        return False
    x_name, w_name = node.inputs[0], node.inputs[1]
    xs = b.type(x_name).shape
    if (len(xs) != 4 or w_name not in b.g.constants or b.type(x_name).dtype != "float32"
            or not all(isinstance(d, int) for d in xs[1:]) or is_depthwise(b, node)):
        return False
    groups = b.attrs(node).get("group", 1)
    cout, cg, kh, kw = b.type(w_name).shape
    if groups > 1 and cg % 2:
        return False
    if _pointwise(b, node):
        return tile_unit(b, cout, 2 * cg, 2 * _whole_steps(cg), math.prod(xs[2:]), bf16=True)
    geo = _geometry(b, node)
    return tile_unit(b, geo.virtual_rows or b.type(node.outputs[0]).shape[3], 2 * kh * kw * cg,
                     2 * geo.count * geo.run_padded, cout // groups, bf16=True)


def _pointwise(b: KernelBuilder, node: Node) -> bool:
    """A 1x1 stride-1 conv of one group without padding: the input is already B, pixels by channels."""
    a = b.attrs(node)
    return (a.get("group", 1) == 1 and list(b.type(node.inputs[1]).shape[2:]) == [1, 1]
            and a["strides"] == [1, 1] and not any(a["pads"]))


def _bias_and_store(b: KernelBuilder, node: Node, store, image, spatial: list):
    """(channel, pixel, acc) -> the epilogue's statements: the bias added, stored at [image,
    channel, pixel] (the pixel unflattened where the epilogue indexes every spatial dim)."""
    bias = b.reader(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else None

    def at(channel, pixel, acc):
        value = acc if bias is None else fbin("add", acc, bias([channel]))
        return store([image, channel] + ([pixel] if b.conv_collapsed else unflatten(pixel, spatial)), value)
    return at


def lower_conv_bf16(b: KernelBuilder, node: Node, store) -> tuple:
    """The conv on tiles (see the module's docstring); conv_on_tiles must hold."""
    b.reduced = True
    if _pointwise(b, node):
        return _lower_pointwise(b, node, store)
    x_name, w_name = node.inputs[0], node.inputs[1]
    batch, cin, h, w_ = b.type(x_name).shape
    batch = b.dim(batch)  # (an int, or a run-time batch's expression)
    a = b.attrs(node)
    groups = a.get("group", 1)
    cout, cg, kh, kw = b.type(w_name).shape
    cog = cout // groups
    sh, sw = a["strides"]
    pt, pl, pb, pr = a["pads"]
    oh, ow = b.type(node.outputs[0]).shape[2:]
    hp, wp = h + pt + pb, w_ + pl + pr
    geo = _geometry(b, node)
    cp, count, run, run_padded = geo.cp, geo.count, geo.run, geo.run_padded
    tile = tile_shape(b, cog)

    def packed() -> np.ndarray:
        # Each group's weights as B[k][cog], k = (ky, kx, c) with channels innermost as the
        # copy lays them, each run of k padded to whole steps with zeros.
        wk = np.zeros((groups, kh, kw, geo.cgp, cog), np.float32)
        wk[:, :, :, :cg, :] = b.g.constants[w_name].reshape(groups, cog, cg, kh, kw).transpose(0, 3, 4, 2, 1)
        wk = wk.reshape(groups, count, run, cog)
        wk = np.pad(wk, ((0, 0), (0, 0), (0, run_padded - run), (0, 0))).reshape(groups, count * run_padded, cog)
        return np.stack([pack_pair_panels(m, count * run_padded, tile[1]) for m in wk])
    w_param = b.packed_param(f"{w_name}_bf16_conv_pairs", ("bf16 conv pairs", w_name, groups, geo, tile[1]), packed)
    group_lanes = -(-cog // tile[1]) * count * run_padded // 2 * tile[1]
    # (a run's last step may read past the copy's last pixel, into zero weights' range)
    nhwc = b.workspace(hp * wp * cp + PAIR_STEP, "bf16")
    bv, gv = b.fresh("b"), b.fresh("g")
    epilogue = _bias_and_store(b, node, store, Var(bv), [oh, ow])
    copy = _channels_last_copy(b, b.in_param(x_name), mul(Var(bv), cin * h * w_), cin, h, w_, a["pads"], cp, nhwc)
    # (the slack past the plane meets zero weights only: zeros there, not the arena's old bits, which may be NaN)
    slack = b.fresh("s")
    zero_slack = For(slack, PAIR_STEP, (Store(nhwc, add(hp * wp * cp, Var(slack)), Const(0.0, "f32")),), "vectorize")

    def at_pixel(mm, nn, acc):  # (mm: the output pixel)
        return epilogue(add(mul(Var(gv), cog), nn) if groups > 1 else nn, mm, acc)
    rows = dict(m_rows=(wp, ow)) if geo.virtual_rows else dict(
        a_mtab=b.constant_param("conv_row_starts", np.arange(oh, dtype=np.int64) * (sh * wp * cp)), a_rows=ow)
    gemm = gemm_stmt(b, nhwc, mul(Var(gv), cg), cp if geo.virtual_rows else sw * cp, 0, w_param,
                     mul(Var(gv), group_lanes), geo.virtual_rows or oh * ow, cog, count * run_padded // 2, at_pixel,
                     kind="bf16", stores_along="m", tile=tile, tiles=True, a_kruns=geo.kruns, **rows)
    return (zero_slack, *loop(bv, batch, (copy, *loop(gv, groups, (gemm,)))))


def _channels_last_copy(b: KernelBuilder, xparam: str, base, cin: int, h: int, w_: int, pads: list, cp: int,
                        nhwc: str) -> For:
    """One image's NCHW float32 input into the zero-bordered channels-last bfloat16 workspace
    [row][column][cp], per input row: channel pairs into 32-bit lanes [pair][column] (both
    halves stored as the row is read along its columns), then 16 x 16 blocks of lanes
    transposed in registers into [column][pair]."""
    pt, pl, pb, pr = pads
    pairs = cp // 2
    hp, wp = h + pt + pb, w_ + pl + pr
    pair_rows = b.workspace(h * pairs * w_ * 2, "bf16")  # [input row][pair][column][2]
    y, j = b.fresh("y"), b.fresh("j")
    iy = sub(Var(y), pt)
    pack = _pair_lanes(b, xparam, base, cin, pairs, iy, w_, h * w_, pair_rows)
    blocks = [TransposeBlock(pair_rows, mul(add(mul(add(mul(iy, pairs), p0), w_), x0), 4), w_ * 4,
                             nhwc, mul(add(mul(add(mul(Var(y), wp), x0 + pl), cp), 2 * p0), 2), cp * 2,
                             min(TRANSPOSE_LANES, pairs - p0), min(TRANSPOSE_LANES, w_ - x0))
              for p0 in range(0, pairs, TRANSPOSE_LANES) for x0 in range(0, w_, TRANSPOSE_LANES)]

    def zeros(first_pixel: int, pixels: int) -> tuple:
        if pixels <= 0:
            return ()
        return (For(j, pixels * cp, (Store(nhwc, add(mul(add(mul(Var(y), wp), first_pixel), cp), Var(j)),
                                           Const(0.0, "f32")),), "vectorize"),)
    inside = fbin("and", cmp("ge", Var(y), Const(pt)), cmp("lt", Var(y), Const(h + pt)))
    return For(y, hp, (If(inside, (*zeros(0, pl), pack, *blocks, *zeros(w_ + pl, pr)), zeros(0, wp)),), parallel=True)


def _pair_lanes(b: KernelBuilder, xparam: str, base, cin: int, pairs: int, row, width: int, plane: int, dest: str,
                parallel: bool = False) -> For:
    """Input row `row` of an image (from `base`, channel planes `plane` apart, rows `width`)
    as `dest`'s [row][pair][column][2]: channels 2p and 2p + 1 of a pixel side by side in
    one 32-bit lane, each as bfloat16; pairs past the channels are zeros."""
    p, x = b.fresh("p"), b.fresh("x")

    def channel(half: int):
        c = add(mul(Var(p), 2), half)
        if 2 * pairs == cin:
            return Load(xparam, add(base, add(mul(c, plane), add(mul(row, width), Var(x)))))
        value = Load(xparam, add(base, add(mul(fbin("min", c, Const(cin - 1)), plane), add(mul(row, width), Var(x)))))
        return select(cmp("lt", c, Const(cin)), value, Const(0.0, "f32"))
    lane = add(mul(add(mul(row, pairs), Var(p)), width), Var(x))
    return For(p, pairs, (For(x, width, tuple(Store(dest, add(mul(lane, 2), half), channel(half)) for half in range(2)),
                              "vectorize"),), parallel=parallel)


def _lower_pointwise(b: KernelBuilder, node: Node, store) -> tuple:
    """A 1x1 conv with the weights as A: C[cout][pixel] = W[cout][k] x X[k][pixel], so that
    the tiles' rows are channels and their columns pixels, stored along NCHW's rows as they
    are (a conv's usual form, pixels as rows, transposes every tile into its write-back: with
    a k of one or two steps that cost more than the products). The input is B read in place
    (Gemm.b_sk) from a copy of channel pairs interleaved into 32-bit lanes, [pair][pixel]: no
    transpose. The weights are bfloat16 rows padded to whole 32-element steps; the copy's
    pairs past the channels are zeros, so the padding adds nothing."""
    x_name, w_name = node.inputs[0], node.inputs[1]
    batch, cin = b.type(x_name).shape[:2]
    batch, spatial = b.dim(batch), list(b.type(x_name).shape[2:])
    pixels = math.prod(spatial)
    cout = b.type(w_name).shape[0]
    kp = _whole_steps(cin)
    tile = tile_shape(b, pixels)

    def rows() -> np.ndarray:
        padded = np.zeros((cout, kp), np.float32)
        padded[:, :cin] = b.g.constants[w_name].reshape(cout, cin)
        return bf16_bits(padded)
    w_rows = b.packed_param(f"{w_name}_bf16_rows", ("bf16 rows", w_name, kp), rows)
    # [pair][pixel][2], and a panel's width of slack: the last panel's tiles read past the last
    # pixel (columns the write-back does not store)
    pairs = b.workspace(kp * pixels + 2 * tile[1], "bf16")
    bv = b.fresh("b")
    # (the plane as one row of all its pixels)
    copy = _pair_lanes(b, b.in_param(x_name), mul(Var(bv), cin * pixels), cin, kp // 2, Const(0), pixels, pixels,
                       pairs, parallel=True)
    epilogue = _bias_and_store(b, node, store, Var(bv), spatial)
    gemm = gemm_stmt(b, w_rows, Const(0), kp, 0, pairs, Const(0), cout, pixels, kp // 2, epilogue, kind="bf16",
                     b_sk=pixels, stores_along="n", tile=tile, tiles=True)
    return loop(bv, batch, (copy, gemm))
