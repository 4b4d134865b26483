"""Shape and layout ops: views (Reshape, Flatten, Squeeze, Unsqueeze, Identity), Transpose,
Concat, Split, Slice, Expand, Gather, Pad, Resize.

Views alone in a group are aliases of their input's buffer; inside a group, like the rest,
they lower to readers that map each output index to the input element it comes from.
"""
from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from ..attrs import attr_or_input, check_attrs, const_input, normalize_axis
from ..dtypes import is_float
from ..graph import ShapeError, TensorType, UnsupportedError
from ..loop import Const, add, mul
from ..lower.elementwise import (bcast_reader, concat_by_slabs, concat_reader, gather_reader, pad_reader,
                                 resize_by_phases, resize_reader, split_readers, view_reader)
from ..symbolic import Dim, at_most, floor_div, greatest, is_symbolic, least, product, require_equal
from ..value_symbols import clamp, define, eq, lt, runtime_values, select
from .broadcast import broadcast
from .registry import ELEMWISE, INJECTIVE, OpDef, one_output, register


def view_def(name, infer, kind=INJECTIVE):
    """An op whose output is its input's buffer read with another shape (no kernel of its own)."""
    def reader(b, node):
        return {node.outputs[0]: view_reader(b, node.inputs[0], b.shape(node.outputs[0]), node.outputs[0])}
    return OpDef(name, kind, infer, lambda a, v, g, node: [v[0].reshape(g.types[node.outputs[0]].shape)], reader,
                 view=True)


def _reshape(g, node, p):
    x = g.types[node.inputs[0]]
    fed = runtime_values(g, node, 1)
    if fed is not None:
        return _reshape_to_values(g, node, x, fed)
    target = _sizes(const_input(g, node, 1, "shape", required=True))
    if not x.is_static or any(is_symbolic(d) for d in target):
        return _reshape_symbolic(node, x, target)
    allowzero = node.attrs.get("allowzero", 0)
    out = [x.shape[i] if d == 0 and not allowzero else d for i, d in enumerate(target)]
    if out.count(-1) > 1:
        raise ShapeError(f"{node.describe()}: more than one -1 in shape {target}")
    if -1 in out:
        known = int(np.prod([d for d in out if d != -1]))
        if known == 0 or x.size % known:
            raise ShapeError(f"{node.describe()}: cannot reshape {x} to {target}")
        out[out.index(-1)] = x.size // known
    if int(np.prod(out)) != x.size:
        raise ShapeError(f"{node.describe()}: cannot reshape {x} to {target}")
    return TensorType(tuple(out), x.dtype)


def _sizes(value) -> list:
    """A shape parameter's entries: ints, and Dims where it is a symbolic value."""
    return [v if is_symbolic(v) else int(v) for v in np.asarray(value).reshape(-1)]


