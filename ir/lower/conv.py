"""Which way a convolution is computed: the rules' choice, or a tuned schedule's (`conv_path`).

Depthwise convs have one way (direct windows, over sizes known at run time too); other convs
over symbolic spatial sizes are Winograd's (as the rule takes it at the sizes' bounds),
pointwise (few input channels, 1x1) or an implicit GEMM through tables computed at run time;
every other conv may be an implicit GEMM (the input read in place), an im2col GEMM, a 1x1 conv
with the weights as the broadcast operand ("pointwise"), a conv of few output channels or a
small window with the weights as rows ("weights_rows"), or for 3x3 stride-1 convs Winograd's
F(2x2, 3x3) or F(4x4, 3x3) (the rule where channels are enough to repay its transforms:
`winograd_pays`; the bigger tiles where the picture has enough of them: `winograd_tile`).
"""
from __future__ import annotations

import math

from ..graph import Node
from ..symbolic import greatest, least
from .bf16_conv import conv_on_tiles, lower_conv_bf16
from .builder import KernelBuilder
from .gemm import (IMPLICIT_WASTE_LIMIT, NARROW_CONV_TILES, POINTWISE_MAX_K, POINTWISE_MIN_PIXELS, conv_border_spans,
                   implicit_over_plane, is_depthwise, lower_conv_gemm, lower_conv_symbolic, lower_depthwise,
                   lower_pointwise, pointwise_packs_input, row_blocks_filled, rows_wide_enough, tiles_border_skip,
                   weights_as_rows_pay)
from .winograd import WINOGRAD_PATHS, lower_winograd, winograd_fits, winograd_pays, winograd_tile


def lower_conv(b: KernelBuilder, node: Node, store) -> tuple:
    if conv_on_tiles(b, node):  # (a bf16 build on AMX-BF16)
        return lower_conv_bf16(b, node, store)
    if is_depthwise(b, node):
        return lower_depthwise(b, node, store)
    if not all(isinstance(d, int) for d in b.type(node.inputs[0]).shape[2:]):
        channels, out_sp = b.type(node.inputs[1]).shape[1::-1], b.type(node.outputs[0]).shape[2:]
        if winograd_fits(b, node) and winograd_pays(b.config.vector_width, *channels, [greatest(d) for d in out_sp]):
            # (the rule as at the sizes' bounds; F(4x4, 3x3) where even the least picture has tiles enough)
            m = winograd_tile(b.config.vector_width, *channels, [least(d) for d in out_sp])
            return lower_winograd(b, node, store, m)
        return lower_pointwise(b, node, store) if pointwise_over_run_time_sizes(b, node) else \
            lower_conv_symbolic(b, node, store)
    path = b.knob("conv_path", *conv_paths(b, node))
    if path in WINOGRAD_PATHS:
        return lower_winograd(b, node, store, WINOGRAD_PATHS[path])
    if path == "pointwise":
        return lower_pointwise(b, node, store)
    return lower_conv_gemm(b, node, store, path)


def pointwise_over_run_time_sizes(b: KernelBuilder, node: Node) -> bool:
    """A 1x1 stride-1 conv over run-time sizes is pointwise where static sizes' rule would
    take it at any size (few input channels, float32, constant weights): its output is then
    written along pixel rows, not transposed from tiles of pixels (MobileNetV2's 16 -> 96
    expansion at 112 x 112: 1.27 ms as the implicit GEMM, 0.65 pointwise, 0.62 static)."""
    a = b.attrs(node)
    w_name = node.inputs[1]
    return (all(k == 1 for k in a["kernel_shape"]) and all(s == 1 for s in a["strides"]) and not any(a["pads"])
            and w_name in b.g.constants and b.type(node.inputs[0]).dtype == "float32"
            and b.type(w_name).shape[1] <= POINTWISE_MAX_K)


