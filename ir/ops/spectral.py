"""Spectral ops: DFT, STFT and MelWeightMatrix, as an audio model's front end computes them in
its graph (a log-mel spectrogram: STFT, its magnitude, a MatMul by the mel filters).

A DFT of length n along an axis is two products by constant n x n matrices of cosines and
sines (real and imaginary parts, each a MatMul over the signal's rows: one packed GEMM per
part, no FFT), built from ONNX's own ops; n is what an audio front end uses (400 for
Whisper's 25 ms frames), where the GEMM's O(n^2) costs less than an FFT's passes. STFT cuts
its frames with one Gather of a constant index table and weights them by the window. The mel
filters are a constant: MelWeightMatrix of constants folds at build time, as onnx's reference
computes it.
"""
from __future__ import annotations

import numpy as np

from ..attrs import const_input, normalize_axis
from ..dtypes import numpy_dtype
from ..graph import ShapeError, TensorType, UnsupportedError
from ..onnx_dtypes import onnx_to_dtype
from ..symbolic import is_symbolic
from .conv_gemm import MATMUL
from .elementwise import ADD, MUL, SUB
from .node_builder import NodeBuilder
from .registry import OPAQUE, OpDef, expanded_only, register
from .shape import CONCAT, GATHER, TRANSPOSE, UNSQUEEZE

DFT, STFT, MEL_WEIGHT_MATRIX = "DFT", "STFT", "MelWeightMatrix"


def _scalar(g, node, index: int, what: str, default=None):
    value = const_input(g, node, index, what)
    if value is None:
        return default
    value = value.reshape(-1)[0]
    if is_symbolic(value):
        raise UnsupportedError(f"{node.describe()}: its {what} is a size known at run time only (give the input "
                               "shapes with `shapes`)")
    return value


