"""Conv, MatMul and Gemm as register-blocked GEMMs; depthwise and transposed conv directly.

Convolution (NCHW) computes C[pixel][cout] = col[pixel][k] x W[k][cout]: the weights are
the B operand, packed at compile time into panels of nr columns ([panel][k][nr], zero
padded), and the A operand is the im2col matrix stored in row blocks
(col[pixel // mr][k][pixel % mr]), so a micro-kernel row block's A is one contiguous run,
its mr pixels for one k side by side. A 1x1 stride-1 conv needs no im2col: the input
already is col (k-major). The epilogue writes C transposed into NCHW.

MatMul/Gemm read A in place (row-major or transposed) and pack B: at compile time when it
is a constant (weights), at run time into a workspace otherwise (attention).
"""
from __future__ import annotations

import functools
import math
from dataclasses import replace

import numpy as np

from ..deferred import DeferredArray
from ..dtypes import dtype
from ..errors import InternalError
from ..graph import Node
from ..loop import (FLOAT_GEMM_KINDS, GEMM_SPLITS, Assign, Call, Const, Expr, For, Gemm, If, Let, Load, Local, Store,
                    Var, add, calls_math, cmp, div, fbin, flat_index, fold_balanced, loop, mul, rem, select, sub, unflatten)
from ..schedule import CODEGEN_OPTIONS, PANEL_CHUNK_KIB
from ..symbolic import greatest, least
from .bf16_gemm import PAIR_STEP, bf16_rounded, pack_pair_panels
from .builder import KernelBuilder, broadcast_index
from .planes import (padded_copy, phase_split_copy, phase_split_row, phase_split_size, plane_rows, ring_when,
                     rows_through_a_ring)
from .tile_rules import tile_shape


COL_CHUNK_FLOATS = 96 * 1024  # 384 KiB of im2col per GEMM: L2-resident on current x86 cores
# Up to this much im2col is written whole, then multiplied as one GEMM: two phases that
# threads divide (a chunked im2col reuses one workspace per chunk, so it runs on one thread).
WHOLE_COL_FLOATS = 1024 * 1024
# A batch-1 grouped conv's groups divide across threads, each group with its own slice of the
# workspaces, while those stay within this many floats. One group's GEMM is too small to
# split (RegNet's: 8 output channels), so groups run one after another on one thread else.
# So do a batch's images (its bound's, for a symbolic batch): the phases a batch-1 conv
# divides among threads are inside the loop over images, which ran on one thread (ResNet-18
# at batch 4 on 2 threads: 127 ms, onnxruntime 65).
PARALLEL_SLICES_FLOATS = 2 * 1024 * 1024
RUNTIME_PACK_FLOATS = 4 * 1024 * 1024  # packed run-time B operands of a batched MatMul, all batches
# 1x1 convs with at most this many input channels (per group) run weights-as-rows
# (lower_pointwise). Measured on ResNet-50 and MobileNetV2 layers: up to 2x faster at 16-256
# channels; past 256 a tile's many k steps dwarf its write-back, and the rows of a 14x14 or
# 7x7 input fill few of the in-place panels, so the packed orientation wins (by up to 25%).
POINTWISE_MAX_K = 256
# ... and at least this many pixels: a 7x7 input fills two 32-pixel panels by 77%, and a 1x1
# one (squeeze-excite) one lane in 32; there the packed orientation is as fast or 3x faster.
POINTWISE_MIN_PIXELS = 64
# On AVX2 a 1x1 conv over a large plane reads its input from a copy packed in pixel panels
# ([panel][c][16], as B is packed): read in place, each k step of a 16-pixel panel is a line
# of another channel plane, and ResNet-50's 1x1 convs at 28x28 and 56x56 ran at 80-85% of
# the packed rate (x86-64-v3 code on Zen 5, 1 thread: 512 -> 128 at 28x28 1.18 -> 0.99 ms,
# 1024 -> 256 4.75 -> 3.88, 256 -> 64 at 56x56 1.17 -> 1.05). The copy is paid back by many
# input and output channels over many pixels: 144 -> 24 at 56x56 took 3% longer packed,
# 16 -> 96 at 112x112 8%, 1024 -> 256 at 14x14 6%; AVX-512's 32-pixel panels ran slower
# packed (1024 -> 256 at 28x28 3.63 -> 6.01 ms).
POINTWISE_PACKED_MIN_PIXELS = 784
POINTWISE_PACKED_MIN_CHANNELS = 64


def im2col_copies_1x1(vector_width: int, pixels: int) -> bool:
    """Whether a 1x1 stride-1 conv on the im2col path copies its input in row blocks
    (Gemm.a_sb) rather than reading it in place as A: on AVX2 over a plane of fewer than
    POINTWISE_MIN_PIXELS (7x7), where a 6-pixel tile's k steps each read a line of another
    channel plane, and a tile's lines (one per k) outgrow L1 before the next panel reuses
    them. Measured on x86-64-v3, 1 thread, both ways built in one process and timed
    interleaved: ResNet-50's 2048 -> 512 at 7x7 1.34 -> 1.05 ms, 512 -> 2048 1.18 -> 1.05,
    EfficientNet-B0's 1152 -> 320 0.55 -> 0.43; at 14x14 the copy cost more (576 -> 96
    0.22 -> 0.32), and on AVX-512 at 7x7 too (1152 -> 320 0.32 -> 0.35)."""
    return vector_width == 8 and pixels < POINTWISE_MIN_PIXELS


def pointwise_packs_input(vector_width: int, channels_in: int, channels_out: int, pixels: int) -> bool:
    """Whether lower_pointwise packs its input (B) rather than reading it in place."""
    return (vector_width == 8 and pixels >= POINTWISE_PACKED_MIN_PIXELS
            and min(channels_in, channels_out) >= POINTWISE_PACKED_MIN_CHANNELS)


# A depthwise window with more weights than this runs as several passes over the output row,
# each of at most DEPTHWISE_PASS_WEIGHTS weights. Measured: ConvNeXt's 7x7 (49) 0.50 -> 0.37 ms
# in passes of 3 window rows; MobileNetV3's 5x5 (25) up to 2x slower in passes, so not them.
# On AVX2 (16 registers) too: passes of 9-14 weights took MobileNetV3 from 3.15 to 3.25 ms.
DEPTHWISE_ONE_PASS_WEIGHTS = 25
DEPTHWISE_PASS_WEIGHTS = 21
# Passes over a plane that fits L1 run each pass over all its rows (into a plane of partial
# sums per channel) rather than all passes row by row (a row of partial sums, the weights
# reloaded every row): 384x14x14 0.118 -> 0.084 ms, 192x28x28 0.206 -> 0.164, 768x7x7 0.094
# -> 0.074. Only while those planes fit L2: ConvMixer's 768x32x32 (3 MiB of them) ran 0.94
# -> 0.69 ms, yet the model's kernel sum did not move (190.5 -> 191.4 ms, built both ways and
# timed interleaved): its 1x1 convs after it lost what the depthwise ones gained. (A kernel
# whose output holds the planes needs no workspace and no limit: lower_depthwise.)
DEPTHWISE_PLANES_FLOATS = 256 * 1024


def depthwise_row_pairs_pay(vector_width: int, kh: int, kw: int, row_stride: int, row_dilation: int,
                            epilogue_calls_math: bool) -> bool:
    """Whether a depthwise conv computes two output rows a loop along them: their windows
    share kh - 1 input rows, loaded once, and the two rows' sums are independent chains.
    Measured per kernel, AVX-512 (whole planes, not a ring): 3x3 stride 1 144 x 56 x 56
    0.175 -> 0.136 ms, 384 x 14 x 14 0.037 -> 0.034, 960 x 7 x 7 0.037 -> 0.033; over run-time
    sizes 0.238 -> 0.205 and 0.051 -> 0.047. Not taken where it was slower: stride 2 (one
    shared row) level; 5x5 (50 weights live) 0.16 -> 0.51 ms; AVX2 (16 registers) 3x3 at
    480 x 14 x 14 0.064 -> 0.071; an epilogue calling exp, tanh or erf (their constants twice
    over spilled: EfficientNet-B0's 144 x 56 x 56 with SiLU 0.28 -> 0.33)."""
    return (vector_width >= 16 and row_stride == 1 and row_dilation == 1 and 2 <= kh and kh * kw <= 9
            and not epilogue_calls_math)


def depthwise_epilogue_apart_pays(vector_width: int, row_width: int) -> bool:
    """Whether a depthwise conv's costly epilogue (one calling exp, tanh or erf) runs in a loop
    of its own along each output row. Measured with SiLU on x86-64-v3 code (AMD Zen 4 with
    AVX-512 hidden; one process, interleaved, 5 rounds): 32 x 112 x 112 3x3 0.58 -> 0.42 ms,
    144 x 56 x 56 3x3 0.54 -> 0.48, 96 x 112 x 112 3x3 stride 2 0.56 -> 0.45, 240 x 28 x 28
    5x5 0.65 -> 0.51, 144 x 56 x 56 5x5 stride 2 0.35 -> 0.31; but on rows of one or two
    vectors the second loop's start costs more than it saves: 480 x 14 x 14 3x3 0.13 -> 0.25,
    1152 x 7 x 7 5x5 0.18 -> 0.32. Not measured on AVX-512 (32 registers), kept to one loop."""
    return vector_width < 16 and row_width >= 3 * vector_width


# A conv with the weights as rows ("weights_rows"), per vector width: tiles of (channels,
# pixels), two vectors of an input row's pixels against blocks of channels (AVX-512's 8 rows
# hold 16 accumulators, 16 rows would need more registers than it has; AVX2's 6 rows 12 of its
# 16 ymm). No NEON tile: the rules keep the implicit GEMM there.
NARROW_CONV_TILES = {16: (8, 32), 8: (6, 16)}
# It pays whatever the window for at most this many output channels (along rows of stride
# 1, along strided rows): where the implicit tile's vector of channels is half empty, and on
# AVX-512 up to a vector at stride 1 (UNet's 16-channel 3x3 convs at 64x64: 180 -> 211
# GFLOP/s). 1 thread,
# implicit -> rows: AVX-512 64 -> 8 3x3 stride 2 at 112 0.58 -> 0.37 ms, 32 -> 4 at 96 0.21 ->
# 0.09, but 24 -> 16 stride 2 at 160 0.46 -> 0.53; x86-64-v3 code 32 -> 4 at 64 0.230 ->
# 0.106, stride 2 at 96 0.168 -> 0.098, but 64 -> 8 at 56 0.366 -> 0.400, at 28 0.084 -> 0.100.
ROWS_FEW_CHANNELS = {16: (16, 8), 8: (4, 4)}
# More output channels take it too where the window holds few values (k = input channels x
# taps): the implicit GEMM's transposing write-back, per tile of pixels x channels, then
# outweighs its k loop. AVX-512, 1 thread, implicit -> rows: 3 -> 32 3x3 stride 2 at 512 x 512
# (k 27) 2.18 -> 1.72 ms, at 224 0.266 -> 0.252; 8 -> 48 3x3 (72) at 128 1.55 -> 1.04; 3 -> 32
# 5x5 stride 2 (75) 0.83 -> 0.73; 14 -> 64 (126) at 96 1.42 -> 1.33; but 16 -> 64 (144) at
# 112 2.29 -> 2.39, ResNet's 7x7 stem (147) at 224 2.43 -> 2.56, 32 -> 32 (288) at 256 12.4
# -> 15.7. x86-64-v3 code alike: the 3 -> 32 stem at 512 1.77 -> 1.41, 8 -> 48 1.18 -> 1.05,
# 14 -> 64 1.45 -> 1.36, 16 -> 64 2.41 -> 2.49. Not a one-tap window (a strided 1x1 conv):
# it has no write-back to outweigh, and its rows come from a copy of the whole input split
# by column phase, one phase of which it reads (2026-11-27, implicit against rows: 64 -> 128
# stride 2 at 224 0.97 against 1.63 ms, 128 -> 256 at 112 0.84 against 1.06, at 28 0.054
# against 0.087; x86-64-v3 code 2.55 against 3.04 at 224).
ROWS_MAX_K = 128