def conv_paths(b: KernelBuilder, node: Node) -> tuple:
    """(the rule's path, every path the conv can take): see the "conv_path" knob."""
    x_name, w_name = node.inputs[0], node.inputs[1]
    a = b.attrs(node)
    kernel, strides, pads = a["kernel_shape"], a["strides"], a["pads"]
    cog = b.type(w_name).shape[0] // a.get("group", 1)
    out_sp = b.type(node.outputs[0]).shape[2:]
    const_w = w_name in b.g.constants
    pointwise = all(k == 1 for k in kernel) and all(s == 1 for s in strides) and not any(pads)
    if pointwise:  # (its "im2col" reads the input in place: no copy)
        can = const_w and b.type(x_name).dtype == "float32"
        cg, pixels = b.type(w_name).shape[1], math.prod(b.type(x_name).shape[2:])
        packs = pointwise_packs_input(b.config.vector_width, cg, cog, pixels)
        rule = "pointwise" if can and pixels >= POINTWISE_MIN_PIXELS and (cg <= POINTWISE_MAX_K or packs) else "im2col"
        return rule, ("pointwise", "im2col") if can else ("im2col",)
    # Implicit GEMM: A is read in place and im2col disappears. A tile of few rows runs across
    # the output rows (`implicit_over_plane`), wasting the plane's last block: taken while
    # that block is filled well enough (IMPLICIT_WASTE_LIMIT), counting the work the tiles
    # skip in the border (ResNet's 512-channel 3x3 at 7x7 on x86-64-v3: 2.33 ms im2col,
    # 2.01 implicit). A taller tile stays within an output row (Gemm.a_rows), whose pixels
    # are input positions `stride` apart, the row's last block a shorter tile: taken where
    # rows are wide enough (`rows_wide_enough`). A one-position window (a strided 1x1) goes
    # to im2col on few-row tiles: its copy holds each input value once at most, while the
    # implicit tiles broadcast each k step's pixels from another channel plane (ResNet-50's
    # stride-2 projections on x86-64-v3: 256 -> 512 at 56x56 2.59 -> 2.12 ms, 512 -> 1024 at
    # 28x28 2.71 -> 1.97; AVX-512's taller tiles within rows stay ahead of im2col, 1.93
    # against 2.03 and 1.86 against 2.16; a 3x3 stride-2 copies 9 values a pixel and stays).
    # (The rule's tile decides, whatever tile is tuned.)
    winograd = tuple(WINOGRAD_PATHS) if winograd_fits(b, node) else ()
    shape = (b.config.vector_width, b.type(w_name).shape[1], cog, out_sp)
    if winograd and winograd_pays(*shape):
        rule = {m: path for path, m in WINOGRAD_PATHS.items()}[winograd_tile(*shape)]
        return rule, ("implicit", "im2col") + winograd
    mr, kk = b.config.tile(cog)[0], math.prod(b.type(w_name).shape[1:])
    if implicit_over_plane(mr):
        fill = row_blocks_filled(math.prod(out_sp), mr)
        skipped = tiles_border_skip(conv_border_spans(b, node), math.prod(out_sp[1:]), math.prod(out_sp), mr, kk)
        implicit = math.prod(kernel) > 1 and fill > 0 and (1 - fill - skipped) * cog <= IMPLICIT_WASTE_LIMIT
    else:
        implicit = rows_wide_enough(out_sp[-1], mr, cog, cog * kk * 4)
    # With at most a vector of output channels, a tile of pixels x channels broadcasts one
    # input value per FMA; with the weights as rows against two vectors of an input row, one
    # weight feeds two FMAs; more channels take it where the window holds few values
    # (`weights_as_rows_pay`). A column stride reads the input from a copy split by column
    # phase (2-D convs).
    can_rows = b.config.vector_width in NARROW_CONV_TILES and const_w and (strides[-1] == 1 or len(kernel) == 2)
    rows = can_rows and weights_as_rows_pay(b.config.vector_width, cog, kk, strides[-1], math.prod(kernel)) and \
        out_sp[-1] >= NARROW_CONV_TILES[b.config.vector_width][1]
    rule = ("weights_rows" if rows else "implicit") if implicit else "im2col"
    return rule, ("implicit", "im2col") + (("weights_rows",) if can_rows else ()) + winograd