def _matrices(rows: int, n: int, bins: int, inverse: bool, onesided: bool, dtype) -> dict:
    """The DFT's constant factors over `rows` input rows (those past n, or past the input,
    contribute nothing): {name: [rows, bins] matrix}, in float64 then the signal's type.
    Forward: re = x_re C + x_im S, im = x_im C - x_re S. Inverse: re = (x_re C - x_im S)/n,
    im = (x_re S + x_im C)/n; an inverse of one-sided bins (irfft) is real, each bin but the
    first (and the middle of an even n) counted twice, as its conjugate's image."""
    t, k = np.arange(rows)[:, None], np.arange(bins)[None, :]
    angle = 2 * np.pi * ((t * k) % n) / n  # ((t k) mod n: exact angles for long signals)
    cos, sin = np.cos(angle), np.sin(angle)
    if inverse and onesided:  # (rows are bins here, columns time)
        weight = np.where((t == 0) | ((n % 2 == 0) & (t == n // 2)), 1.0, 2.0) / n
        return {"cos": (cos * weight).astype(dtype), "sin": (sin * weight).astype(dtype)}
    scale = 1.0 / n if inverse else 1.0
    return {"cos": (cos * scale).astype(dtype), "sin": (sin * scale).astype(dtype)}


def _axis(g, node, rank: int) -> int:
    """DFT's axis: an input from opset 20 (default -2), an attribute before (default 1)."""
    if len(node.inputs) > 2 and node.inputs[2]:
        return normalize_axis(int(_scalar(g, node, 2, "axis")), rank, node)
    if "axis" in node.attrs or g.opset < 20:
        return normalize_axis(node.attrs.get("axis", 1), rank, node)
    return normalize_axis(-2, rank, node)


def _expand_dft(g, node):
    x = g.types[node.inputs[0]]
    rank = len(x.shape)
    if rank < 2 or x.shape[-1] not in (1, 2):
        raise ShapeError(f"{node.describe()}: a signal {x} must end in a dim of 1 (real) or 2 (complex)")
    axis = _axis(g, node, rank)
    if axis == rank - 1:
        raise ShapeError(f"{node.describe()}: the DFT's axis cannot be the last (it holds the real and imaginary "
                         "parts)")
    length = x.shape[axis]
    if is_symbolic(length):
        raise UnsupportedError(f"{node.describe()}: a DFT over a length known at run time only ({x}); give the "
                               "input shapes with `shapes`")
    inverse, onesided = bool(node.attrs.get("inverse", 0)), bool(node.attrs.get("onesided", 0))
    n = _scalar(g, node, 1, "dft_length")
    n = int(n) if n is not None else 2 * (length - 1) if inverse and onesided else length
    if n < 1:
        raise ShapeError(f"{node.describe()}: dft_length {n} must be positive")
    if inverse and onesided:
        rows, out = min(length, n // 2 + 1), n
    else:
        rows, out = min(length, n), (n // 2 + 1 if onesided else n)
    nb = NodeBuilder(g, node)
    # The axis moved next to the last (the parts), the parts apart: two [..., rows] signals.
    order = [a for a in range(rank - 1) if a != axis] + [axis, rank - 1]
    moved = nb.add(TRANSPOSE, [node.inputs[0]], perm=order) if order != list(range(rank)) else node.inputs[0]
    if rows < length:
        moved = nb.add(GATHER, [moved, nb.const(np.arange(rows, dtype=np.int64))], axis=rank - 2)
    parts = [nb.add(GATHER, [moved, nb.const(np.array(p, np.int64))], axis=rank - 1) for p in range(x.shape[-1])]
    dtype = numpy_dtype(x.dtype)
    factor = {name: nb.const(m) for name, m in _matrices(rows, n, out, inverse, onesided, dtype).items()}

    def times(part: int, name: str) -> str:
        return nb.add(MATMUL, [parts[part], factor[name]])
    complex_in = len(parts) == 2
    if inverse and onesided:  # (a real signal: re = X_re A - X_im B)
        real = times(0, "cos")
        pieces = [nb.add(SUB, [real, times(1, "sin")]) if complex_in else real]
    elif inverse:
        re = nb.add(SUB, [times(0, "cos"), times(1, "sin")]) if complex_in else times(0, "cos")
        im = nb.add(ADD, [times(0, "sin"), times(1, "cos")]) if complex_in else times(0, "sin")
        pieces = [re, im]
    else:
        re = nb.add(ADD, [times(0, "cos"), times(1, "sin")]) if complex_in else times(0, "cos")
        minus_sin = nb.add(MUL, [times(0, "sin"), nb.const(np.array(-1, dtype))])
        im = nb.add(ADD, [times(1, "cos"), minus_sin]) if complex_in else minus_sin
        pieces = [re, im]
    back = [int(a) for a in np.argsort(order)]
    moves_back = back != list(range(rank))
    stacked = nb.add(CONCAT, [nb.add(UNSQUEEZE, [p, nb.const(np.array([-1], np.int64))]) for p in pieces],
                     "" if moves_back else node.outputs[0], axis=-1)
    if moves_back:
        nb.add(TRANSPOSE, [stacked], node.outputs[0], perm=back)
    return nb.nodes


def _expand_stft(g, node):
    """STFT(signal [batch, length, 1|2], frame_step, window, frame_length): frames cut by one
    Gather of a [frames, frame_length] index table, weighted by the window, then a DFT along
    them: [batch, frames, bins, 2]."""
    x = g.types[node.inputs[0]]
    if len(x.shape) != 3 or x.shape[-1] not in (1, 2):
        raise ShapeError(f"{node.describe()}: a signal {x} must be [batch, length, 1 or 2]")
    if is_symbolic(x.shape[1]):
        raise UnsupportedError(f"{node.describe()}: an STFT of a signal whose length is known at run time only "
                               f"({x}); give the input shapes with `shapes`")
    step = int(_scalar(g, node, 1, "frame_step"))
    window = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2] else ""
    size = _scalar(g, node, 3, "frame_length")
    size = int(size) if size is not None else g.types[window].shape[0] if window else x.shape[1]
    if step < 1 or not 1 <= size <= x.shape[1]:
        raise ShapeError(f"{node.describe()}: frames of {size} every {step} do not fit a signal of {x.shape[1]}")
    frames = 1 + (x.shape[1] - size) // step
    nb = NodeBuilder(g, node)
    table = np.arange(frames, dtype=np.int64)[:, None] * step + np.arange(size, dtype=np.int64)[None, :]
    cut = nb.add(GATHER, [node.inputs[0], nb.const(table)], axis=1)  # ([batch, frames, size, parts])
    if window:
        cut = nb.add(MUL, [cut, nb.add(UNSQUEEZE, [window, nb.const(np.array([-1], np.int64))])])
    nb.add(DFT, [cut, nb.const(np.array(size, np.int64)), nb.const(np.array(2, np.int64))], node.outputs[0],
           onesided=int(node.attrs.get("onesided", 1)))
    return nb.nodes


def _mel_weight_matrix(g, node, p):
    values = [const_input(g, node, i, name, required=True) for i, name in
              enumerate(("num_mel_bins", "dft_length", "sample_rate", "lower_edge_hertz", "upper_edge_hertz"))]
    bins, length = int(values[0].reshape(-1)[0]), int(values[1].reshape(-1)[0])
    dtype = onnx_to_dtype(node.attrs.get("output_datatype", 1), node)
    return TensorType((length // 2 + 1, bins), dtype)


def _mel_weight_matrix_value(a, values, g, node):
    """Triangular filters between mel-spaced edges, as onnx's reference builds them."""
    bins, length, rate, low, high = (v.reshape(-1)[0] for v in values)
    bins, length = int(bins), int(length)
    edges = np.arange(bins + 2)
    low_mel, high_mel = 2595 * np.log1p(low / 700) / np.log(10), 2595 * np.log1p(high / 700) / np.log(10)
    edges = edges * ((high_mel - low_mel) / (bins + 2)) + low_mel
    edges = ((length + 1) * (700 * np.expm1(edges / 2595 * np.log(10)))) // rate
    edges = edges.astype(int)
    out = np.zeros((length // 2 + 1, bins))
    for i in range(bins):
        left, centre, right = edges[i], edges[i + 1], edges[i + 2]
        if centre == left:
            out[centre, i] = 1
        else:
            out[left:centre + 1, i] = (np.arange(left, centre + 1) - left) / (centre - left)
        if right > centre:
            out[centre:right, i] = (right - np.arange(centre, right)) / (right - centre)
    return [out.astype(numpy_dtype(onnx_to_dtype(a.get("output_datatype", 1), node)))]


register(
    OpDef(DFT, OPAQUE, expanded_only, expand=_expand_dft),
    OpDef(STFT, OPAQUE, expanded_only, expand=_expand_stft),
    OpDef(MEL_WEIGHT_MATRIX, OPAQUE, _mel_weight_matrix, _mel_weight_matrix_value, compile_time=True),
)