def weights_as_rows_pay(vector_width: int, channels: int, k: int, column_stride: int, taps: int) -> bool:
    """Whether a conv's output channels as rows (NARROW_CONV_TILES) beat the implicit GEMM's
    tiles of pixels x channels: few channels, or a window of more than one tap holding few
    values (the output rows must still be a tile wide)."""
    if vector_width not in NARROW_CONV_TILES:
        return False
    return channels <= ROWS_FEW_CHANNELS[vector_width][0 if column_stride == 1 else 1] or taps > 1 and k <= ROWS_MAX_K


# The implicit GEMM of few-row tiles (over the plane: AVX2's 6 rows) is taken while (1 - fill)
# x output channels stays within this, fill being how full the plane's row blocks are: im2col's
# copy costs about as much as the GEMM work of this many output channels. (Measured per
# output row, before tiles ran over the plane: AVX2's 6-row tiles on ResNet's 14- and 7-wide
# rows fill 78% and 58% of them, and im2col took ResNet-18 from 33.0 to 31.0 ms and ResNet-50
# from 69.8 to 67.0.)
IMPLICIT_WASTE_LIMIT = 40


# An implicit GEMM whose tile has at most this many rows runs over the whole output plane,
# each row's input offset from a table of pixels (Gemm.a_mtab), so only the plane's last
# block is ragged. The rows' offsets then live in general registers, one each: AVX2's 6 fit
# (ResNet-18 on x86-64-v3 29.4 -> 27.9 ms, its 14- and 7-wide layers off im2col), AVX-512's
# 14 spilled (ResNet-18 14.7 -> 26.2 ms), so taller tiles keep one GEMM per output row, whose
# rows are a stride apart (constant displacements).
PLANE_MAX_TILE_ROWS = 8


def implicit_over_plane(mr: int) -> bool:
    return mr <= PLANE_MAX_TILE_ROWS


# A GEMM tiled within output rows streams all of B once per row. Rows of 3 pixels and more
# outrun im2col whatever B's size; rows of 2 only while B stays in L2; rows of 1 never.
IMPLICIT_NARROW_ROW_B_BYTES = 1 << 20
# A row's short tiles read B's panels once per few pixels: with im2col's full tiles (its copy
# amortized over the output channels), many output channels outweigh that. Taken while
# (1 - the row's fill of its tiles) x output channels stays within this.
SHORT_TILES_LIMIT = 600


