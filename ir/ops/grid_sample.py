"""GridSample: each output point reads the input where a grid of normalized coordinates says
(spatial transformers, optical flow, deformable attention), by its nearest pixel or by
linear or cubic weights of its neighbours. A reader: it fuses with what feeds the grid and
what follows; the input's pixels are gathered at indices computed per point.

Coordinates as ONNX defines them (and onnxruntime computes them): denormalized from [-1, 1]
(align_corners: -1 and 1 are the corner pixels' centres, else their outer edges); rounded
half to even first for nearest; then, outside the borders, clamped into the image (border)
or reflected back into it (reflection). Each tap's index is then read as the padding mode
says: 0 outside (zeros), the edge pixel (border), or reflected again (reflection). Cubic with
border padding clamps its taps only, as onnxruntime (and PyTorch) do: onnx's reference
evaluator clamps the coordinate first, which differs within half a pixel of the edges.
"""
from __future__ import annotations

from ..attrs import check_attrs
from ..dtypes import is_float
from ..graph import ShapeError, TensorType, UnsupportedError
from ..symbolic import is_symbolic
from ..loop import Cast, Const, add, call, cmp, const, fbin, fold_balanced, select
from ..lower.elementwise import and_, iclamp
from .registry import INJECTIVE, OpDef, one_output, register

# Opset 16 named the modes bilinear and bicubic; opset 20 linear and cubic.
_MODES = {"linear": "linear", "bilinear": "linear", "nearest": "nearest", "cubic": "cubic", "bicubic": "cubic"}
CUBIC_ALPHA = -0.75  # Keys' cubic convolution, as ONNX's GridSample and Resize use it


def _grid_sample(g, node, p):
    x, grid = g.types[node.inputs[0]], g.types[node.inputs[1]]
    check_attrs(node, {"mode": tuple(_MODES), "padding_mode": ("zeros", "border", "reflection"),
                       "align_corners": (0, 1)})
    spatial = len(x.shape) - 2
    if spatial < 1 or not is_float(x.dtype) or not is_float(grid.dtype):
        raise UnsupportedError(f"{node.describe()}: GridSample of {x} by a grid of {grid} (floats)")
    if any(is_symbolic(d) for d in x.shape[2:]):
        raise UnsupportedError(f"{node.describe()}: GridSample of {x}, whose spatial sizes are known at run time "
                               "only (give them with `shapes`)")
    if len(grid.shape) != spatial + 2 or grid.shape[-1] != spatial or grid.shape[0] != x.shape[0]:
        raise ShapeError(f"{node.describe()}: a grid of {grid} for an input of {x} (it must be "
                         f"[{x.shape[0]}, <output sizes>, {spatial}])")
    p["mode"] = _MODES[node.attrs.get("mode", "linear")]
    return TensorType(tuple(x.shape[:2]) + tuple(grid.shape[1:-1]), x.dtype)


def _reflect(v, lo: float, hi: float, t: str):
    """v reflected by the nearer border until it lies in [lo, hi] (a float expression)."""
    span = hi - lo
    if span <= 0:
        return const(lo, t)

    def folded(distance, near, far):
        turns = call("floor", fbin("div", distance, const(span, t)))
        r = fbin("sub", distance, fbin("mul", turns, const(span, t)))
        even = cmp("eq", fbin("sub", turns, fbin("mul", call("floor", fbin("mul", turns, const(0.5, t))),
                                                  const(2.0, t))), const(0.0, t))
        return select(even, fbin(near[0], const(near[1], t), r), fbin(far[0], const(far[1], t), r))
    below = folded(fbin("sub", const(lo, t), v), ("add", lo), ("sub", hi))
    above = folded(fbin("sub", v, const(hi, t)), ("sub", hi), ("add", lo))
    return select(cmp("lt", v, const(lo, t)), below, select(cmp("gt", v, const(hi, t)), above, v))


