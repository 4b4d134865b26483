"""trim_conv_windows: drop the kernel taps of a Conv that only ever read padding.

A dilated conv on a small map reads its outer taps from the zero border alone: DeepLabV3's
atrous convs (3x3, dilations 12, 24, 36, pads equal to them) on a 16x16 map have taps 24
and 36 pixels out of the centre, past every input pixel for every output pixel. Such a tap
adds zero times its weight; without it the conv computes the same outputs from a smaller
window (a 1x1 conv for dilations 24 and 36 there: a ninth of the work, and no bordered copy
of the input 88 pixels wide). Only whole rows and columns of taps at the window's edges
go, so the window stays a window: its kernel shrinks, and its pads shrink by as much.
"""
from __future__ import annotations

from ..graph import Graph, Node
from ..ops.conv_gemm import CONV
from ..ops.inference import infer
from ..transform import graph_pass


def _live_taps(size: int, out: int, kernel: int, stride: int, dilation: int, pad: int) -> tuple[int, int] | None:
    """(first, last) tap along one axis that reads an input pixel for some output pixel."""
    reads = [t for t in range(kernel)
             if any(0 <= o * stride + t * dilation - pad < size for o in range(out))]
    return (reads[0], reads[-1]) if reads else None


@graph_pass(opt_level=1)
def trim_conv_windows(g: Graph, ctx) -> Graph:
    for i, node in enumerate(g.nodes):
        if node.op != CONV or node.inputs[1] not in g.constants or not g.types[node.inputs[0]].is_static:
            continue
        (y,), p = infer(g, node)  # (the window's pads made explicit; a conv BatchNorm folded into has none yet)
        x = g.types[node.inputs[0]]
        kernel, strides, dil, pads = p["kernel_shape"], p["strides"], p["dilations"], p["pads"]
        n = len(kernel)
        live = [_live_taps(x.shape[2 + a], y.shape[2 + a], kernel[a], strides[a], dil[a], pads[a]) for a in range(n)]
        if None in live or all(lo == 0 and hi == k - 1 for (lo, hi), k in zip(live, kernel)):
            continue  # (every tap reads, or none does: a window over padding alone, left as it is)
        begin = [pads[a] - live[a][0] * dil[a] for a in range(n)]
        new_kernel = [hi - lo + 1 for lo, hi in live]
        # the end pads that keep each output size: (out - 1) * stride + extent = size + pads
        end = [(y.shape[2 + a] - 1) * strides[a] + (new_kernel[a] - 1) * dil[a] + 1 - x.shape[2 + a] - begin[a]
               for a in range(n)]
        if min(begin + end) < 0:
            continue  # (a window that would need negative pads, a crop: left as it is)
        w = g.constants[node.inputs[1]]
        window = (slice(None), slice(None)) + tuple(slice(lo, hi + 1) for lo, hi in live)
        trimmed = g.add_constant(g.fresh_name(f"{node.name}_w_trimmed"), w[window].copy())
        attrs = {k: v for k, v in node.attrs.items() if k != "auto_pad"}
        attrs.update(kernel_shape=new_kernel, pads=begin + end, strides=list(strides), dilations=list(dil))
        g.nodes[i] = Node(CONV, [node.inputs[0], trimmed] + node.inputs[2:], node.outputs, attrs, node.name,
                          node.guard)
    return g
