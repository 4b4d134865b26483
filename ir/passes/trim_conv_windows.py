"""trim_conv_windows: drop the kernel taps of a Conv that only ever read padding.

A dilated conv on a small map reads its outer taps from the zero border alone: DeepLabV3's
atrous convs (3x3, dilations 12, 24, 36, pads equal to them) on a 16x16 map have taps 24
and 36 pixels out of the centre, past every input pixel for every output pixel. Such a tap
adds zero times its weight; without it the conv computes the same outputs from a smaller
window (a 1x1 conv for dilations 24 and 36 there: a ninth of the work, and no bordered copy
of the input 88 pixels wide). Only whole rows and columns of taps at the window's edges
go, so the window stays a window: its kernel shrinks, and its pads shrink by as much.

Where the taps that read differ from one stretch of outputs to the next (dilation 12 on
the same map: the top tap reads for the bottom 4 rows only, the bottom tap for the top 4),
and keeping them all would do at least twice the work that reads the input, the conv is
split into blocks of outputs with one window each: each block a conv without padding over
the slice of the input its window reads, the blocks concatenated back (DeepLabV3's third
atrous conv: 9 blocks, a quarter of the multiply-adds).
"""
from __future__ import annotations

import itertools
import math

import numpy as np

from ..graph import Graph, Node
from ..ops.conv_gemm import CONV
from ..ops.inference import infer
from ..ops.shape import CONCAT, SLICE
from ..transform import graph_pass

MAX_BLOCKS = 16  # a split into more convs than this is left whole (or trimmed)
SPLIT_GAIN = 2  # split only where the taps kept whole do at least this many times the reading work


def _runs(size: int, out: int, kernel: int, stride: int, dilation: int, pad: int) -> list[tuple]:
    """(first output, end output, first tap, last tap): the stretches of outputs along one
    axis whose windows read the input with the same taps (an interval; None, None where none)."""
    runs = []
    for o in range(out):
        reads = [t for t in range(kernel) if 0 <= o * stride + t * dilation - pad < size]
        taps = (reads[0], reads[-1]) if reads else (None, None)
        if runs and runs[-1][2:] == taps:
            runs[-1] = (runs[-1][0], o + 1) + taps
        else:
            runs.append((o, o + 1) + taps)
    return runs


def _trimmed(g: Graph, node: Node, x, y, kernel, strides, dil, pads, runs) -> Node | None:
    """The conv with the taps no output reads dropped, its pads shrunk to match."""
    n = len(kernel)
    live = [(min(r[2] for r in rs), max(r[3] for r in rs)) for rs in runs]
    if all(lo == 0 and hi == k - 1 for (lo, hi), k in zip(live, kernel)):
        return None
    begin = [pads[a] - live[a][0] * dil[a] for a in range(n)]
    new_kernel = [hi - lo + 1 for lo, hi in live]
    # the end pads that keep each output size: (out - 1) * stride + extent = size + pads
    end = [(y.shape[2 + a] - 1) * strides[a] + (new_kernel[a] - 1) * dil[a] + 1 - x.shape[2 + a] - begin[a]
           for a in range(n)]
    if min(begin + end) < 0:
        return None  # (a window that would need negative pads, a crop: left as it is)
    w = g.constants[node.inputs[1]]
    window = (slice(None), slice(None)) + tuple(slice(lo, hi + 1) for lo, hi in live)
    trimmed = g.add_constant(f"{node.key}/w_trimmed", w[window].copy())
    attrs = {k: v for k, v in node.attrs.items() if k != "auto_pad"}
    attrs.update(kernel_shape=new_kernel, pads=begin + end, strides=list(strides), dilations=list(dil))
    return Node(CONV, [node.inputs[0], trimmed] + node.inputs[2:], node.outputs, attrs, node.name, node.guard)