def rows_wide_enough(width: int, mr: int, channels: int, packed_b_bytes: int) -> bool:
    """Whether a conv's implicit GEMM tiled within output rows of `width` pixels (tiles of mr
    rows, taller than PLANE_MAX_TILE_ROWS: AVX-512's 14) beats im2col. Measured on AVX-512,
    1 thread, against im2col: 0.57-0.99 of its time at widths 3 to 35 (3x3, 1x7, 7x1 and
    5x5 windows, strides 1 and 2, 3 to 1024 channels: SqueezeNet's 48 -> 192 at 13x13 0.32 ->
    0.25 ms, Inception's 128 -> 128 1x7 at 17x17 0.82 -> 0.59, 512 -> 512 at 7x7 0.97); but
    1.02-1.09 for ResNet-50's 1024 -> 2048 1x1 stride 2 at 7 wide (limit 1024) and 1.05 for
    512 -> 1024 at 5 wide (658); at width 2 0.85 with 128 channels, 1.16 with 256 (2.4 MB
    of B); at width 1 1.6-2.5. A row's last block is a shorter tile, not wasted work."""
    if width < 2 or width == 2 and packed_b_bytes > IMPLICIT_NARROW_ROW_B_BYTES:
        return False
    return (1 - width / (-(-width // mr) * mr)) * channels <= SHORT_TILES_LIMIT


def window_row_spans(outputs: int, stride: int, dilation: int, pad: int, size: int, taps: int,
                     per_tap: int) -> np.ndarray | None:
    """For each of a conv's `outputs` positions along its leading spatial dim, the [lo, hi)
    range of k (ordered window row first, `per_tap` k per window row) whose window rows land
    in the input, not its padding ([outputs, 2] int64); None where no window row ever lands
    in the padding, or some window lands wholly in it (rows then need no range, or one that
    does not fit a tile's by its ends)."""
    spans = np.empty((outputs, 2), np.int64)
    for o in range(outputs):
        inside = [t for t in range(taps) if 0 <= o * stride + t * dilation - pad < size]
        if not inside:
            return None
        spans[o] = inside[0] * per_tap, (inside[-1] + 1) * per_tap
    return None if (spans == [0, taps * per_tap]).all() else spans


def conv_border_spans(b: KernelBuilder, node: Node) -> np.ndarray | None:
    """window_row_spans along a conv's leading spatial dim where its implicit GEMM can use
    them: two spatial dims or more, and constant weights (packed window row first at build
    time; weights packed at run time keep their own k order)."""
    _, w_name, xs, wsh, _, kernel, strides, dil, pads = conv_operands(b, node)
    if w_name not in b.g.constants or len(kernel) < 2:
        return None
    kk = wsh[1] * math.prod(kernel)
    return window_row_spans(b.type(node.outputs[0]).shape[2], strides[0], dil[0], pads[0], xs[2], kernel[0],
                            kk // kernel[0])


# An implicit GEMM whose packed panel (k x nr floats) is past K_CHUNK_FROM_BYTES, well past
# L2, streams it from L3 once per register tile: it runs its k in chunks of at most
# K_CHUNK_PANEL_BYTES of panel instead, each chunk's GEMM over the whole plane. DeepLabV3's
# 3x3 dilation-12 conv, 2048 -> 256 at 28x28 (k 18432: 2.4 MB a panel of 32 columns), built
# each way and timed interleaved, 1 thread, AVX-512: 36.5 ms whole, 34.5 in chunks of 1 MiB,
# 28.7 of 512 KiB, 26.0 of 256 KiB (and 128, 64, 32); FCN's 512-channel 3x3 (590 KB a
# panel) 14.08 ms whole, 14.23 in chunks of 256 KiB: left whole.
K_CHUNK_FROM_BYTES = 1024 * 1024
K_CHUNK_PANEL_BYTES = 256 * 1024
CHUNK_SPLIT_MIN_PANELS = 8


def k_chunks(k: int, nr: int, window_rows: int) -> list[tuple]:
    """[k0, k1) chunks of an implicit GEMM's k: all of it where its panel fits
    K_CHUNK_FROM_BYTES, else whole window rows (k ordered window row first, so that a chunk
    is skipped whole where its window row is in the border), each cut in equal parts that fit."""
    if k * nr * 4 <= K_CHUNK_FROM_BYTES:
        return [(0, k)]
    per_row = k // window_rows
    parts = -(-per_row * nr * 4 // K_CHUNK_PANEL_BYTES)
    return [(r * per_row + per_row * i // parts, r * per_row + per_row * (i + 1) // parts)
            for r in range(window_rows) for i in range(parts)]


def chunk_spans(spans: np.ndarray, k0: int, k1: int) -> np.ndarray:
    """Gemm.a_kspan's [lo, hi) entries for the chunk [k0, k1) of k: clipped to it and made
    relative; an entry whose range misses the chunk runs one k step (the tile's k loop runs
    at least once; that step reads the zero border)."""
    lo = np.minimum(np.clip(spans[:, 0] - k0, 0, k1 - k0), k1 - k0 - 1)
    hi = np.maximum(np.clip(spans[:, 1] - k0, 0, k1 - k0), lo + 1)
    return np.stack([lo, hi], axis=1)


def tiles_border_skip(spans: np.ndarray | None, lead_pixels: int, pixels: int, mr: int, k: int) -> float:
    """The share of the work of an implicit GEMM's tiles over the plane (whole tiles of mr
    of its `pixels`) that their k ranges skip in the border (`spans` per leading output
    coordinate, each `lead_pixels` pixels: window_row_spans), a tile's range being its
    first and last pixels' together."""
    if spans is None:
        return 0.0
    blocks = -(-pixels // mr)
    skipped = 0
    for t in range(blocks):
        first, last = spans[t * mr // lead_pixels], spans[(min(pixels, t * mr + mr) - 1) // lead_pixels]
        skipped += k - (max(first[1], last[1]) - min(first[0], last[0]))
    return skipped / (blocks * k)


def row_blocks_filled(width: int, mr: int) -> float:
    """How full the register tiles' rows are when one output row of `width` pixels is cut in
    blocks of mr (0 where the row is narrower than one block)."""
    return 0.0 if width < mr else width / (-(-width // mr) * mr)


DEFERRED_PIECE_BYTES = 8 << 20


def pack_panels(bmat: np.ndarray, nr: int, out: np.ndarray | None = None) -> np.ndarray:
    """[K, N] -> [ceil(N/nr), K, nr] float32, zero past N: the layout the micro-kernel
    streams (written into `out` where given)."""
    k, n = bmat.shape
    panels, full = -(-n // nr), n // nr
    out = np.empty((panels, k, nr), np.float32) if out is None else out
    out[:full] = bmat[:, :full * nr].reshape(k, full, nr).transpose(1, 0, 2)
    if full < panels:
        out[full, :, :n - full * nr] = bmat[:, full * nr:]
        out[full, :, n - full * nr:] = 0
    return out


def deferred_panels(mats: np.ndarray, nr: int) -> DeferredArray:
    """pack_panels of each [K, N] matrix of `mats` ([..., K, N], a view of a weight), computed
    when the weights file is written (ir/deferred.py), a few panels at a time: shape
    [..., ceil(N/nr), K, nr]."""
    *lead, k, n = mats.shape
    # (a partial of a module function, not a closure: a planned model pickles, to go from
    # the process that planned it to the one that links it)
    return DeferredArray((*lead, -(-n // nr), k, nr), np.float32, functools.partial(_panel_pieces, mats, nr))


def _panel_pieces(mats: np.ndarray, nr: int):
    *_, k, n = mats.shape
    step = max(1, DEFERRED_PIECE_BYTES // (4 * k * nr))  # panels a piece
    for mat in mats.reshape(-1, k, n):
        for start in range(0, n, step * nr):
            yield pack_panels(mat[:, start:start + step * nr], nr)


def packed_weight(b: KernelBuilder, name: str, how: tuple, nr: int, mats) -> str:
    """The parameter reading constant `name` as deferred_panels(mats(), nr), `how` naming what
    mats() makes of it: packed once however many kernels read it (a weight shared by the
    layers of an ALBERT, or a detector head's at each scale)."""
    return b.packed_param(f"{name}_packed", ("panels", name, how, nr), lambda: deferred_panels(mats(), nr))


def gemm_stmt(b: KernelBuilder, a_buf, a_off, a_sm, a_sk, b_buf, b_off, m, n, k, epilogue_fn, a_ktab: str = "",
              kind: str = "f32", b_sk: int = 0, stores_along: str = "n", split: str = "", b_ktab: str = "",
              tile: tuple | None = None, b_words: bool = False, a_blocked: bool = False, a_mtab: str = "",
              a_rows: int = 0, a_kspan: str = "", n_bound: int = 0, tiles: bool = False,
              a_kruns: tuple = (), m_rows: tuple = ()) -> Gemm:
    """A Gemm statement; epilogue_fn(m_expr, n_expr, acc_expr) returns the epilogue statements.
    B must have been packed with the panel width b.tile(n) gives (or `tile`'s), or (b_sk, b_ktab)
    is read in place with that row stride or through that table of row offsets."""
    mv, nv, av = b.fresh("gm"), b.fresh("gn"), b.fresh("gacc")
    epi = tuple(epilogue_fn(Var(mv), Var(nv), Var(av, "f32" if kind in FLOAT_GEMM_KINDS else "i32")))
    mr, nr = tile or b.tile(n)
    if not split:
        split = b.knob("split", "rule", GEMM_SPLITS)
        if split == "rule":  # (with a_rows, threads divide by whole rows)
            split = gemm_split(m // a_rows, n, 1, nr) if a_rows else gemm_split(m, n, mr, nr)
    if kind == "f32" and not (b_sk or b_ktab):  # (codegen's choices for packed B: Kernel.schedule)
        if isinstance(m, Expr) or m >= mr:
            b.knob("prefetch", "auto", CODEGEN_OPTIONS["prefetch"])
        if k * n * 4 > CODEGEN_OPTIONS["panel_chunk_kib"][0] * 1024:
            b.knob("panel_chunk_kib", PANEL_CHUNK_KIB, CODEGEN_OPTIONS["panel_chunk_kib"])
    if a_blocked and (a_sm, a_sk) != (1, mr):
        raise InternalError(f"A blocked by {mr} rows is read with a_sm {a_sm}, a_sk {a_sk}")
    return Gemm(a_buf, a_off, a_sm, a_sk, b_buf, b_off, m, n, k, mr, nr, mv, nv, av, epi, a_ktab, kind,
                split, b_sk, stores_along, b_ktab, b_words, k if a_blocked else 0, a_mtab, a_rows, a_kspan, n_bound,
                tiles, a_kruns, m_rows)


def gemm_split(m: int, n: int, mr: int, nr: int) -> str:
    """Divide a GEMM among threads by row blocks when there are many (each thread then reads
    all of B once per block it owns, as one thread does), else by panels: a few rows against
    many weight columns (a batch-1 layer, a 7x7 conv) has no row blocks to share out."""
    blocks, panels = -(-m // mr), -(-n // nr)
    return "m" if blocks >= 16 or blocks >= panels else "n"


def split_by_run_time_rows(g: Gemm) -> tuple:
    """A Gemm whose rows are known at run time, divided among threads as `gemm_split` would
    divide the call's own rows: two guarded phases (ir/loop.py, "Threads"), by row blocks
    where they are many (a batch of images' pixels, a prefill), else by weight panels (a
    decoding step's one row then streams each weight once). Divided by panels alone, a
    ConvNeXt MLP's 384 -> 96 projection over a batch's 3136 pixels had 3 panels for 2 threads:
    1.48 ms where a build for that batch took 1.08."""
    blocks = min(16, -(-g.n // g.nr))  # (as gemm_split: 16 row blocks, or as many as panels)
    if isinstance(g.m, int) or blocks <= 1:
        return (g,)
    many = (blocks - 1) * g.mr + 1  # rows that make `blocks` row blocks
    return (If(cmp("ge", g.m, Const(many)), (replace(g, split="m"),)),
            If(cmp("lt", g.m, Const(many)), (replace(g, split="n"),)))


def _runtime_pack(b: KernelBuilder, src: str, off, k: int, n: int, s_k: int, s_n: int, ws: str,
                  dest_off=Const(0)) -> tuple:
    """Statements packing B (element (kk, nn) at off + kk*s_k + nn*s_n) into panels at ws[dest_off:]."""
    nr = b.tile(n)[1]
    panels = -(-n // nr)
    p, kk, j = b.fresh("pp"), b.fresh("pk"), b.fresh("pj")
    col = add(mul(Var(p), nr), Var(j))
    if n % nr:
        value = select(cmp("lt", col, Const(n)),
                       Load(src, add(off, add(mul(Var(kk), s_k), mul(fbin("min", col, Const(n - 1)), s_n)))),
                       Const(0.0, "f32"))
    else:
        value = Load(src, add(off, add(mul(Var(kk), s_k), mul(col, s_n))))
    dest = add(dest_off, add(mul(add(mul(Var(p), k), Var(kk)), nr), Var(j)))
    return (For(p, panels, (For(kk, k, (For(j, nr, (Store(ws, dest, value),), "vectorize"),)),), parallel=True),)


# ---- convolution -------------------------------------------------------------------------

def lower_conv_symbolic(b: KernelBuilder, node: Node, store) -> tuple:
    """A conv over spatial sizes known only at run time (an image of any height and width):
    an implicit GEMM, as over static sizes, whose tables the kernel computes before its loops.
    Per image and group, the input is copied with its zero border into a workspace planned at
    the bounds (read in place where there is no padding); the GEMM's A is that copy, read
    through a table of each output pixel's window start (Gemm.a_mtab, over the whole plane)
    and a table of each tap's offset within a window (Gemm.a_ktab): no im2col. (An im2col of
    run-time sizes, checked per element and stored k-major a plane apart, took ResNet-18 and
    MobileNetV2 at 224 x 224 to 1.45x and 2x their static times.)"""
    x_name, w_name = node.inputs[0], node.inputs[1]
    if w_name not in b.g.constants or b.compute(x_name) != "f32":
        raise TypeError("a conv over run-time sizes takes constant float32 weights")
    xs, (cout, cg) = b.type(x_name).shape, b.type(w_name).shape[:2]
    a = b.attrs(node)
    groups, kernel, strides, dil, pads = a.get("group", 1), a["kernel_shape"], a["strides"], a["dilations"], a["pads"]
    nsp, cog, kk = len(kernel), cout // groups, cg * math.prod(kernel)
    out_dims = b.type(node.outputs[0]).shape[2:]
    if nsp == 2 and weights_as_rows_pay(b.config.vector_width, cog, kk, strides[-1], math.prod(kernel)) and \
            greatest(out_dims[-1]) >= NARROW_CONV_TILES[b.config.vector_width][1]:
        return _conv_symbolic_weights_rows(b, node, store)
    in_sp, out_sp = [b.dim(d) for d in xs[2:]], [b.dim(d) for d in out_dims]
    pixels = math.prod(out_sp)
    nr = b.tile(cog)[1]
    wparam = packed_weight(b, w_name, ("conv", groups, False), nr,
                           lambda: b.g.constants[w_name].reshape(groups, cog, kk).transpose(0, 2, 1))
    panel_stride = -(-cog // nr) * kk * nr
    bias = b.reader(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else None
    xparam = b.in_param(x_name)
    bv, gv = b.fresh("b"), b.fresh("g")
    chan0 = add(mul(Var(bv), xs[1]), mul(Var(gv), cg))  # this image's and group's first channel
    plane = math.prod(in_sp)

    bordered = any(pads)
    src_sp = [add(in_sp[i], pads[i] + pads[nsp + i]) for i in range(nsp)] if bordered else in_sp
    per_image = []
    bordered_floats = cg * math.prod(greatest(d) + pads[i] + pads[nsp + i] for i, d in enumerate(xs[2:])) \
        if bordered else 0
    if bordered:  # (a slice per image where images run in parallel)
        src, src_off = image_workspace(b, bv, xs[0], bordered_floats, images_in_parallel(b, xs[0], bordered_floats))
        per_image.append(padded_copy(b, xparam, mul(chan0, plane), cg, in_sp, pads, src, dest_off=src_off))
    else:
        src, src_off = xparam, mul(chan0, plane)

    # ktab[(c, kpos)] = the tap's offset within a window; mtab[pixel] = its window's first element
    ktab, mtab = b.workspace(kk, "i64"), b.workspace(math.prod(greatest(d) for d in out_dims), "i64")
    kv, ov = [b.fresh("kp") for _ in range(nsp + 1)], [b.fresh("op") for _ in range(nsp)]
    tap = flat_index([Var(kv[0])] + [mul(Var(v), d) for v, d in zip(kv[1:], dil)], [cg] + src_sp)
    tables = (Store(ktab, flat_index([Var(v) for v in kv], [cg] + list(kernel)), tap),)
    for i in range(nsp, -1, -1):
        tables = (For(kv[i], ([cg] + list(kernel))[i], tables),)
    # As over static sizes (lower_conv_gemm), a tile of few rows runs over the whole plane, a
    # table entry per pixel; a taller one stays within an output row, an entry per row.
    over_plane = implicit_over_plane(b.tile(cog)[0])
    entries = out_sp if over_plane else out_sp[:-1]
    window_start = [mul(Var(v), st) for v, st in zip(ov[:len(entries)], strides)]
    start = flat_index(window_start + [Const(0)] * (nsp - len(entries)), src_sp)
    starts = (Store(mtab, flat_index([Var(v) for v in ov[:len(entries)]], entries), start),)
    for i in range(len(entries) - 1, -1, -1):
        starts = (For(ov[i], entries[i], starts, "vectorize" if i == nsp - 1 else "serial"),)

    def epilogue(mm, nn, acc):
        co = add(mul(Var(gv), cog), nn)
        return store([Var(bv), co] + unflatten(mm, out_sp), acc if bias is None else fbin("add", acc, bias([co])))
    # Threads divide row blocks (or output rows) where the bounds give many, else panels: a
    # projection to 24 channels has one panel.
    mr = b.tile(cog)[0]
    bound = [greatest(d) for d in out_dims]
    split = gemm_split(math.prod(bound), cog, mr, nr) if over_plane else gemm_split(math.prod(bound[:-1]), cog, 1, nr)
    product = gemm_stmt(b, src, src_off, 0 if over_plane else strides[-1], 0, wparam, mul(Var(gv), panel_stride),
                        pixels, cog, kk, epilogue, a_ktab=ktab, a_mtab=mtab, stores_along="m", split=split,
                        a_rows=0 if over_plane else out_sp[-1] if isinstance(out_sp[-1], Expr) else Const(out_sp[-1]))
    # (A batch of 1 and one group leave both top level: threads divide the channels' copy and
    # the GEMM's rows or weight panels.)
    return (*tables, *starts, *over_images(b, bv, xs[0], loop(gv, groups, per_image + [product]), bordered_floats))


def _conv_symbolic_weights_rows(b: KernelBuilder, node: Node, store) -> tuple:
    """A 2-D conv over run-time sizes with the weights as rows (`weights_as_rows_pay`): per
    output row, the output channels x the row's pixels, B the row read from the input's
    bordered copy (split by column phase where the conv has a column stride) through a table
    of tap offsets the kernel computes from the sizes. (As an implicit GEMM, MobileNetV2's
    3 -> 32 stem over run-time sizes ran 1.35x its static build.)"""
    x_name, w_name = node.inputs[0], node.inputs[1]
    xs, (cout, cg) = b.type(x_name).shape, b.type(w_name).shape[:2]
    a = b.attrs(node)
    groups, (kh, kw), (sh, sw), (dh, dw) = a.get("group", 1), a["kernel_shape"], a["strides"], a["dilations"]
    pt, pl, pb, pr = a["pads"]
    cog, kk = cout // groups, cg * kh * kw
    h_dim, w_dim = xs[2:]
    h, w_ = b.dim(h_dim), b.dim(w_dim)
    oh_dim, ow_dim = b.type(node.outputs[0]).shape[2:]
    tile = NARROW_CONV_TILES[b.config.vector_width]
    w_rows = b.constant_param(f"{w_name}_rows", b.g.constants[w_name].reshape(groups * cog, kk))
    bias = b.reader(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else None
    xparam = b.in_param(x_name)
    bv, gv = b.fresh("b"), b.fresh("g")
    chan0 = add(mul(Var(bv), xs[1]), mul(Var(gv), cg))  # this image's and group's first channel
    hp, wq = phase_split_size(h, w_, a["pads"], sw)
    hp_bound, wq_bound = phase_split_size(greatest(h_dim), greatest(w_dim), a["pads"], sw)
    row_floats = mul(wq, sw)  # (a padded row: its phases side by side)
    floats = cg * hp_bound * sw * wq_bound
    src, src_off = image_workspace(b, bv, xs[0], floats, images_in_parallel(b, xs[0], floats))
    input_row, read = plane_rows(xparam, chan0, h, w_)
    if sw == 1:
        copy = padded_copy(b, xparam, mul(chan0, mul(h, w_)), cg, [h, w_], [pt, pl, pb, pr], src, dest_off=src_off)
    else:  # (a Deinterleave of float32 rows; a float16 input widened element by element)
        plain = dtype(b.type(x_name).dtype).storage == "f32"
        copy = phase_split_copy(b, read, cg, h, w_, pt, pl, sw, hp, wq, src, input_row if plain else None,
                                dest_off=src_off, least_width=least(w_dim))
    # ktab[(c, ky, kx)] = the tap's offset from its output row's first window: (row, phase, slot)
    ktab = b.workspace(kk, "i64")
    c, ky = b.fresh("c"), b.fresh("ky")
    tap_row = add(mul(Var(c), mul(hp, row_floats)), mul(mul(Var(ky), dh), row_floats))
    taps = tuple(Store(ktab, add(mul(add(mul(Var(c), kh), Var(ky)), kw), Const(kx)),
                       add(tap_row, add(mul(Const(kx * dw % sw), wq), Const(kx * dw // sw)))) for kx in range(kw))
    tables = (For(c, cg, (For(ky, kh, taps),)),)
    oy = b.fresh("orow")

    def epilogue(channel, column, acc):
        co = add(mul(Var(gv), cog), channel)
        return store([Var(bv), co, Var(oy), column], acc if bias is None else fbin("add", acc, bias([co])))
    product = gemm_stmt(b, w_rows, mul(Var(gv), cog * kk), kk, 1, src, add(src_off, mul(mul(Var(oy), sh), row_floats)),
                        cog, b.dim(ow_dim), kk, epilogue, b_ktab=ktab, tile=tile, split="n")
    rows = For(oy, b.dim(oh_dim), (product,), parallel=True)
    return (*tables, *over_images(b, bv, xs[0], loop(gv, groups, [copy, rows]), floats))


def lower_conv_gemm(b: KernelBuilder, node: Node, store, path: str, one_image: str = "") -> tuple:
    """A conv of static spatial sizes as GEMMs: `path` "implicit", "weights_rows" or "im2col"
    (ir/lower/conv.py chooses). With `one_image` (its packed weights' parameter, already made),
    the conv of a batch of one whatever its batch: what a run-time batch runs for one image."""
    x_name, w_name = node.inputs[0], node.inputs[1]
    xs, ws_ = b.type(x_name).shape, b.type(w_name).shape
    a = b.attrs(node)
    groups = a.get("group", 1)
    batch, cin = 1 if one_image else b.dim(xs[0]), xs[1]  # (a symbolic batch: a loop over images at run time)
    cout, cg = ws_[0], ws_[1]
    kernel, strides, dil, pads = a["kernel_shape"], a["strides"], a["dilations"], a["pads"]
    nsp = len(kernel)
    out_sp = b.type(node.outputs[0]).shape[2:]
    a_in_place = (all(k == 1 for k in kernel) and all(s == 1 for s in strides) and not any(pads)
                 and not im2col_copies_1x1(b.config.vector_width, math.prod(out_sp)))  # (A read in place)
    cog = cout // groups
    runtime_w = w_name not in b.g.constants
    implicit, weights_as_rows = path in ("implicit", "weights_rows"), path == "weights_rows"
    kk = cg * math.prod(kernel)
    m = math.prod(out_sp)
    nr = NARROW_CONV_TILES[b.config.vector_width][1] if weights_as_rows else b.tile(cog)[1]
    panel_stride = -(-cog // nr) * kk * nr
    spatial = list(xs[2:])
    # Taps in the zero border are skipped where whole window rows fall in it (Gemm.a_kspan):
    # k then runs window row first, (ky, c, kx), and packed constant weights follow.
    spans = conv_border_spans(b, node) if implicit and not weights_as_rows else None
    # (constant weights in one group: packed per chunk of k where its panels are past L2)
    chunks = (k_chunks(kk, nr, kernel[0] if spans is not None else 1)
              if implicit and not weights_as_rows and groups == 1 and not runtime_w and not one_image else [(0, kk)])
    w_rows = None
    if runtime_w:  # weights computed at run time: pack them in the kernel, once per call
        w_src = b.in_param(w_name)
        wparam = b.workspace(groups * panel_stride)
    elif one_image:
        w_rows = wparam = one_image
    elif weights_as_rows:
        w_rows = b.constant_param(f"{w_name}_rows", b.g.constants[w_name].reshape(groups * cog, kk))
    else:
        def window_rows_first():  # (with spans, k ordered window row first)
            w = b.g.constants[w_name].reshape(groups, cog, cg, kernel[0], -1)
            return (w.transpose(0, 1, 3, 2, 4) if spans is not None else w).reshape(groups, cog, kk).transpose(0, 2, 1)
        wparam = packed_weight(b, w_name, ("conv", groups, spans is not None), nr, window_rows_first) \
            if len(chunks) == 1 else ""
    bias = b.reader(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else None
    xparam = b.in_param(x_name)
    padded = [spatial[i] + pads[i] + pads[nsp + i] for i in range(nsp)]
    # Weights as rows read an output row's inputs as vectors: with a column stride, from a
    # copy split by column phase (planes.phase_split_copy: [c][row][phase][column // stride]),
    # where a tap's inputs along an output row are contiguous.
    split = strides[-1] if weights_as_rows and strides[-1] > 1 else 0
    if split:  # (rows, phases, slots a phase)
        hp, wq = phase_split_size(*spatial, pads, split)
        padded = [hp, split, wq]
    bordered = (any(pads) or split) and not a_in_place
    # im2col in chunks of whole output rows, each small enough to stay in L2 for its GEMM.
    lead_rows, row_size = out_sp[0], math.prod(out_sp[1:])
    whole = a_in_place or kk * m <= WHOLE_COL_FLOATS
    rows_per_chunk = lead_rows if whole else max(1, min(lead_rows, COL_CHUNK_FLOATS // max(kk * row_size, 1)))
    mr = 0 if a_in_place or implicit else b.tile(cog)[0]
    # (whole row blocks: the last one's rows past m are never read)
    col_floats = kk * -(-rows_per_chunk * row_size // mr) * mr if mr else 0
    bordered_floats = cg * math.prod(padded) if bordered else 0
    groups_fit = groups > 1 and not runtime_w and groups * (col_floats + bordered_floats) <= PARALLEL_SLICES_FLOATS
    parallel_groups = groups_fit and batch == 1
    # (never with parallel groups: batch 1)
    parallel_images = not one_image and images_in_parallel(b, xs[0], col_floats + bordered_floats)
    slices = groups if parallel_groups else xs[0] if parallel_images else 1  # (a run-time batch: a Dim)
    xp_ws = b.workspace(slices * bordered_floats) if bordered else None
    col_ws = b.workspace(slices * col_floats) if mr else None

    bv, gv = b.fresh("b"), b.fresh("g")
    # Where this group's (or image's) slice of each workspace starts (else all share one, serially).
    owner = Var(gv) if parallel_groups else Var(bv) if parallel_images else Const(0)
    group_col, group_bordered = mul(owner, col_floats), mul(owner, bordered_floats)
    prologue = []
    if runtime_w:
        gp = b.fresh("wg")
        packs = _runtime_pack(b, w_src, mul(Var(gp), cog * kk), kk, cog, 1, kk, wparam, mul(Var(gp), panel_stride))
        prologue = list(loop(gp, groups, packs))
    body = []
    chan0 = lambda: add(mul(Var(bv), cin), mul(Var(gv), cg))  # first input channel of this group
    src_buf, src_shape = xparam, spatial
    if split:
        input_row, read = plane_rows(xparam, chan0(), *spatial)
        plain = dtype(b.type(x_name).dtype).storage == "f32"  # (a Deinterleave of float32 rows)
        body.append(phase_split_copy(b, read, cg, *spatial, pads[0], pads[1], split, padded[0], padded[2], xp_ws,
                                     input_row if plain else None, dest_off=group_bordered))
        src_buf, src_shape = xp_ws, padded
    elif xp_ws:
        # Copy the group's input into a zero-bordered workspace: the GEMM then reads it unchecked.
        body.append(padded_copy(b, xparam, mul(chan0(), math.prod(spatial)), cg, spatial, pads, xp_ws,
                                dest_off=group_bordered))
        src_buf, src_shape = xp_ws, padded

    def implicit_rows() -> list:
        """The (padded) input read in place through a k-offset table: one GEMM over the
        output plane, through a table of pixel offsets (tiles of few rows: implicit_over_plane)
        or of output-row offsets (taller tiles, which stay within a row: Gemm.a_rows); or with
        few output channels, one per output row with the weights as A and the row as B."""
        src_sp = src_shape
        chan_base = group_bordered if xp_ws else mul(chan0(), math.prod(spatial))
        ktab = np.zeros(kk, np.int64)
        taps = [(c, *kpos) for c, *kpos in np.ndindex(cg, *kernel)]
        if spans is not None:  # (window row first: (ky, c, kx))
            taps = [(c, k0, *rest) for k0, c, *rest in np.ndindex(kernel[0], cg, *kernel[1:])]
        for i, (c, *kpos) in enumerate(taps):
            at = tuple(k * d for k, d in zip(kpos, dil))
            if split:  # (row, column phase, slot)
                at = (at[0], at[1] % split, at[1] // split)
            ktab[i] = np.ravel_multi_index((c,) + at, [cg] + src_sp)
        ktab_param = lambda k0=0, k1=kk: b.constant_param("conv_koffsets", ktab[k0:k1])  # noqa: E731
        rv = [b.fresh("orow") for _ in range(nsp - 1)]
        row_start = flat_index([mul(Var(v), st) for v, st in zip(rv, strides)] + [Const(0)] * (1 + bool(split)),
                               src_sp)
        row_index = flat_index([Var(v) for v in rv], out_sp[:-1])

        def at_pixel(channel, pixel, acc):
            co = add(mul(Var(gv), cog), channel)
            value = acc if bias is None else fbin("add", acc, bias([co]))
            return store([Var(bv), co] + ([pixel] if b.conv_collapsed else unflatten(pixel, out_sp)), value)

        def epilogue(channel, column, acc):
            return at_pixel(channel, add(mul(row_index, out_sp[-1]), column), acc)

        if not weights_as_rows:
            over_plane = implicit_over_plane(b.tile(cog)[0])
            starts = np.array([np.ravel_multi_index(tuple(o * s for o, s in zip(pixel, strides)), src_sp)
                               for pixel in np.ndindex(*(out_sp if over_plane else (*out_sp[:-1], 1)))], np.int64)
            table = b.constant_param("conv_pixel_offsets" if over_plane else "conv_row_offsets", starts)
            entry_spans = None
            if spans is not None:  # one [lo, hi) per table entry: its leading output coordinate's
                per_lead = math.prod(out_sp[1:] if over_plane else out_sp[1:-1])
                entry_spans = spans[np.arange(len(starts)) // per_lead]
            if len(chunks) == 1:
                kspan = b.constant_param("conv_kspans", entry_spans) if entry_spans is not None else ""
                return [gemm_stmt(b, src_buf, chan_base, 0 if over_plane else strides[-1], 0, wparam,
                                  mul(Var(gv), panel_stride), m, cog, kk, lambda mm, nn, acc: at_pixel(nn, mm, acc),
                                  a_ktab=ktab_param(), stores_along="m", a_mtab=table,
                                  a_rows=0 if over_plane else out_sp[-1], a_kspan=kspan)]
            # k in chunks whose panels stay in L2 (K_CHUNK_PANEL_BYTES): each chunk's GEMM adds
            # its sums into a workspace of partial sums, [channel][pixel]; the last one's
            # epilogue takes them and does the conv's.
            partial = b.workspace(slices * cog * m)
            # Threads divide each chunk by panels where there are enough: divided by rows, a
            # chunk whose window row is in the border for one thread's rows leaves that
            # thread waiting (DeepLabV3's dilation-12 conv at 2 threads, built both ways and
            # timed interleaved: 18.5 ms by rows, 14.1 by panels).
            chunk_split = "n" if -(-cog // nr) >= CHUNK_SPLIT_MIN_PANELS else ""
            stmts = []
            for j, (k0, k1) in enumerate(chunks):
                kc = k1 - k0
                def epilogue(mm, nn, acc, j=j):
                    at = add(mul(owner, cog * m), add(mul(nn, m), mm))
                    so_far = acc if j == 0 else fbin("add", Load(partial, at), acc)
                    return at_pixel(nn, mm, so_far) if j == len(chunks) - 1 else [Store(partial, at, so_far)]
                w_chunk = packed_weight(b, w_name, ("conv", groups, spans is not None, k0, k1), nr,
                                        lambda k0=k0, k1=k1: window_rows_first()[:, k0:k1, :])
                kspan = ""
                if entry_spans is not None:
                    kspan = b.constant_param("conv_kspans", chunk_spans(entry_spans, k0, k1))
                stmts.append(gemm_stmt(b, src_buf, chan_base, 0 if over_plane else strides[-1], 0, w_chunk, Const(0),
                                       m, cog, kc, epilogue, a_ktab=ktab_param(k0, k1),
                                       stores_along="m", a_mtab=table, a_rows=0 if over_plane else out_sp[-1],
                                       a_kspan=kspan, split=chunk_split))
            return stmts
        stmt = gemm_stmt(b, w_rows, mul(Var(gv), cog * kk), kk, 1, src_buf, add(chan_base, row_start),
                         cog, out_sp[-1], kk, epilogue, b_ktab=ktab_param(),
                         tile=NARROW_CONV_TILES[b.config.vector_width])
        body_ = (stmt,)
        for i in range(nsp - 2, -1, -1):
            body_ = (For(rv[i], out_sp[i], body_, parallel=i == 0),)
        return list(body_)

    def chunk(row0, rows: int) -> list:
        """im2col for output rows [row0, row0 + rows) of the leading spatial dim, then its GEMM."""
        mc = rows * row_size
        stmts = []
        if not a_in_place:
            # col[(ci, kpos)][pixel] = src[ci][pixel*stride + kpos*dilation]
            ci = b.fresh("ci")
            kv = [b.fresh("kp") for _ in range(nsp)]
            ov = [b.fresh("op") for _ in range(nsp)]
            chan = Var(ci) if xp_ws else add(chan0(), Var(ci))
            lead = [cg] if xp_ws else [batch * cin]
            out_pos = [add(row0, Var(ov[0]))] + [Var(v) for v in ov[1:]]
            pos = [add(mul(out_pos[i], strides[i]), mul(Var(kv[i]), dil[i])) for i in range(nsp)]
            krow = flat_index([Var(ci)] + [Var(v) for v in kv], [cg] + list(kernel))
            pixel = flat_index([Var(v) for v in ov], [rows] + list(out_sp[1:]))
            # Blocked, [pixel // mr][k][pixel % mr]: a row block's A is contiguous. Stored
            # k-major, [k][pixel], a block's k steps read 6 of every 49 floats of a 7x7 conv's
            # col, so each panel pulled all of col (903 KB for ResNet's 512-channel 3x3) through
            # the caches once per row block: those convs ran at 75% of the others' rate on AVX2.
            dest = add(add(mul(div(pixel, mr), kk * mr), mul(krow, mr)), rem(pixel, mr))
            src = flat_index([chan] + pos, lead + src_shape)
            if xp_ws:  # (this group's slice)
                src = add(group_bordered, src)
            inner_stmt = (Store(col_ws, add(group_col, dest), Load(src_buf, src)),)
            extents = [rows] + list(out_sp[1:])
            for i in range(nsp - 1, -1, -1):
                inner_stmt = (For(ov[i], extents[i], inner_stmt, "vectorize" if i == nsp - 1 else "serial"),)
            for i in range(nsp - 1, -1, -1):
                inner_stmt = (For(kv[i], kernel[i], inner_stmt),)
            stmts.append(For(ci, cg, inner_stmt, parallel=True))

        def epilogue(mm, nn, acc):
            co = add(mul(Var(gv), cog), nn)
            value = acc if bias is None else fbin("add", acc, bias([co]))
            pixel = add(mul(row0, row_size), mm)
            spatial_idx = [pixel] if b.conv_collapsed else unflatten(pixel, out_sp)
            return store([Var(bv), co] + spatial_idx, value)

        if a_in_place:
            a_buf, a_off = xparam, add(mul(chan0(), m), mul(row0, row_size))
            a_sk = m
        else:
            a_buf, a_off, a_sk = col_ws, group_col, mr
        stmts.append(gemm_stmt(b, a_buf, a_off, 1, a_sk, wparam, mul(Var(gv), panel_stride), mc, cog, kk, epilogue,
                               stores_along="m", a_blocked=not a_in_place))
        return stmts

    full, last = divmod(lead_rows, rows_per_chunk)
    if implicit:
        body += implicit_rows()
        full = last = 0
    if full == 1:
        body += chunk(Const(0), rows_per_chunk)
    elif full:
        ch = b.fresh("ch")
        body.append(For(ch, full, tuple(chunk(mul(Var(ch), rows_per_chunk), rows_per_chunk))))
    if last:
        body += chunk(Const(full * rows_per_chunk), last)
    if parallel_groups:
        return tuple(prologue) + loop(bv, batch, (For(gv, groups, tuple(body), parallel=True),))
    one = None
    if isinstance(batch, Expr) and groups_fit:  # (a run-time batch of one: its groups in parallel)
        one = lower_conv_gemm(b, node, store, path, one_image=w_rows or wparam)
    return tuple(prologue) + over_images(b, bv, xs[0], loop(gv, groups, body), col_floats + bordered_floats,
                                         one=one)


def lower_pointwise(b: KernelBuilder, node: Node, store) -> tuple:
    """A 1x1 stride-1 conv as C[cout][pixel] = W[cout][c] x X[c][pixel]: the weights, as they
    are, are the broadcast operand and the input is B read in place, pixels contiguous. A
    tile's columns are then pixels, so the epilogue writes whole NCHW rows, and nothing is
    packed: with few input channels (MobileNet's 16 -> 96 expansions) the writing back is
    most of the work, and the other orientation scatters it across channel planes. (On AVX2
    the input of a large conv is packed first: `pointwise_packs_input`.)"""
    x_name, w_name = node.inputs[0], node.inputs[1]
    xs, (cout, cg) = b.type(x_name).shape, b.type(w_name).shape[:2]
    cin, groups = xs[1], b.attrs(node).get("group", 1)
    cog, out_dims = cout // groups, b.type(node.outputs[0]).shape[2:]
    out_sp = [b.dim(d) for d in out_dims]  # (over run-time sizes, expressions: a run-time n)
    pixels = math.prod(out_sp)
    bias = b.reader(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else None
    wparam, xparam = b.in_param(w_name), b.in_param(x_name)
    bv, gv = b.fresh("b"), b.fresh("g")

    def epilogue(mm, nn, acc):
        co = add(mul(Var(gv), cog), mm)
        value = acc if bias is None else fbin("add", acc, bias([co]))
        return store([Var(bv), co] + ([nn] if b.conv_collapsed else unflatten(nn, out_sp)), value)
    x_off = mul(add(mul(Var(bv), cin), mul(Var(gv), cg)), pixels)
    if isinstance(pixels, Expr):  # (the pixels' panels divide among threads; the tile is the bounds')
        most = math.prod(greatest(d) for d in out_dims)
        gemm = gemm_stmt(b, wparam, mul(Var(gv), cog * cg), cg, 1, xparam, x_off, cog, pixels, cg, epilogue,
                         b_sk=pixels, tile=b.tile(most), split="n", n_bound=most)
        return over_images(b, bv, xs[0], loop(gv, groups, (gemm,)), 0)
    if pointwise_packs_input(b.config.vector_width, cg, cog, pixels):
        packed_floats = -(-pixels // b.tile(pixels)[1]) * b.tile(pixels)[1] * cg
        packed, at = image_workspace(b, bv, xs[0], packed_floats, images_in_parallel(b, xs[0], packed_floats))
        pack = _runtime_pack(b, xparam, x_off, cg, pixels, pixels, 1, packed, dest_off=at)
        gemm = gemm_stmt(b, wparam, mul(Var(gv), cog * cg), cg, 1, packed, at, cog, pixels, cg, epilogue)
        return over_images(b, bv, xs[0], loop(gv, groups, pack + (gemm,)), packed_floats)
    gemm = gemm_stmt(b, wparam, mul(Var(gv), cog * cg), cg, 1, xparam, x_off, cog, pixels, cg, epilogue, b_sk=pixels)
    return over_images(b, bv, xs[0], loop(gv, groups, (gemm,)), 0)


def images_in_parallel(b: KernelBuilder, batch_dim, floats_per_image: int, limit: int = PARALLEL_SLICES_FLOATS) -> bool:
    """Whether a conv's images run on threads of their own, each with its own slice of
    `floats_per_image` of workspace: a batch (or its bound) of more than one whose slices
    fit `limit` floats."""
    images = greatest(batch_dim)
    return images > 1 and images * floats_per_image <= limit


def image_workspace(b: KernelBuilder, bv: str, batch_dim, floats: int, parallel: bool) -> tuple:
    """(a workspace of `floats` for each image where the images run in parallel, else one
    they share; image bv's offset in it). Over a run-time batch the slices are the call's
    batch (a Dim): a call of one image has one slice, not the bound's."""
    name = b.workspace((batch_dim if parallel else 1) * floats)
    return name, mul(Var(bv), floats) if parallel else Const(0)


def bordered_copies_limit(b: KernelBuilder, x_name: str) -> int:
    """images_in_parallel's limit for the bordered copies of a depthwise conv or a pool:
    twice the input tensor, or PARALLEL_SLICES_FLOATS if more. Their slices are the input
    again with its border, so they cost the arena what the input does, not an im2col's
    multiple of it; held to 8 MiB, MobileNetV2's 96-channel stride-2 depthwise conv at 112 x
    112 ran a batch of 4 on one thread (1.65 ms on two threads, 0.41 a batch of 1)."""
    return max(PARALLEL_SLICES_FLOATS, 2 * greatest(b.type(x_name).size))


def over_images(b: KernelBuilder, bv: str, batch_dim, body: tuple, floats_per_image: "int | None",
                limit: int = PARALLEL_SLICES_FLOATS, one: tuple | None = None) -> tuple:
    """The loop over a conv's images: on threads of their own where `images_in_parallel`
    (each image's workspace slice then starts at bv * floats_per_image; None: the images
    share their workspaces, one after another).

    Over a run-time batch, a call of one image would leave a thread idle: the body's loops
    and Gemms (or `one`, statements of their own for an image) then also stand as phases of
    their own, guarded by a batch of one (ir/loop.py, "Threads"), which threads divide as
    they divide a static batch of one's; the loop over images runs for any other batch."""
    images = b.dim(batch_dim)
    if floats_per_image is not None and images_in_parallel(b, batch_dim, floats_per_image, limit):
        many = (For(bv, images, tuple(body), parallel=True),)
    else:
        many = loop(bv, images, body)
    one = (Let(bv, Const(0)), *body) if one is None else one
    lets = tuple(s for s in one if isinstance(s, Let))
    work = tuple(s for s in one if not isinstance(s, Let))
    if not isinstance(images, Expr) or not all(isinstance(s, (For, Gemm)) for s in work):
        return many
    single = cmp("eq", images, Const(1))
    return (If(cmp("ne", images, Const(1)), many), *lets, *(If(single, (s,)) for s in work))


def is_depthwise(b: KernelBuilder, node: Node) -> bool:
    """Depthwise 2-D convs run direct; every other conv is a GEMM."""
    xs, ws_ = b.type(node.inputs[0]).shape, b.type(node.inputs[1]).shape
    groups = node.attrs.get("group", 1)
    return groups > 1 and groups == xs[1] and ws_[1] == 1 and len(xs) == 4 and node.inputs[1] in b.g.constants


def lower_depthwise(b: KernelBuilder, node: Node, store, value=lambda v: v, weights: str = "", out=None) -> tuple:
    """Direct depthwise conv over a zero-bordered copy of the input. Per output row, one loop
    along the row whose body is the whole (fully unrolled) kernel window: LLVM vectorizes it
    along the row, keeping the sum in registers and the window's weights hoisted.
    ConvInteger passes `value` (input element -> float32 x - zx), its weights' float32 copy
    (`weights`, a kernel parameter) and `out` (the float sum -> its output value)."""
    x_name, w_name = node.inputs[0], node.inputs[1]
    batch_dim, cin, h_dim, w_dim = b.type(x_name).shape
    cout = b.type(w_name).shape[0]
    mult = cout // cin
    a = b.attrs(node)
    (kh, kw), (sh, sw), (dh, dw) = a["kernel_shape"], a["strides"], a["dilations"]
    pt, pl, pb, pr = a["pads"]
    # Sizes known at run time only are expressions of the symbols; the workspaces are
    # planned at their greatest values.
    h, w_ = b.dim(h_dim), b.dim(w_dim)
    oh_dim, ow_dim = b.type(node.outputs[0]).shape[2:]
    oh, ow = b.dim(oh_dim), b.dim(ow_dim)
    xparam, wparam = b.in_param(x_name), weights or b.in_param(w_name)
    bias = b.reader(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] and not weights else None
    # With a column stride, the copy is split by column phase ([c][row][phase][col // stride]),
    # so a tap's inputs along an output row are contiguous instead of a strided gather.
    # (ints, or expressions over run-time sizes: // is a division of non-negative sizes)
    hp, wq = phase_split_size(h, w_, a["pads"], sw)
    hp_bound, wq_bound = phase_split_size(greatest(h_dim), greatest(w_dim), a["pads"], sw)
    # A copy of a plane past L1 keeps a ring of the channel's last `ring` padded rows instead,
    # each output row's new input rows copied just before it (see below).
    ring = (kh - 1) * dh + 1 if mult == 1 else 0
    in_ring = ring_when(ring, mul(mul(hp, sw * 4), wq), hp_bound * sw * wq_bound * 4)
    copy_floats = cin * (ring if in_ring is True else hp_bound) * sw * wq_bound
    # A window whose weights outnumber the registers (7x7: 49) runs as passes of a few window
    # rows each, summing into partial sums: in one pass LLVM spilled the weights and shuffled
    # registers between every two FMAs (ConvNeXt's 96x56x56 at half OpenVINO's rate).
    per_pass = kh if kh * kw <= DEPTHWISE_ONE_PASS_WEIGHTS else max(1, DEPTHWISE_PASS_WEIGHTS // kw)
    per_pass = b.knob("window_rows", per_pass, range(1, kh + 1))
    passes = [(u, min(per_pass, kh - u)) for u in range(0, kh, per_pass)]
    # A whole plane in L1 runs each pass over all its rows, its weights held in registers
    # from the first row to the last, into a plane of partial sums per channel, while those
    # planes stay in L2 (DEPTHWISE_PLANES_FLOATS).
    # Where the kernel's output is this conv's own float32 planes (an elementwise epilogue),
    # the passes sum into them, the last one reading its partial sum back, and every plane
    # runs pass by pass: no workspace of partial sums, whatever the planes' size. ConvMixer's
    # 768 x 32 x 32 (3 MiB of planes, row by row before) in the model, built both ways and
    # timed interleaved: 1.09 -> 0.80 ms each, the model 200.2 -> 192.2 ms (the workspace of
    # planes had made that conv 0.69 ms, the model no faster).
    root = b.members[-1].outputs[0] if b.members else ""
    in_output = (len(passes) > 1 and out is None and not weights and bool(root)
                 and dtype(b.type(root).dtype).storage == "f32" and b.type(root).shape == b.type(node.outputs[0]).shape)
    planes = len(passes) > 1 and in_ring is False and (
        in_output or cout * greatest(oh_dim) * greatest(ow_dim) <= DEPTHWISE_PLANES_FLOATS)
    partial_floats = 0 if in_output else cout * greatest(ow_dim) * (greatest(oh_dim) if planes else 1)
    # An epilogue calling exp, tanh or erf (SiLU, GELU, Mish) runs in a loop of its own along
    # each output row, over the row's sums written to a row of the channel's: in the window's
    # loop its constants and its chain of dependent FMAs took the registers and the latency the
    # window's independent sums need (depthwise_epilogue_apart_pays). (ConvInteger's path, its
    # `out` and `weights`, keeps one loop.)
    apart = (out is None and not weights and depthwise_epilogue_apart_pays(b.config.vector_width, least(ow_dim))
             and calls_math(tuple(store([Const(0)] * 4, Const(0.0, "f32")))))
    sums_floats = cout * greatest(ow_dim) if apart else 0
    # (images on threads of their own: a slice of the copy and of the partial sums each)
    limit = bordered_copies_limit(b, x_name)
    parallel = images_in_parallel(b, batch_dim, copy_floats + partial_floats + sums_floats, limit)
    bv = b.fresh("b")
    xp, xp_off = image_workspace(b, bv, batch_dim, copy_floats, parallel)

    def row_start(c, i):
        return xparam, add(mul(Var(bv), cin * h * w_), mul(add(mul(c, h), i), w_))

    def read(c, i, j):
        return value(Load(xparam, add(row_start(c, i)[1], j)))
    plain = not weights and dtype(b.type(x_name).dtype).storage == "f32"  # (not ConvInteger's bytes)
    if in_ring is True:  # (no whole planes: the channel loop only)
        pad_copy = For(b.fresh("c"), cin, ())
    elif sw == 1:
        pad_copy = padded_copy(b, xparam, mul(Var(bv), cin * h * w_), cin, [h, w_], [pt, pl, pb, pr], xp, value,
                               row_kind="vector_masked", dest_off=xp_off)
    else:
        pad_copy = phase_split_copy(b, read, cin, h, w_, pt, pl, sw, hp, wq, xp, row_start if plain else None,
                                    dest_off=xp_off, least_width=least(w_dim))
    if in_ring is not False:
        c, i = pad_copy.var, b.fresh("y")
        row_in, inside, border_row = phase_split_row(
            b, read, c, i, rem(Var(i), ring), ring, cin, h, w_, pt, pl, sw, wq, xp, row_start if plain else None,
            dest_off=xp_off, least_width=least(w_dim))
        copy_row = (If(row_in, inside, border_row),)
    co, r, v, q = b.fresh("co"), b.fresh("r"), b.fresh("kx"), b.fresh("q")
    ch = div(Var(co), mult)
    kx = mul(Var(v), dw)  # a constant once the window loop is unrolled
    b.ordered_sums = True

    def window_rows(first: int, count: int, ring: int, row=Var(r)) -> tuple[list, Expr]:
        """Statements summing window rows [first, first + count) at output (r, q), and their
        sum. One accumulator per window row: a single chain of kh*kw dependent FMAs made the
        loop wait on FMA latency (a 5x5 window, 25 in a row, ran at a third of the FMA rate)."""
        stmts, sums = [], []
        for u in range(first, first + count):
            acc = b.fresh("acc")
            window_row = add(mul(row, sh), Const(u * dh))
            at = add(xp_off, flat_index([ch, rem(window_row, ring) if ring else window_row, rem(kx, sw),
                                         add(Var(q), div(kx, sw))], [cin, ring or hp, sw, wq]))
            tap = Assign(acc, fbin("add", Var(acc, "f32"), fbin(
                "mul", Load(wparam, flat_index([Var(co), Const(u), Var(v)], [cout, kh, kw])), Load(xp, at))))
            stmts += [Local(acc, "f32", Const(0.0, "f32")), For(v, kw, (tap,), "unroll")]
            sums.append(Var(acc, "f32"))
        while len(sums) > 1:  # a balanced tree
            sums = [fbin("add", *sums[i:i + 2]) if i + 1 < len(sums) else sums[i] for i in range(0, len(sums), 2)]
        return stmts, sums[0]
    if in_output:
        partial, at = b.out_param(root), flat_index([Var(bv), Var(co), Var(r), Var(q)], b.shape(root))
    elif len(passes) > 1:
        # (a row or a plane per output channel: channels run in parallel)
        partial, partial_off = image_workspace(b, bv, batch_dim, partial_floats, parallel)
        at = add(partial_off, add(mul(add(mul(Var(co), oh), Var(r)) if planes else Var(co), ow), Var(q)))
    if apart:
        sums, sums_off = image_workspace(b, bv, batch_dim, sums_floats, parallel)
        sums_at = add(sums_off, add(mul(Var(co), ow), Var(q)))

    def output_rows(ring: int) -> tuple:
        """The channel's output rows over its copy: the whole plane, or a ring of its last
        `ring` padded rows (the rows each output row needs copied in first)."""
        # (vector_masked: a row's ragged end runs as one masked vector, not a scalar remainder)
        steps = []
        for n, (first, count) in enumerate(passes[:-1]):
            stmts, part = window_rows(first, count, ring)
            so_far = part if n == 0 else fbin("add", Load(partial, at), part)
            steps.append(For(q, ow, (*stmts, Store(partial, at, so_far)), "vector_masked"))

        def last_pass(row) -> tuple:
            stmts, total = window_rows(*passes[-1], ring, row)
            if len(passes) > 1:
                total = fbin("add", Load(partial, at), total)
            total = total if bias is None else fbin("add", total, bias([Var(co)]))
            if apart:
                return (*stmts, Store(sums, sums_at, total))
            return (*stmts, *store([Var(bv), Var(co), row, Var(q)], out(total) if out else total))
        one_row = last_pass(Var(r))
        if not ring and len(passes) == 1 and depthwise_row_pairs_pay(b.config.vector_width, kh, kw, sh, dh,
                                                                     apart or calls_math(one_row)):
            # Rows 2p and 2p + 1 in one loop along them (their shared input rows' loads are
            # one expression each: LLVM loads them once), then an odd last row alone.
            pair = b.fresh("rp")
            both = For(q, ow, (*last_pass(mul(Var(pair), 2)), *last_pass(add(mul(Var(pair), 2), 1))), "vector_masked")
            rows = [For(pair, div(oh, 2) if isinstance(oh, Expr) else oh // 2, (both,))]
            last = For(q, ow, last_pass(sub(oh, 1)), "vector_masked")
            if isinstance(oh, Expr):
                rows.append(If(cmp("eq", rem(oh, 2), 1), (last,), ()))
            elif oh % 2:
                rows.append(last)
            return tuple(rows)
        last = (For(q, ow, one_row, "vector_masked"),)
        if apart:  # (in the last pass's row loop: the sums' row holds one output row)
            applied = store([Var(bv), Var(co), Var(r), Var(q)], Load(sums, sums_at))
            last += (For(q, ow, tuple(applied), "vector_masked"),)
        if planes:
            return (*(For(r, oh, (step,)) for step in steps), For(r, oh, last))
        if not ring:
            return (For(r, oh, (*steps, *last)),)
        return rows_through_a_ring(b, copy_row, i, r, oh, sh, ring, (*steps, *last))
    # Each channel is computed right after its padded copy is written, while that plane is
    # still in L1, rather than after every plane's copy (1.3 MB for a 96x56x56 input, past
    # L2); one parallel phase instead of two.
    c, m = pad_copy.var, b.fresh("m")

    def channel(ring: int) -> tuple:
        per_output = For(m, mult, (Let(co, add(mul(Var(c), mult), Var(m))), *output_rows(ring)))
        return (per_output,) if ring else (*pad_copy.body, per_output)
    if in_ring is True or in_ring is False:
        body = channel(ring if in_ring else 0)
    else:
        body = (If(in_ring, channel(ring), channel(0)),)
    image = (For(c, cin, body, parallel=True),)
    return over_images(b, bv, batch_dim, image, copy_floats + partial_floats + sums_floats, limit)


def conv_operands(b: KernelBuilder, node: Node) -> tuple:
    """A convolution's (input, weight, input shape, weight shape, group, kernel, strides,
    dilations, pads), its window parameters as inference resolved them."""
    a = b.attrs(node)
    x_name, w_name = node.inputs[0], node.inputs[1]
    return (x_name, w_name, b.type(x_name).shape, b.type(w_name).shape, a.get("group", 1), a["kernel_shape"],
            a["strides"], a["dilations"], a["pads"])


def lower_conv_transpose(b: KernelBuilder, node: Node, store) -> tuple:
    """GEMM then col2im: cols[(co, kpos)][pixel] = sum_ci W[ci][co, kpos] * X[ci][pixel], then
    each output point gathers the (at most kernel-size) columns whose window covers it. The
    GEMM does the Cin-deep work at full speed; the gather is Cin times cheaper than direct.
    Over input sizes known at run time only, the planes of cols (and of a copy of the input,
    the GEMM's A, whose k steps are planes apart) are as large as the sizes' bounds allow."""
    x_name, w_name, xs, wsh, groups, kernel, strides, dil, pads = conv_operands(b, node)
    nsp = len(kernel)
    cin, cog = xs[1], wsh[1]
    cig = cin // groups
    in_sp = [b.dim(d) for d in xs[2:]]
    at_run_time = any(isinstance(d, Expr) for d in in_sp)
    m = math.prod(in_sp)  # (an int, or a run-time size's expression)
    plane = math.prod(greatest(d) for d in xs[2:])  # (m, or its bound: the planes' stride)
    kpos = math.prod(kernel)
    n = cog * kpos
    oshape = b.shape(node.outputs[0])
    bias = b.reader(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else None
    xparam = b.in_param(x_name)
    nr = b.tile(n)[1]
    panel_stride = -(-n // nr) * cig * nr
    if w_name in b.g.constants:
        wparam = packed_weight(b, w_name, ("pointwise", groups), nr, lambda: b.g.constants[w_name].reshape(groups, cig, n))
        prologue = ()
    else:
        wparam = b.workspace(groups * panel_stride)
        gp = b.fresh("wg")
        prologue = loop(gp, groups, _runtime_pack(b, b.in_param(w_name), mul(Var(gp), cig * n), cig, n, n, 1,
                                                  wparam, mul(Var(gp), panel_stride)))
    cols = b.workspace(n * plane)
    bv, gv = b.fresh("b"), b.fresh("g")
    first_plane = mul(add(mul(Var(bv), cin), mul(Var(gv), cig)), m)
    copy = ()
    a_buf, a_off = xparam, first_plane
    if at_run_time:
        a_buf, a_off = b.workspace(cig * plane), Const(0)
        ci, p = b.fresh("ci"), b.fresh("p")
        copy = (For(ci, cig, (For(p, m, (Store(a_buf, add(mul(Var(ci), plane), Var(p)),
                                               Load(xparam, add(add(first_plane, mul(Var(ci), m)), Var(p)))),),
                                  "vectorize"),), parallel=True),)
    gemm = gemm_stmt(b, a_buf, a_off, 1, plane, wparam, mul(Var(gv), panel_stride), m, n, cig,
                     lambda mm, nn, acc: [Store(cols, add(mul(nn, plane), mm), acc)], stores_along="m",
                     split="n" if at_run_time else "")

    def point(oidx):
        acc = b.fresh("acc")
        co = oidx[0]
        body = [Local(acc, "f32", Const(0.0, "f32"))]

        def tap(kidx):
            ok, src = None, []
            for i in range(nsp):
                num = sub(add(oidx[1 + i], pads[i]), mul(kidx[i], dil[i]))
                safe = fbin("max", num, Const(0))
                q = div(safe, strides[i])
                valid = fbin("and", cmp("ge", num, Const(0)),
                             fbin("and", cmp("eq", rem(safe, strides[i]), Const(0)), cmp("lt", q, in_sp[i])))
                ok = valid if ok is None else fbin("and", ok, valid)
                src.append(fbin("min", q, sub(in_sp[i], 1)))
            col = add(mul(co, kpos), flat_index(list(kidx), kernel))
            value = Load(cols, add(mul(col, plane), flat_index(src, in_sp)))
            return [Assign(acc, fbin("add", Var(acc, "f32"), select(ok, value, Const(0.0, "f32"))))]

        body += b.loops(kernel, tap, inner_kind="unroll")
        oc = add(mul(Var(gv), cog), co)
        value = Var(acc, "f32") if bias is None else fbin("add", Var(acc, "f32"), bias([oc]))
        return body + list(store([Var(bv), oc] + list(oidx[1:]), value))

    col2im = b.loops([cog] + list(oshape[2:]), point, inner_kind="serial", parallel=True)
    return prologue + over_images(b, bv, xs[0], loop(gv, groups, copy + (gemm,) + tuple(col2im)), None)


# ---- matmul and gemm ---------------------------------------------------------------------

def _plain_product(b: KernelBuilder, oshape, k: int, a_at, b_at, store, t: str) -> tuple:
    """A dot product per output element, accumulated in t: the MatMul and Gemm of types the
    float32 micro-kernel does not compute (float64, integers, which wrap at their width)."""
    def point(idx):
        acc, kv = b.fresh("acc"), b.fresh("k")
        return [Local(acc, t, Const(0)),
                For(kv, k, (Assign(acc, fbin("add", Var(acc, t), fbin("mul", a_at(idx, Var(kv)),
                                                                         b_at(idx, Var(kv))))),)),
                *store(idx, Var(acc, t))]
    return b.loops(oshape, point, inner_kind="serial", parallel=True)


def _operand_readers(b: KernelBuilder, a_name: str, b_name: str, batch: list, sa: list, sb: list, va: bool,
                     vb: bool) -> tuple:
    """a_at(idx, k) and b_at(idx, k): A's and B's elements for output index idx (its batch
    dims, row and column; a vector operand has no row, or no column) at k."""
    ra, rb, nb = b.reader(a_name), b.reader(b_name), len(batch)

    def split(idx):
        rest = list(idx[nb:])
        return list(idx[:nb]), (None if va else rest.pop(0)), (None if vb else rest.pop(0))

    def a_at(idx, kk):
        bi, mi, _ = split(idx)
        return ra(broadcast_index(bi, batch, sa[:-2]) + ([] if va else [mi]) + [kk])

    def b_at(idx, kk):
        bi, _, ni = split(idx)
        return rb([kk] if vb else broadcast_index(bi, batch, sb[:-2]) + [kk, ni])
    return a_at, b_at


def _lower_matmul_symbolic(b: KernelBuilder, node: Node, store, out: str = "") -> tuple:
    """A MatMul over symbolic dims: one GEMM over the rows where B is constant weights, else
    (attention's products of two run-time tensors) rows accumulated in the output buffer
    (`_accumulated_rows`) or, where that buffer cannot hold the sums, a dot product per element."""
    a_name, b_name = node.inputs[0], node.inputs[1]
    if b_name in b.g.constants and len(b.type(b_name).shape) == 2 and b.compute(a_name) == "f32":
        return _lower_matmul_rows(b, node, store)
    sa, sb = list(b.type(a_name).shape), list(b.type(b_name).shape)
    va, vb = len(sa) == 1, len(sb) == 1
    sa, sb = ([1] + sa if va else sa), (sb + [1] if vb else sb)
    oshape = b.shape(node.outputs[0])
    batch = list(oshape[:len(oshape) - (0 if va else 1) - (0 if vb else 1)])
    la, lb = [b.dim(d) for d in sa], [b.dim(d) for d in sb]
    a_at, b_at = _operand_readers(b, a_name, b_name, batch, la, lb, va, vb)
    root = b.outputs[int(out[1:])] if out else ""
    if root and not vb and b.compute(a_name) == "f32" and b.compute(root) == "f32" and b.shape(root) == oshape:
        return _accumulated_rows(b, oshape, la[-1], a_at, b_at, store, out)
    return _plain_product(b, oshape, la[-1], a_at, b_at, store, b.compute(a_name))


ROW_K_UNROLL = 4  # k steps per pass over the accumulated rows: 4 multiply-adds per load and store of a row
ROW_BLOCK = 4  # output rows per pass: each row of B read once for all of them


def _accumulated_rows(b: KernelBuilder, oshape, k, a_at, b_at, store, out: str) -> tuple:
    """Output rows as sum_k a[m, k] * B[k, :], accumulated in the output buffer itself
    (float32, the group's result of the same shape): ROW_BLOCK rows at a time, ROW_K_UNROLL
    rows of B per pass, each B row read along its contiguous dim once for the block, the
    loop over columns vectorized (a dot product per element would walk B down a column).
    The epilogue then runs over the rows in place. The leading dims (batch, heads) are one
    loop, divided across threads."""
    lead, m, n = list(oshape[:-2]), oshape[-2], oshape[-1]

    def cols(fn):
        v = b.fresh("n")
        return For(v, n, tuple(fn(Var(v))), "vectorize")

    def block(bidx, m0, rows: int) -> list:
        ridx = [list(bidx) + [add(m0, r)] for r in range(rows)]
        at = lambda r, nn: flat_index(ridx[r] + [nn], oshape)  # noqa: E731

        def steps(first, count: int) -> list:
            """rows += sum over k = first .. first + count - 1 of a[row, k] * B[k, :]"""
            a = [[b.fresh("a") for _ in range(count)] for _ in range(rows)]
            lets = [Let(a[r][i], a_at(ridx[r] + [Const(0)], add(first, i))) for r in range(rows) for i in range(count)]

            def update(nn):
                bv = [b.fresh("bv") for _ in range(count)]
                stmts = [Let(bv[i], b_at(ridx[0] + [nn], add(first, i))) for i in range(count)]
                for r in range(rows):
                    total = fold_balanced("add", [fbin("mul", Var(a[r][i], "f32"), Var(bv[i], "f32"))
                                                  for i in range(count)])
                    stmts.append(Store(out, at(r, nn), fbin("add", Load(out, at(r, nn)), total)))
                return stmts
            return lets + [cols(update)]
        kq, kr = b.fresh("kq"), b.fresh("kr")
        passes, left = div(k, ROW_K_UNROLL), rem(k, ROW_K_UNROLL)
        return [cols(lambda nn: [Store(out, at(r, nn), Const(0.0, "f32")) for r in range(rows)]),
                For(kq, passes, tuple(steps(mul(Var(kq), ROW_K_UNROLL), ROW_K_UNROLL))),
                For(kr, left, tuple(steps(add(mul(passes, ROW_K_UNROLL), Var(kr)), 1))),
                *[cols(lambda nn, r=r: store(ridx[r] + [nn], Load(out, at(r, nn)))) for r in range(rows)]]
    return by_row_blocks(b, lead, m, ROW_BLOCK, block)


def by_row_blocks(b: KernelBuilder, lead: list, m, rows: int, block) -> tuple:
    """Each matrix of a batch of them (the `lead` dims: one loop, divided across threads), its
    m rows in blocks of `rows`, then those left one at a time: block(matrix index, first
    row, row count) gives the statements of one block."""
    def matrix(bidx) -> list:
        mb, mr = b.fresh("mb"), b.fresh("mr")
        full = div(m, rows)
        return [For(mb, full, tuple(block(bidx, mul(Var(mb), rows), rows))),
                For(mr, rem(m, rows), tuple(block(bidx, add(mul(full, rows), Var(mr)), 1)))]
    if not lead:
        return tuple(matrix([]))
    bh = b.fresh("bh")
    return (For(bh, math.prod(lead), tuple(matrix(unflatten(Var(bh), lead))), "serial", True),)


def bf16_product(b: KernelBuilder, name: str, a_param: str, a_off, a_sm: int, m, k: int, n: int,
                 weights, epilogue_fn, split: str = "") -> tuple:
    """Statements computing A[m, k] (rows a_sm apart from a_off) x weights()[k, n] (the
    constant `name` as a [k, n] matrix) in bf16 precision (ir/lower/bf16_gemm.py), each
    element through epilogue_fn(mm, nn, acc): on AMX-BF16 a "bf16" Gemm on tiles over a
    bfloat16 copy of A and B packed in pairs; elsewhere the float32 Gemm over both rounded."""
    b.reduced = True
    rows = b.fresh("br")
    if not b.config.bf16_tiles:
        a_ws, j = b.workspace(m * k), b.fresh("bk")
        at = add(a_off, add(mul(Var(rows), a_sm), Var(j)))
        copy = For(rows, m, (For(j, k, (Store(a_ws, add(mul(Var(rows), k), Var(j)),
                                              Call("round_bf16", (Load(a_param, at),))),), "vectorize"),),
                   parallel=True)
        nr = b.tile(n)[1]
        b_param = packed_weight(b, name, ("bf16 rounded",), nr, lambda: bf16_rounded(weights()))
        return (copy,) + split_by_run_time_rows(gemm_stmt(b, a_ws, Const(0), k, 1, b_param, Const(0), m, n, k,
                                                          epilogue_fn, split=split))
    kp = -(-k // PAIR_STEP) * PAIR_STEP
    tile = tile_shape(b, n)
    a_ws, j = b.workspace(m * kp, "bf16"), b.fresh("bk")
    at = add(a_off, add(mul(Var(rows), a_sm), fbin("min", Var(j), Const(k - 1)) if kp > k else Var(j)))
    value = Load(a_param, at)
    if kp > k:  # (the pad elements meet zero weights)
        value = select(cmp("lt", Var(j), Const(k)), value, Const(0.0, "f32"))
    copy = For(rows, m, (For(j, kp, (Store(a_ws, add(mul(Var(rows), kp), Var(j)), value),), "vectorize"),),
               parallel=True)
    b_param = b.packed_param(f"{name}_bf16_pairs", ("bf16 pairs", name, tile[1]),
                             lambda: pack_pair_panels(weights(), kp, tile[1]))
    return (copy,) + split_by_run_time_rows(gemm_stmt(b, a_ws, Const(0), kp, 1, b_param, Const(0), m, n, kp // 2,
                                                      epilogue_fn, kind="bf16", tile=tile, tiles=True, split=split))


def _lower_matmul_rows(b: KernelBuilder, node: Node, store) -> tuple:
    """[..., K] x [K, N]: one GEMM over the product of A's leading dims, the rows. With
    symbolic dims they are known at run time (one row for a decoding step) and threads share
    the weight panels (split "n"), so a single row still streams each weight once. Static
    leading dims are rows too: XLNet's [64, 1, 256] is 64 rows, not 64 products of one row
    that each stream all of B."""
    a_name, b_name = node.inputs[0], node.inputs[1]
    (k, n), lead = b.type(b_name).shape, list(b.shape(node.outputs[0])[:-1])
    nr = b.tile(n)[1]

    def epilogue(mm, nn, acc):  # (leading dims not collapsed into one: the row's index in them, by division)
        return store(unflatten(mm, lead) + [nn], acc)
    rows = math.prod(lead)  # (ints and run-time sizes multiply as Exprs)
    symbolic = not isinstance(rows, int)
    if b_name in b.g.constants and b.in_bf16():
        return bf16_product(b, b_name, b.in_param(a_name), Const(0), k, rows, k, n, lambda: b.g.constants[b_name],
                            epilogue, split="n" if symbolic else "")
    stmts = []
    if b_name in b.g.constants:
        b_param = packed_weight(b, b_name, ("k_n",), nr, lambda: b.g.constants[b_name])
    else:  # (packed once per call, for all the rows)
        b_param = b.workspace(-(-n // nr) * k * nr)
        stmts += _runtime_pack(b, b.in_param(b_name), Const(0), k, n, n, 1, b_param)
    return tuple(stmts) + split_by_run_time_rows(gemm_stmt(b, b.in_param(a_name), Const(0), k, 1, b_param, Const(0),
                                                           rows, n, k, epilogue, split="n" if symbolic else ""))


def lower_matmul(b: KernelBuilder, node: Node, store, out: str = "") -> tuple:
    a_name, b_name = node.inputs[0], node.inputs[1]
    if not (b.type(a_name).is_static and b.type(b_name).is_static):
        return _lower_matmul_symbolic(b, node, store, out)
    sa, sb = list(b.type(a_name).shape), list(b.type(b_name).shape)
    if len(sa) > 2 and len(sb) == 2 and b.compute(a_name) == "f32":
        return _lower_matmul_rows(b, node, store)
    va, vb = len(sa) == 1, len(sb) == 1
    sa = [1] + sa if va else sa
    sb = sb + [1] if vb else sb
    m, k, n = sa[-2], sa[-1], sb[-1]
    oshape = b.type(node.outputs[0]).shape
    batch = list(np.broadcast_shapes(tuple(sa[:-2]), tuple(sb[:-2])))
    if b.compute(a_name) != "f32":
        a_at, b_at = _operand_readers(b, a_name, b_name, batch, sa, sb, va, vb)
        return _plain_product(b, oshape, k, a_at, b_at, store, b.compute(a_name))
    a_param = b.in_param(a_name)
    const_b = b_name in b.g.constants
    if const_b and not batch and b.in_bf16():
        def at_row(mm, nn, acc):
            return store(([] if va else [mm]) + ([] if vb else [nn]), acc)
        return bf16_product(b, b_name, a_param, Const(0), k, m, k, n, lambda: b.g.constants[b_name].reshape(k, n),
                            at_row)
    nr = b.tile(n)[1]
    panels = -(-n // nr)
    per_batch = False
    if const_b:
        flat = b.g.constants[b_name].reshape(sb).reshape(-1, k, n)
        b_param = packed_weight(b, b_name, ("batched",) if flat.shape[0] > 1 else ("k_n",), nr,
                                lambda: flat if flat.shape[0] > 1 else flat[0])
    else:
        b_src = b.in_param(b_name)
        # One packed B per batch element (attention: per head) lets the heads run in
        # parallel; a batch too large for that shares one, on one thread.
        per_batch = math.prod(batch) * panels * k * nr <= RUNTIME_PACK_FLOATS
        b_param = b.workspace(panels * k * nr * (math.prod(batch) if per_batch else 1))

    def body(bidx):
        a_off = mul(flat_index(broadcast_index(bidx, batch, sa[:-2]), sa[:-2] or [1]), m * k)
        b_mat = flat_index(broadcast_index(bidx, batch, sb[:-2]), sb[:-2] or [1])
        stmts = []
        if const_b:
            b_off = mul(b_mat, panels * k * nr)
        else:
            b_off = mul(flat_index(bidx, batch), panels * k * nr) if per_batch and batch else Const(0)
            stmts += _runtime_pack(b, b_src, mul(b_mat, k * n), k, n, n, 1, b_param, b_off)

        def epilogue(mm, nn, acc):
            idx = list(bidx) + ([] if va else [mm]) + ([] if vb else [nn])
            return store(idx[-len(oshape):] if oshape else [], acc)
        stmts.append(gemm_stmt(b, a_param, a_off, k, 1, b_param, b_off, m, n, k, epilogue))
        return stmts

    return b.loops(batch, body, inner_kind="serial", parallel=const_b or per_batch) if batch else tuple(body([]))


def lower_gemm(b: KernelBuilder, node: Node, store) -> tuple:
    a_name, b_name = node.inputs[0], node.inputs[1]
    at = b.attrs(node)
    ta, tb = at.get("transA", 0), at.get("transB", 0)
    alpha, beta = float(at.get("alpha", 1.0)), float(at.get("beta", 1.0))
    sa, sb = b.type(a_name).shape, b.type(b_name).shape
    m, k = (sa[1], sa[0]) if ta else sa
    n = sb[0] if tb else sb[1]
    rows_at_run_time = not isinstance(m, int)  # (a symbolic batch: the rows GEMM of a MatMul over symbolic rows)
    if rows_at_run_time and (ta or b_name not in b.g.constants or b.compute(a_name) != "f32"):
        raise TypeError("a Gemm over symbolic rows takes constant float32 weights and A not transposed")
    m = b.dim(m)
    nr = b.tile(n)[1]
    c = b.reader(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] and beta != 0 else None
    cshape = b.shape(node.inputs[2]) if c else None

    def finish(idx, acc):  # alpha * AB + beta * C
        value = acc if alpha == 1 else fbin("mul", acc, Const(alpha, "f32"))
        if c is not None:
            cv = c(broadcast_index(idx, (m, n), cshape))
            value = fbin("add", value, cv if beta == 1 else fbin("mul", cv, Const(beta, "f32")))
        return store(idx, value)

    if b.compute(a_name) != "f32":
        ra, rb = b.reader(a_name), b.reader(b_name)
        return _plain_product(b, (m, n), k, lambda idx, kk: ra([kk, idx[0]] if ta else [idx[0], kk]),
                              lambda idx, kk: rb([idx[1], kk] if tb else [kk, idx[1]]), finish, b.compute(a_name))
    a_param = b.in_param(a_name)
    if b_name in b.g.constants and not ta and b.in_bf16():
        weights = b.g.constants[b_name]
        return bf16_product(b, b_name, a_param, Const(0), k, m, k, n, lambda: weights.T if tb else weights,
                            lambda mm, nn, acc: finish([mm, nn], acc), split="n" if rows_at_run_time else "")
    stmts = []
    if b_name in b.g.constants:
        b_param = packed_weight(b, b_name, ("n_k",) if tb else ("k_n",), nr,
                                lambda: b.g.constants[b_name].T if tb else b.g.constants[b_name])
    else:
        b_param = b.workspace(-(-n // nr) * k * nr)
        stmts += _runtime_pack(b, b.in_param(b_name), Const(0), k, n, 1 if tb else n, k if tb else 1, b_param)
    stmts += split_by_run_time_rows(gemm_stmt(b, a_param, Const(0), 1 if ta else k, m if ta else 1, b_param,
                                              Const(0), m, n, k, lambda mm, nn, acc: finish([mm, nn], acc),
                                              split="n" if rows_at_run_time else ""))
    return tuple(stmts)


def lower_einsum(b: KernelBuilder, node: Node, store) -> tuple:
    """A sum of products per output element over the contracted subscripts, in the inputs'
    compute type (an operand's dim of 1 broadcasts)."""
    a = b.attrs(node)
    subs, out, dims = a["subscripts"], a["output"], a["dims"]
    contracted = [c for c in dict.fromkeys("".join(subs)) if c not in out]
    readers = [b.reader(i) for i in node.inputs]
    shapes = [b.shape(i) for i in node.inputs]
    t = b.compute(node.inputs[0])

    def point(oidx):
        where = dict(zip(out, oidx))
        acc = b.fresh("acc")

        def term(cidx):
            at = {**where, **dict(zip(contracted, cidx))}
            value = None
            for r, s, shape in zip(readers, subs, shapes):
                v = r([Const(0) if d == 1 else at[c] for c, d in zip(s, shape)])
                value = v if value is None else fbin("mul", value, v)
            return [Assign(acc, fbin("add", Var(acc, t), value))]
        return [Local(acc, t, Const(0)), *b.loops([dims[c] for c in contracted], term, inner_kind="serial"),
                *store(oidx, Var(acc, t))]
    return b.loops([dims[c] for c in out], point, inner_kind="serial", parallel=True)