def _cubic_weights(f, t: str) -> list:
    """Keys' weights of the taps at -1, 0, 1, 2 for a fractional position f in [0, 1)."""
    a = CUBIC_ALPHA

    def near(d):  # |d| <= 1
        return fbin("add", fbin("mul", fbin("mul", fbin("sub", fbin("mul", const(a + 2, t), d), const(a + 3, t)), d),
                                d), const(1.0, t))

    def far(d):  # 1 < |d| < 2
        inner = fbin("add", fbin("mul", fbin("sub", fbin("mul", const(a, t), d), const(5 * a, t)), d), const(8 * a, t))
        return fbin("sub", fbin("mul", inner, d), const(4 * a, t))
    one = const(1.0, t)
    return [far(fbin("add", f, one)), near(f), near(fbin("sub", one, f)), far(fbin("sub", const(2.0, t), f))]


def _grid_sample_reader(b, node):
    x, grid = b.reader(node.inputs[0]), b.reader(node.inputs[1])
    xs, a = b.shape(node.inputs[0]), b.attrs(node)
    t, mode = b.compute(node.inputs[0]), a["mode"]
    padding, corners = a.get("padding_mode", "zeros"), bool(a.get("align_corners", 0))
    dims = xs[2:]
    borders = [(0.0, d - 1.0) if corners else (-0.5, d - 0.5) for d in dims]

    def coordinate(idx, axis: int):
        """Axis `axis`'s position in pixels, rounded (nearest) and brought inside as padding says."""
        d, (lo, hi) = dims[axis], borders[axis]
        v = grid([idx[0], *idx[2:], Const(len(dims) - 1 - axis)])  # (the grid lists x, y, ...: the last axis first)
        v = v if b.compute(node.inputs[1]) == t else Cast(t, v)
        v = fbin("mul", fbin("add", v, const(1.0, t)), const((d - 1) / 2, t)) if corners else \
            fbin("div", fbin("sub", fbin("mul", fbin("add", v, const(1.0, t)), const(d, t)), const(1.0, t)),
                 const(2.0, t))
        if mode == "nearest":
            v = call("round", v)  # (half to even)
        if padding == "border" and mode != "cubic":  # (cubic: its taps are clamped, as onnxruntime does)
            v = fbin("min", fbin("max", v, const(0.0, t)), const(d - 1.0, t))
        elif padding == "reflection":
            v = _reflect(v, lo, hi, t)
        return v

    def tap(i, axis: int):
        """(index to read, whether it holds a pixel) of integer position i along `axis`."""
        d, (lo, hi) = dims[axis], borders[axis]
        if padding == "zeros":
            return iclamp(i, 0, d - 1), and_(cmp("ge", i, Const(0)), cmp("lt", i, Const(d)))
        if padding == "border":
            return iclamp(i, 0, d - 1), None
        return iclamp(Cast("i64", _reflect(Cast(t, i), lo, hi, t)), 0, d - 1), None

    def value(idx):
        per_axis = []  # per spatial axis: [(index, inside or None, weight or None)]
        for axis in range(len(dims)):
            v = coordinate(idx, axis)
            if mode == "nearest":
                per_axis.append([(*tap(Cast("i64", v), axis), None)])
                continue
            first = call("floor", v)
            f, i0 = fbin("sub", v, first), Cast("i64", first)
            if mode == "linear":
                weights, offsets = [fbin("sub", const(1.0, t), f), f], [0, 1]
            else:
                weights, offsets = _cubic_weights(f, t), [-1, 0, 1, 2]
            per_axis.append([(*tap(add(i0, Const(k)), axis), w) for k, w in zip(offsets, weights)])
        terms = [[]]
        for taps in per_axis:
            terms = [chosen + [one] for chosen in terms for one in taps]
        values = []
        for chosen in terms:
            pixel = x([idx[0], idx[1], *[i for i, _, _ in chosen]])
            for _, inside, weight in chosen:
                if weight is not None:
                    pixel = fbin("mul", pixel, weight)
            inside = [ok for _, ok, _ in chosen if ok is not None]
            if inside:
                pixel = select(fold_balanced("and", inside), pixel, const(0.0, t))
            values.append(pixel)
        return fold_balanced("add", values)
    return value


register(OpDef("GridSample", INJECTIVE, _grid_sample, None, one_output(_grid_sample_reader)))