def _reshape_symbolic(node, x: TensorType, target: list) -> TensorType:
    """Reshape where sizes are symbolic: 0 copies the input's dim, -1 is what the others leave
    (an exact division of the polynomials), and the sizes must multiply to the same polynomial."""
    copies = not node.attrs.get("allowzero", 0)  # (with allowzero a 0 is a size of 0, as in a static shape)
    out = [x.shape[i] if copies and isinstance(d, int) and d == 0 else d for i, d in enumerate(target)]
    if sum(1 for d in out if isinstance(d, int) and d == -1) > 1:
        raise ShapeError(f"{node.describe()}: more than one -1 in shape {target}")
    known = product([d for d in out if not (isinstance(d, int) and d == -1)])
    if any(isinstance(d, int) and d == -1 for d in out):
        if isinstance(known, int) and known == 0:
            raise ShapeError(f"{node.describe()}: a -1 beside a size of 0 in shape {target}")
        out = [x.size // known if isinstance(d, int) and d == -1 else d for d in out]  # (SymbolError if inexact)
    size = product(out)
    if size != x.size and not isinstance(size, Dim) and not isinstance(x.size, Dim):
        raise ShapeError(f"{node.describe()}: cannot reshape {x} to [{', '.join(map(str, target))}]")
    if size != x.size:
        # Sizes that agree at some values of the symbols only (a Swin traced at a size its
        # windows divide, whose crop back from the padding is missing): checked before the
        # module runs, as onnxruntime fails at the other sizes.
        require_equal(x.size, size, f"{node.describe()}: the elements of {x} and of shape "
                                    f"[{', '.join(map(str, target))}]")
    return TensorType(tuple(out), x.dtype)


def _reshape_to_values(g, node, x: TensorType, fed: list) -> TensorType:
    """Reshape to a shape fed at run time: each output dim a value symbol (0 copies the
    input's dim unless allowzero, -1 is what the others leave), at most the input's elements;
    the module checks that they multiply to the input's elements before it runs."""
    total, shape_input = x.size, node.inputs[1]
    known = [v if node.attrs.get("allowzero", 0) else select(eq(v, 0), x.shape[j] if j < len(x.shape) else 0, v)
             for j, v in enumerate(fed)]
    out = []
    for j, v in enumerate(fed):
        others = 1
        for i, k in enumerate(known):
            if i != j:
                others = ("mul", others, select(eq(fed[i], -1), 1, k))
        out.append(define(f"{node.outputs[0]}[{j}]", select(eq(v, -1), ("div", total, others), known[j]), 0,
                          greatest(total), f"dim {j} of {node.describe()}'s output, read from input '{shape_input}'"))
    require_equal(product(out), total, f"{node.describe()}: the sizes in '{shape_input}' multiply to the input's "
                                       "elements")
    return TensorType(tuple(out), x.dtype)


def _flatten(g, node, p):
    x = g.types[node.inputs[0]]
    axis = node.attrs.get("axis", 1)
    axis = axis + len(x.shape) if axis < 0 else axis
    if not x.is_static:
        return TensorType((product(x.shape[:axis]), product(x.shape[axis:])), x.dtype)
    return TensorType((int(np.prod(x.shape[:axis])), int(np.prod(x.shape[axis:]))), x.dtype)


def _squeeze(g, node, p):
    x = g.types[node.inputs[0]]
    axes = attr_or_input(g, node, "axes", 1)
    rank = len(x.shape)
    if axes is None:
        axes = [i for i, d in enumerate(x.shape) if d == 1]
    axes = {normalize_axis(a, rank, node) for a in axes}
    for a in axes:
        if x.shape[a] != 1:
            raise ShapeError(f"{node.describe()}: cannot squeeze axis {a} of size {x.shape[a]}")
    return TensorType(tuple(d for i, d in enumerate(x.shape) if i not in axes), x.dtype)


def _unsqueeze(g, node, p):
    x = g.types[node.inputs[0]]
    axes = attr_or_input(g, node, "axes", 1)
    rank = len(x.shape) + len(axes)
    axes = sorted(normalize_axis(a, rank, node) for a in axes)
    out = list(x.shape)
    for a in axes:
        out.insert(a, 1)
    return TensorType(tuple(out), x.dtype)


IDENTITY, RESHAPE, CONCAT, TRANSPOSE, SLICE = "Identity", "Reshape", "Concat", "Transpose", "Slice"
UNSQUEEZE, GATHER, FLATTEN, SQUEEZE = "Unsqueeze", "Gather", "Flatten", "Squeeze"
SPLIT, PAD, EXPAND, RESIZE = "Split", "Pad", "Expand", "Resize"
register(view_def(RESHAPE, _reshape), view_def(FLATTEN, _flatten), view_def(SQUEEZE, _squeeze),
         view_def(UNSQUEEZE, _unsqueeze), view_def(IDENTITY, lambda g, node, p: g.types[node.inputs[0]], ELEMWISE))


# ---- data movement -----------------------------------------------------------------------

def _transpose(g, node, p):
    x = g.types[node.inputs[0]]
    perm = node.attrs.get("perm", list(range(len(x.shape)))[::-1])
    p["perm"] = list(perm)
    return TensorType(tuple(x.shape[i] for i in perm), x.dtype)


def lane_transpose(shape: tuple, perm: list) -> tuple[int, int, int] | None:
    """(B, R, C) where transposing `shape` by `perm` is a batch of B [R, C] -> [C, R]
    transposes (axes of size 1 dropped, runs of axes that stay together merged), else None."""
    kept = [a for a in range(len(shape)) if shape[a] != 1]
    position = {a: i for i, a in enumerate(kept)}  # (numbered without the size-1 axes)
    runs = []  # runs of input axes, in output order
    for a in (position[a] for a in perm if shape[a] != 1):
        if runs and runs[-1][-1] + 1 == a:
            runs[-1].append(a)
        else:
            runs.append([a])
    by_input = sorted(runs, key=lambda run: run[0])
    sizes = [math.prod(shape[kept[a]] for a in run) for run in by_input]
    moved = [by_input.index(run) for run in runs]
    if not kept or moved not in ([1, 0], [0, 2, 1]):
        return None
    return (1, *sizes) if len(sizes) == 2 else tuple(sizes)


def _transpose_reader(b, node):
    x, perm = b.reader(node.inputs[0]), b.attrs(node)["perm"]

    def transpose(idx):
        src = [None] * len(perm)
        for i, p in enumerate(perm):
            src[p] = idx[i]
        return x(src)
    return {node.outputs[0]: transpose}


def _concat(g, node, p):
    types = [g.types[i] for i in node.inputs if i]
    rank = len(types[0].shape)
    axis = normalize_axis(node.attrs["axis"], rank, node)
    p["axis"] = axis
    for t in types:
        if len(t.shape) != rank or any(t.shape[i] != types[0].shape[i] and not is_symbolic(t.shape[i])
                                       and not is_symbolic(types[0].shape[i]) for i in range(rank) if i != axis):
            raise ShapeError(f"{node.describe()}: inputs {', '.join(map(str, types))} do not concatenate on axis {axis}")
        for i in range(rank):  # (sizes known at run time only: the module checks they agree)
            if i != axis:
                require_equal(types[0].shape[i], t.shape[i], f"{node.describe()}: dim {i} of its inputs")
    out = list(types[0].shape)
    out[axis] = sum(t.shape[axis] for t in types)
    return TensorType(tuple(out), types[0].dtype)


def _split(g, node, p):
    x = g.types[node.inputs[0]]
    axis = normalize_axis(node.attrs.get("axis", 0), len(x.shape), node)
    sizes = attr_or_input(g, node, "split", 1)
    n = len(node.outputs)
    if sizes is None:
        n = node.attrs.get("num_outputs", n)
        chunk = -(-x.shape[axis] // n)
        sizes = [min(chunk, x.shape[axis] - i * chunk) for i in range(n)]
    if sum(sizes) != x.shape[axis] or len(sizes) != len(node.outputs):
        raise ShapeError(f"{node.describe()}: split sizes {sizes} do not fit axis {axis} of {x}")
    p["axis"], p["sizes"] = axis, [int(s) for s in sizes]
    outs = []
    for s in sizes:
        shape = list(x.shape)
        shape[axis] = int(s)
        outs.append(TensorType(tuple(shape), x.dtype))
    return outs


def _slice(g, node, p):
    x = g.types[node.inputs[0]]
    rank = len(x.shape)
    fed_starts, fed_ends = runtime_values(g, node, 1), runtime_values(g, node, 2)
    starts = fed_starts or attr_or_input(g, node, "starts", 1)
    ends = fed_ends or attr_or_input(g, node, "ends", 2)
    if len(starts) != len(ends):
        raise ShapeError(f"{node.describe()}: {len(starts)} starts and {len(ends)} ends")
    axes = attr_or_input(g, node, "axes", 3, list(range(len(starts))))
    steps = attr_or_input(g, node, "steps", 4, [1] * len(starts))
    begin, step, shape = [0] * rank, [1] * rank, list(x.shape)
    for s, e, a, st in zip(starts, ends, axes, steps):
        a = normalize_axis(a, rank, node)
        if st == 0:
            raise ShapeError(f"{node.describe()}: step 0 on axis {a}")
        if fed_starts or fed_ends:
            begin[a], step[a], shape[a] = _range_of_values(node, a, x.shape[a], s, e, int(st))
            continue
        if is_symbolic(s) or is_symbolic(e) or is_symbolic(x.shape[a]):
            try:
                begin[a], step[a], shape[a] = _symbolic_range(x.shape[a], s, e, st)
            except (ShapeError, TypeError):  # (bounds that may pass the dim: clamped at run time, as numpy does)
                begin[a], step[a], shape[a] = _range_of_values(node, a, x.shape[a], s, e, int(st))
            continue
        r = range(x.shape[a])[slice(int(s), int(e), int(st))]
        begin[a], step[a], shape[a] = r.start, r.step, len(r)
    p["begin"], p["step"] = begin, step
    return TensorType(tuple(shape), x.dtype)


def _symbolic_range(size, start, end, step) -> tuple:
    """(begin, step, length) of start:end:step over a dim where some are symbolic: a positive
    step, starts and ends within the dim by the symbols' bounds (what exporters write:
    buffer[:, :seq], x[:, :n], x[:, n:], a Swin's x[:, 0::2]); otherwise a TypeError (not
    supported yet)."""
    if step < 1:
        raise TypeError(f"a slice with step {step} over symbolic sizes")

    def clamp(v):
        if isinstance(v, int) and v < 0:
            v = size + v
        if isinstance(v, int) and is_symbolic(size) and v >= size.greatest():
            return size  # (an end past the greatest size: the whole dim)
        if isinstance(v, int) and not is_symbolic(size):
            return min(max(v, 0), size)
        if least(v) >= 0 and greatest(v) <= least(size) or v == size:
            return v
        if is_symbolic(v) and isinstance(v - size, int) and v - size <= 0 and least(v) >= 0:
            return v  # (size - 1, an end counted from the back)
        if is_symbolic(v) and least(v) >= 0 and at_most(v, size):
            return v
        raise ShapeError(f"the bounds let slice bound {v} reach {least(v)}..{greatest(v)}, outside the dim of size "
                         f"{size}: narrow the --dim bounds so it cannot")
    begin, stop = clamp(start), clamp(end)
    span = stop - begin
    if least(span) < 0 and not at_most(0, span):
        raise TypeError(f"a slice {start}:{end} of {size} may end before it starts at some sizes")
    return begin, step, floor_div(span + step - 1, step)  # (ceil(span / step) elements)


def _range_of_values(node, axis: int, size, start, end, step: int) -> tuple:
    """(begin, step, length) of start:end:step over a dim where start or end is fed at run
    time, or may pass the dim's end at some sizes (x[:5] of a run-time length): value symbols
    for the first index read and the length, clamped as numpy slices."""
    lo, hi = (0, size) if step > 0 else (-1, size - 1)
    first, stop = (clamp(select(lt(v, 0), ("add", v, size), v), lo, hi) for v in (start, end))
    span = ("max", ("sub", stop, first) if step > 0 else ("sub", first, stop), 0)
    what = f"{node.describe()}'s slice of axis {axis} (starts '{node.inputs[1]}', ends '{node.inputs[2]}')"
    out, most = node.outputs[0], greatest(size)
    if step > 0 and all(isinstance(v, (int, Dim)) and least(v) >= 0 for v in (start, end)):
        # (x[:5] is at most 5 long, x[:h] at most h's greatest: Mask R-CNN cuts each pasted
        # mask to the image's height from a concatenation only its data bound)
        most = min(most, max(0, -(-(greatest(end) - least(start)) // step)))
    begin = define(f"{out}.begin[{axis}]", ("max", first, 0), 0, greatest(size), f"the first index of {what}")
    length = define(f"{out}[{axis}]", ("div", ("add", span, abs(step) - 1), abs(step)), 0, most,
                    f"the length of {what}")
    return begin, step, length


def _slice_reader(b, node):
    x, a = b.reader(node.inputs[0]), b.attrs(node)
    return {node.outputs[0]: lambda idx: x([add(b.dim(bg), mul(st, i))
                                            for i, bg, st in zip(idx, a["begin"], a["step"])])}


def _slice_fold(a, values, g, node):
    x = values[0]
    for axis, (b, s, n) in enumerate(zip(a["begin"], a["step"], g.types[node.outputs[0]].shape)):
        x = np.take(x, b + s * np.arange(n), axis=axis)
    return [x]


def _expand(g, node, p):
    x = g.types[node.inputs[0]]
    shape = _sizes(const_input(g, node, 1, "shape", required=True, at_run_time=True))
    offset = len(shape) - len(x.shape)
    for j, v in enumerate(shape):
        d = x.shape[j - offset] if j >= offset else 1
        if is_symbolic(v) and isinstance(d, int) and d != 1:
            # (a size read at run time may be 1, which keeps the input's dim: else it must equal it)
            agrees = define(f"{node.outputs[0]}.expand[{j}]", select(eq(v, 1), d, v), min(least(v), d),
                            max(greatest(v), d), f"size {j} of the shape {node.describe()} expands to")
            require_equal(agrees, d, f"{node.describe()}: size {j} of '{node.inputs[1]}' (1 or the input's {d})")
            shape[j] = d
    return TensorType(broadcast([x.shape, tuple(shape)], node), x.dtype)


def _gather(g, node, p):
    x, idx = g.types[node.inputs[0]], g.types[node.inputs[1]]
    axis = normalize_axis(node.attrs.get("axis", 0), len(x.shape), node)
    p["axis"] = axis
    return TensorType(x.shape[:axis] + idx.shape + x.shape[axis + 1:], x.dtype)


def _gather_fold(a, values, g, node):
    idx, dim = values[1], values[0].shape[a["axis"]]
    return [np.take(values[0], np.where(idx < 0, idx + dim, idx), axis=a["axis"])]


def _pad(g, node, p):
    x = g.types[node.inputs[0]]
    rank = len(x.shape)
    check_attrs(node, {"mode": ("constant", "reflect", "edge", "wrap")})
    pads = attr_or_input(g, node, "pads", 1, at_run_time=True)
    axes = attr_or_input(g, node, "axes", 3, list(range(rank)))
    axes = [normalize_axis(a, rank, node) for a in axes]
    if len(pads) != 2 * len(axes):
        raise ShapeError(f"{node.describe()}: {len(pads)} pads for {len(axes)} axes of {x} (two an axis)")
    full = [0] * (2 * rank)
    for i, a in enumerate(axes):
        full[a], full[a + rank] = pads[i], pads[i + len(axes)]  # (ints, or Dims: pads read at run time)
    p["pads"], p["mode"] = full, node.attrs.get("mode", "constant")
    if len(node.inputs) > 2 and node.inputs[2] and node.inputs[2] not in g.constants:
        p["value"] = None  # computed at run time: the kernel reads it
    else:
        value = const_input(g, node, 2, "constant_value")
        p["value"] = float(value.reshape(-1)[0]) if value is not None and value.size else \
            float(node.attrs.get("value", 0.0))
    if p["mode"] == "wrap":
        _check_wrap(node, x.shape, full)
    shape = tuple(x.shape[i] + full[i] + full[i + rank] for i in range(rank))
    if any(is_symbolic(d) and least(d) < 0 and not at_most(0, d) for d in shape):
        raise TypeError(f"a Pad whose output may have a negative size ({', '.join(map(str, shape))})")
    if not any(is_symbolic(v) for v in full + list(x.shape)) and min(shape) < 0:
        raise ShapeError(f"{node.describe()}: pads {full} make a negative dimension of {x}")
    return TensorType(shape, x.dtype)


def _check_wrap(node, shape, pads) -> None:
    """Wrap crops first (negative pads, as onnxruntime does) and wraps around what is left:
    that must be known to be nonempty, and a pad read at run time must not crop."""
    rank = len(shape)
    for a, n in enumerate(shape):
        before, after = pads[a], pads[a + rank]
        if (is_symbolic(before) and least(before) < 0) or (is_symbolic(after) and least(after) < 0):
            raise UnsupportedError(f"{node.describe()}: wrap mode with pads read at run time that may be negative "
                                   "(bound them from 0)")
        crops = max(0 if is_symbolic(before) else -before, 0) + max(0 if is_symbolic(after) else -after, 0)
        grows = any(is_symbolic(p) or p > 0 for p in (before, after))
        if grows and (least(n) if is_symbolic(n) else n) - crops < 1:
            raise ShapeError(f"{node.describe()}: wrap mode with pads {pads} crops axis {a} of {list(shape)} "
                             "to nothing: there is nothing to wrap around")


def _scaled_size(n, scale: float):
    """floor(n * scale) for a run-time size n: exact where the scale is a fraction whose
    denominator is a power of two (2, 0.5, 1.5, 0.25: a float32 scale times any size is
    then what the fraction gives), else refused (1/3 in float32 times n is not n // 3)."""
    ratio = Fraction(scale)
    if ratio.denominator & (ratio.denominator - 1) or ratio.denominator > 1 << 16 or ratio <= 0:
        raise TypeError(f"a Resize by {scale} of a run-time size (whole scales, or fractions of a power of two)")
    return floor_div(n * ratio.numerator, ratio.denominator)


def _resize(g, node, p):
    x = g.types[node.inputs[0]]
    rank = len(x.shape)
    check_attrs(node, {
        "mode": ("nearest", "linear", "cubic"),
        "coordinate_transformation_mode": ("half_pixel", "asymmetric", "align_corners", "pytorch_half_pixel",
                                           "tf_half_pixel_for_nearest", "tf_crop_and_resize", "half_pixel_symmetric"),
        "nearest_mode": ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil"),
        "antialias": (0, 1),
        "keep_aspect_ratio_policy": ("stretch", "not_larger", "not_smaller"),
    })
    axes = [normalize_axis(a, rank, node) for a in node.attrs.get("axes", range(rank))]
    scales = const_input(g, node, 2, "scales")
    sizes = const_input(g, node, 3, "sizes")
    out_scale = [1.0] * rank
    shape = list(x.shape)
    policy = node.attrs.get("keep_aspect_ratio_policy", "stretch")
    if sizes is not None and sizes.size and any(is_symbolic(x.shape[a]) or is_symbolic(s)
                                                for a, s in zip(axes, sizes.reshape(-1))):
        if policy != "stretch":
            raise TypeError(f"a Resize to sizes known at run time keeping the aspect ratio ({policy})")
        for a, s in zip(axes, sizes.reshape(-1)):  # (each scale is the ratio of the sizes, at run time)
            shape[a] = s if is_symbolic(s) else int(s)
            out_scale[a] = None if is_symbolic(shape[a]) or is_symbolic(x.shape[a]) else shape[a] / x.shape[a]
    elif sizes is not None and sizes.size and policy != "stretch":
        # One scale for every resized axis, the smallest or largest sizes asks for.
        ratios = [int(s) / x.shape[a] for a, s in zip(axes, sizes.reshape(-1))]
        scale = min(ratios) if policy == "not_larger" else max(ratios)
        for a in axes:
            shape[a], out_scale[a] = int(scale * x.shape[a] + 0.5), scale
    elif sizes is not None and sizes.size:
        for a, s in zip(axes, sizes.reshape(-1)):
            shape[a] = int(s)
            out_scale[a] = int(s) / x.shape[a]
    elif scales is not None and scales.size:
        for a, s in zip(axes, scales.reshape(-1)):
            if is_symbolic(x.shape[a]) and float(s) != 1:
                shape[a] = _scaled_size(x.shape[a], float(s))
            else:
                shape[a] = x.shape[a] if float(s) == 1 else int(math.floor(x.shape[a] * float(s)))
            out_scale[a] = float(s)
    else:
        raise UnsupportedError(f"{node.describe()}: Resize needs constant scales or sizes")
    p["scales"] = out_scale
    if node.attrs.get("mode", "nearest") != "nearest" and not is_float(x.dtype):
        raise UnsupportedError(f"{node.describe()}: {node.attrs['mode']} Resize of {x.dtype} (nearest only)")
    if node.attrs.get("coordinate_transformation_mode") == "tf_crop_and_resize":
        roi = const_input(g, node, 1, "roi", required=True).astype(np.float64).reshape(-1)
        full = [0.0] * rank + [1.0] * rank
        for i, a in enumerate(axes):
            full[a], full[a + rank] = float(roi[i]), float(roi[i + len(axes)])
        p["roi"] = full
    return TensorType(tuple(shape), x.dtype)


register(
    OpDef(TRANSPOSE, INJECTIVE, _transpose, lambda a, v, g, node: [np.transpose(v[0], a["perm"])], _transpose_reader),
    OpDef(CONCAT, INJECTIVE, _concat,
          lambda a, v, g, node: [np.concatenate([x for x in v if x is not None], axis=a["axis"])],
          one_output(concat_reader), alone=concat_by_slabs),
    OpDef(SPLIT, INJECTIVE, _split,
          lambda a, v, g, node: list(np.split(v[0], np.cumsum(a["sizes"])[:-1], axis=a["axis"])), split_readers),
    OpDef(SLICE, INJECTIVE, _slice, _slice_fold, _slice_reader),
    OpDef(EXPAND, INJECTIVE, _expand,
          lambda a, v, g, node: [np.broadcast_to(v[0].reshape(g.types[node.inputs[0]].shape),
                                                 g.types[node.outputs[0]].shape)],
          lambda b, node: {node.outputs[0]: bcast_reader(b, node.inputs[0], b.shape(node.outputs[0]))}),
    OpDef(GATHER, INJECTIVE, _gather, _gather_fold, one_output(gather_reader)),
    OpDef(PAD, INJECTIVE, _pad, None, one_output(pad_reader)),
    OpDef(RESIZE, INJECTIVE, _resize, None, one_output(resize_reader), alone=resize_by_phases),
)


def _dropout(g, node, p):
    training = const_input(g, node, 2, "training_mode")
    if node.attrs.get("is_test", 1) == 0 or (training is not None and bool(training.reshape(-1)[0])):
        raise UnsupportedError(f"{node.describe()}: training mode is not supported (inference only)")
    x = g.types[node.inputs[0]]
    return [x, TensorType(x.shape, "bool")][:len(node.outputs)]


def _dropout_readers(b, node):
    """Inference: the data passes through, and the mask keeps everything."""
    x = b.reader(node.inputs[0])
    out = {node.outputs[0]: x}
    if len(node.outputs) > 1 and node.outputs[1]:
        out[node.outputs[1]] = lambda idx: Const(1, "i1")
    return out


register(OpDef("Dropout", INJECTIVE, _dropout,
               lambda a, v, g, node: [v[0], np.ones(v[0].shape, bool)][:len(node.outputs)], _dropout_readers))