def _blocks(g: Graph, node: Node, x, kernel, strides, dil, pads, runs) -> list[Node]:
    """The conv as one conv per block of outputs (a run along each axis), each over the
    input its taps read, unpadded; then Concats along each axis, the last axis first."""
    n = len(kernel)
    w = g.constants[node.inputs[1]]
    attrs = {k: v for k, v in node.attrs.items() if k != "auto_pad"}
    nodes, outputs = [], {}
    at = lambda part: f"{node.key}/{part}"  # noqa: E731  (the blocks' own tensors)
    for i, block in enumerate(itertools.product(*runs)):
        starts = [o0 * strides[a] + t0 * dil[a] - pads[a] for a, (o0, _, t0, _) in enumerate(block)]
        ends = [(o1 - 1) * strides[a] + t1 * dil[a] - pads[a] + 1 for a, (_, o1, _, t1) in enumerate(block)]
        src = node.inputs[0]
        if starts != [0] * n or ends != list(x.shape[2:]):
            src = at(f"in{i}")
            consts = [g.add_constant(at(f"{part}{i}"), np.array(v, np.int64))
                      for part, v in (("starts", starts), ("ends", ends), ("axes", list(range(2, 2 + n))))]
            nodes.append(Node(SLICE, [node.inputs[0]] + consts, [src], {}, f"{node.name}/slice{i}", node.guard))
        window = (slice(None), slice(None)) + tuple(slice(t0, t1 + 1) for _, _, t0, t1 in block)
        w_block = g.add_constant(at(f"w{i}"), w[window].copy())
        nodes.append(Node(CONV, [src, w_block] + node.inputs[2:], [at(f"block{i}")],
                          {**attrs, "kernel_shape": [t1 - t0 + 1 for _, _, t0, t1 in block], "pads": [0] * (2 * n),
                           "strides": list(strides), "dilations": list(dil)}, f"{node.name}/block{i}", node.guard))
        outputs[tuple(r[0] for r in block)] = at(f"block{i}")
    for axis in reversed(range(n)):  # (join the blocks along the last axis, then the one before, ...)
        joined = {}
        for key in sorted({k[:axis] for k in outputs}):
            parts = [outputs[k] for k in sorted(outputs) if k[:axis] == key]
            if len(parts) == 1:  # (one run along this axis: nothing to join)
                joined[key] = parts[0]
                continue
            out = at(f"joined{axis}_{len(joined)}")
            nodes.append(Node(CONCAT, parts, [out], {"axis": 2 + axis}, f"{node.name}/concat{axis}_{len(joined)}",
                              node.guard))
            joined[key] = out
        outputs = joined
    # the node that writes the whole output writes the conv's own output name
    last = next(m for m in reversed(nodes) if m.outputs == [outputs[()]])
    last.outputs = list(node.outputs)
    return nodes


@graph_pass(opt_level=1)
def trim_conv_windows(g: Graph, ctx) -> Graph:
    kept = []
    for node in g.nodes:
        if node.op != CONV or node.inputs[1] not in g.constants or not g.types[node.inputs[0]].is_static:
            kept.append(node)
            continue
        (y,), p = infer(g, node)  # (the window's pads made explicit; a conv BatchNorm folded into has none yet)
        x = g.types[node.inputs[0]]
        kernel, strides, dil, pads = p["kernel_shape"], p["strides"], p["dilations"], p["pads"]
        runs = [_runs(x.shape[2 + a], y.shape[2 + a], kernel[a], strides[a], dil[a], pads[a]) for a in range(len(kernel))]
        if any(r[2] is None for rs in runs for r in rs):
            kept.append(node)  # (an output whose window reads padding alone: left as it is)
            continue
        whole = math.prod((max(r[3] for r in rs) - min(r[2] for r in rs) + 1) * (rs[-1][1] - rs[0][0]) for rs in runs)
        reading = math.prod(sum((r[1] - r[0]) * (r[3] - r[2] + 1) for r in rs) for rs in runs)
        if math.prod(len(rs) for rs in runs) <= MAX_BLOCKS and whole >= SPLIT_GAIN * reading:
            kept += _blocks(g, node, x, kernel, strides, dil, pads, runs)
            continue
        kept.append(_trimmed(g, node, x, y, kernel, strides, dil, pads, runs) or node)
    g.nodes = kept
    return g
