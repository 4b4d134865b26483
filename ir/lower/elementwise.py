"""Readers that inline: the index maps and value expressions elementwise and injective ops
lower to (see ir/ops for which op uses which). A reader maps an output multi-index to the
expression of that element, built from the readers of the op's inputs, so a chain of such
ops inlines into one expression per output element.
"""
from __future__ import annotations

import numpy as np

from ..graph import Node
from ..loop import (Cast, Const, Expr, For, Load, Store, Var, add, call, cmp, const, div, fbin, flat_index, mul, rem,
                    select, sub, unflatten)
from ..symbolic import greatest, is_symbolic
from .builder import KernelBuilder, broadcast_index


def bcast_reader(b: KernelBuilder, name: str, out_shape):
    r, shape = b.reader(name), b.shape(name)
    return lambda idx: r(broadcast_index(idx, out_shape, shape))


def f32(v) -> Const:
    return Const(float(v), "f32")


def and_(a, c):
    return fbin("and", a, c)


def clamp(x, lo, hi):
    return fbin("min", fbin("max", x, lo), hi)


def iclamp(e, lo, hi, t: str = "i64"):
    """e (of integer type t) within [lo, hi]; a bound may be a run-time size (i64)."""
    return fbin("min", fbin("max", e, as_index(lo, t)), as_index(hi, t))


def as_index(d, t: str = "i64"):
    """A size (an int, or a run-time i64 expression) as an operand of type t."""
    if isinstance(d, int):
        return Const(d)
    return d if t == "i64" else Cast(t, d)


def view_reader(b: KernelBuilder, src: str, oshape, view_out: str | None = None):
    """A reshape inside a group: same row-major data, so go through the flat index, one run
    of dims at a time: where both shapes have a boundary at the same element count (the
    [197, 384] -> [197, 6, 64] of attention heads), the dims between two boundaries map
    among themselves. A split then costs a multiply-add instead of a division by 197 (which
    LLVM cannot remove: it does not know the index is below the dim)."""
    x, sshape = b.reader(src), b.shape(src)
    if tuple(sshape) == tuple(oshape):
        return x
    if 0 in sshape:
        return lambda idx: x(unflatten(flat_index(idx, oshape), sshape))
    if all(isinstance(d, int) for d in list(sshape) + list(oshape)):
        runs = _common_runs(list(oshape), list(sshape))
    elif src not in b.shapes and view_out is not None and view_out not in b.shapes:
        runs = _common_runs_symbolic(list(b.type(view_out).shape), list(b.type(src).shape))
    else:
        return lambda idx: x(unflatten(flat_index(idx, oshape), sshape))

    def read(idx):
        src_idx = [Const(0)] * len(sshape)
        for odims, sdims in runs:
            flat = flat_index([idx[k] for k in odims], [oshape[k] for k in odims])
            for k, i in zip(sdims, unflatten(flat, [sshape[k] for k in sdims])):
                src_idx[k] = i
        return x(src_idx)
    return read


def _common_runs(a: list, b: list) -> list[tuple[list, list]]:
    """Two shapes of one size cut where both have a dim boundary at the same element count:
    [(dims of a, dims of b)] per run, dims of size 1 left out (their index is 0)."""
    pa, pb = np.cumprod([1] + a), np.cumprod([1] + b)
    cuts = sorted(set(pa.tolist()) & set(pb.tolist()))

    def dims(shape, prefix, lo, hi):
        return [k for k in range(len(shape)) if shape[k] > 1 and lo < prefix[k + 1] <= hi]
    return [(dims(a, pa, lo, hi), dims(b, pb, lo, hi)) for lo, hi in zip(cuts, cuts[1:])]


def _common_runs_symbolic(a: list, b: list) -> list[tuple[list, list]]:
    """`_common_runs` of shapes with symbolic dims: the element counts are polynomials, equal
    where they are the same polynomial (batch*seq | heads | dh of [batch, seq, heads*dh])."""
    def prefixes(shape):
        out = [1]
        for d in shape:
            out.append(out[-1] * d)
        return out
    pa, pb = prefixes(a), prefixes(b)
    cuts = [(i, pb.index(v)) for i, v in enumerate(pa) if v in pb]
    if cuts[-1] != (len(a), len(b)):  # (the whole is a cut even where the polynomials differ: a shape
        cuts.append((len(a), len(b)))  # read at run time, whose product the module checks)

    def real(shape, lo, hi):
        return [k for k in range(lo, hi) if not (isinstance(shape[k], int) and shape[k] == 1)]
    return [(real(a, ia, ja), real(b, ib, jb)) for (ia, ib), (ja, jb) in zip(cuts, cuts[1:]) if ja > ia or jb > ib]


def concat_reader(b: KernelBuilder, node: Node):
    axis = b.attrs(node)["axis"]
    parts, off = [], 0
    for name in node.inputs:
        if name:
            parts.append((off, b.shape(name)[axis], b.reader(name)))
            off += b.shape(name)[axis]

    def concat(idx):
        def part(i):
            start, size, r = parts[i]
            local = list(idx)
            # Every branch is evaluated, so keep every branch's index in bounds (at 0 where a
            # run-time size leaves a part empty).
            last = max(size - 1, 0) if isinstance(size, int) else fbin("max", sub(size, Const(1)), Const(0))
            local[axis] = iclamp(sub(idx[axis], start), 0, last)
            return r(local)

        def pick(lo, hi):
            """parts[lo:hi] chosen by a balanced tree of selects: depth log2 of the parts (a
            chain nested once per part, and 2000 parts overflowed the kernel's walkers)."""
            if hi - lo == 1:
                return part(lo)
            mid = (lo + hi) // 2
            return select(cmp("lt", idx[axis], as_index(parts[mid][0])), pick(lo, mid), pick(mid, hi))
        return pick(0, len(parts))
    return concat


def concat_by_slabs(b: KernelBuilder, node: Node) -> tuple:
    """One loop nest per input, each writing its slab: no selects, no wasted loads."""
    out, axis = node.outputs[0], b.attrs(node)["axis"]
    oshape, param = b.shape(out), b.out_param(out)
    body, off = [], 0
    for name in node.inputs:
        if not name:
            continue
        r, shape = b.reader(name), b.shape(name)

        def point(idx, r=r, off=off):
            dest = list(idx)
            dest[axis] = dest[axis] + off
            return [Store(param, flat_index(dest, oshape), r(idx))]
        body += b.loops(shape, point, parallel=True)
        off += shape[axis]
    return tuple(body)


def split_readers(b: KernelBuilder, node: Node) -> dict:
    axis, x = b.attrs(node)["axis"], b.reader(node.inputs[0])
    out, off = {}, 0
    for name, size in zip(node.outputs, b.attrs(node)["sizes"]):
        if name:
            out[name] = (lambda start: lambda idx: x([add(i, start) if a == axis else i
                                                      for a, i in enumerate(idx)]))(off)
        off += size
    return out


def gather_reader(b: KernelBuilder, node: Node):
    axis = b.attrs(node)["axis"]
    x, ind = b.reader(node.inputs[0]), b.reader(node.inputs[1])
    r = len(b.shape(node.inputs[1]))
    dim, t = b.shape(node.inputs[0])[axis], b.compute(node.inputs[1])

    def gather(idx):
        i = ind(idx[axis:axis + r])
        i = i if t == "i64" else Cast("i64", i)  # (an index is i64: int32 ids widen first)
        i = select(cmp("lt", i, Const(0)), add(i, as_index(dim)), i)
        return x(list(idx[:axis]) + [iclamp(i, 0, dim - 1)]
                 + list(idx[axis + r:]))
    return gather


def pad_reader(b: KernelBuilder, node: Node):
    x, shape = b.reader(node.inputs[0]), b.shape(node.inputs[0])
    pads, rank, mode = b.attrs(node)["pads"], len(shape), b.attrs(node)["mode"]
    if b.attrs(node)["value"] is None:  # a run-time scalar (or one-element) input
        value = b.reader(node.inputs[2])([Const(0)] * len(b.shape(node.inputs[2])))
    else:
        value = const(b.attrs(node)["value"], b.compute(node.inputs[0]))

    def pad(idx):
        src, inside = [], None
        for a, i in enumerate(idx):
            before, n = pads[a], shape[a]
            if before == 0 and pads[a + rank] == 0:  # (a pad read at run time is a Dim: never 0 here)
                src.append(i)
                continue
            j, last = sub(i, as_index(b.dim(before))), sub(n, 1)  # (n: an int, or a run-time size)
            if mode == "edge":
                src.append(iclamp(j, 0, last))
            elif mode == "wrap":
                src.append(iclamp(_wrapped(i, n, before, pads[a + rank], b.dim), 0, last))
            elif mode == "reflect":
                j = select(cmp("lt", j, Const(0)), sub(Const(0), j), j)
                j = select(cmp("ge", j, n), sub(mul(2, last), j), j)
                src.append(iclamp(j, 0, last))
            else:
                ok = and_(cmp("ge", j, Const(0)), cmp("lt", j, n))
                inside = ok if inside is None else and_(inside, ok)
                src.append(iclamp(j, 0, last))
        v = x(src)
        return v if inside is None else select(inside, v, value)
    return pad


def _wrapped(i, n, before, after, dim):
    """Pad's wrap mode along one axis: negative pads crop first (as onnxruntime does; onnx's
    reference evaluator refuses them), then output index i reads the kept [crop_before,
    n - crop_after) at (i - pad_before) modulo its length. (Pads read at run time are Dims,
    never negative: ir/ops/shape._check_wrap. `dim` makes a Dim an expression.)"""
    pad_before, crop_before = (before, 0) if is_symbolic(before) else (max(before, 0), max(-before, 0))
    crop_after = 0 if is_symbolic(after) else max(-after, 0)
    kept = sub(n, crop_before + crop_after)
    t = rem(sub(i, as_index(dim(pad_before))), kept)
    t = select(cmp("lt", t, Const(0)), add(t, kept), t)  # (remainders of either sign's convention)
    return add(t, crop_before)


def resize_source_coords(n_in: int, n_out: int, scale: float, ctm: str, roi=(0.0, 1.0)) -> np.ndarray:
    """Source coordinate of every output index along one axis, in float64 as ONNX defines it:
    its formulas use the unrounded output length, scale * n_in."""
    x = np.arange(n_out, dtype=np.float64)
    length = scale * n_in
    if ctm == "align_corners":
        return np.zeros(n_out) if length == 1 else x * (n_in - 1) / (length - 1)
    if ctm == "asymmetric":
        return x / scale
    if ctm == "tf_half_pixel_for_nearest":
        return (x + 0.5) / scale
    if ctm == "tf_crop_and_resize":
        start, end = roi
        if length == 1:
            return np.full(n_out, (end - start) * (n_in - 1) / 2 + start * (n_in - 1))
        return x * (end - start) * (n_in - 1) / (length - 1) + start * (n_in - 1)
    if ctm == "pytorch_half_pixel" and length == 1:
        return np.full(n_out, -0.5)
    if ctm == "half_pixel_symmetric":  # the crop's centre stays the output's centre
        return n_in / 2 * (1 - n_out / length) + (x + 0.5) / scale - 0.5
    return (x + 0.5) / scale - 0.5


def _nearest(coords: np.ndarray, mode: str) -> np.ndarray:
    if mode == "floor":
        return np.floor(coords)
    if mode == "ceil":
        return np.ceil(coords)
    half = coords - np.floor(coords) == 0.5
    return np.where(half, np.floor(coords) if mode == "round_prefer_floor" else np.ceil(coords), np.round(coords))


def _keys(d: np.ndarray, a: float) -> np.ndarray:
    """Keys' cubic convolution kernel at distance d, coefficient a."""
    d = np.abs(d)
    return np.where(d <= 1, ((a + 2) * d - (a + 3)) * d * d + 1,
                    np.where(d < 2, ((a * d - 5 * a) * d + 8 * a) * d - 4 * a, 0.0))


def resize_taps(n_in: int, coords: np.ndarray, mode: str, a: float, exclude_outside: bool, scale: float = 1.0,
                antialias: bool = False):
    """(source indices, weights), each [taps, n_out], as ONNX defines them: the neighbours of
    each coordinate x are base-taps/2+1 .. base+taps/2, base = ceil(x) - 1, weighed by the
    triangle (linear) or Keys' kernel with coefficient a (cubic). With antialias, a
    downsampling stretches the kernel by 1/scale (more taps) and the weights are normalized.
    Neighbours past the edge read the edge element, or with exclude_outside weigh nothing
    (the rest renormalized)."""
    base = np.ceil(coords) - 1
    t = coords - base  # in (0, 1]
    stretch = min(scale, 1.0) if antialias else 1.0
    reach = 1 if mode == "linear" else 2  # the kernel's support, in input steps before stretching
    first = int(np.floor(-reach / stretch) + 1)
    offsets = range(first, 2 - first)
    d = np.stack([(o - t) * stretch for o in offsets])
    w = np.clip(1 - np.abs(d), 0, 1) if mode == "linear" else _keys(d, a)
    if antialias:
        w = w / w.sum(axis=0, keepdims=True)
    idx = np.stack([base + o for o in offsets])
    if exclude_outside:
        w = np.where((idx < 0) | (idx > n_in - 1), 0.0, w)
        w = w / w.sum(axis=0, keepdims=True)
    return np.clip(idx, 0, n_in - 1).astype(np.int64), w


def _resize_axis(b: KernelBuilder, node: Node, ax: int):
    """The source coordinates of every output position along axis ax, and (nearest mode) their
    indices or (linear, cubic) their taps: ([taps, n_out] indices, [taps, n_out] weights)."""
    a = b.attrs(node)
    ishape, oshape, rank = b.shape(node.inputs[0]), b.shape(node.outputs[0]), len(b.shape(node.inputs[0]))
    roi = a.get("roi")
    coords = resize_source_coords(ishape[ax], oshape[ax], a["scales"][ax], a.get("coordinate_transformation_mode",
                                                                                "half_pixel"),
                                  (roi[ax], roi[ax + rank]) if roi else (0.0, 1.0))
    if a.get("mode", "nearest") == "nearest":
        idx = np.clip(_nearest(coords, a.get("nearest_mode", "round_prefer_floor")), 0, ishape[ax] - 1)
        return coords, (idx[None].astype(np.int64), np.ones((1, oshape[ax])))
    return coords, resize_taps(ishape[ax], coords, a["mode"], a.get("cubic_coeff_a", -0.75),
                               bool(a.get("exclude_outside", 0)), a["scales"][ax], bool(a.get("antialias", 0)))


def _by_whole_scales(node: Node, scales: list) -> bool:
    """Is output i of this Resize input i // s on every axis (s a whole scale)? For a nearest
    Resize, ONNX's coordinates give that in half-pixel modes with any rounding, and in
    asymmetric ones rounding down."""
    coords = node.attrs.get("coordinate_transformation_mode", "half_pixel")
    rounding = node.attrs.get("nearest_mode", "round_prefer_floor")
    return (node.attrs.get("mode", "nearest") == "nearest" and all(s is not None and float(s).is_integer()
                                                                   for s in scales)
            and (coords in ("half_pixel", "pytorch_half_pixel")
                 or coords in ("asymmetric", "tf_half_pixel_for_nearest") and rounding == "floor"))


def _f64(size) -> Expr:
    return Const(float(size), "f64") if isinstance(size, int) else Cast("f64", size)


def _run_time_coords(node: Node, i, n_in, n_out, scale):
    """resize_source_coords for output index i (an i64 expression) where the sizes are known
    at run time only: the same float64 formulas, computed by the kernel. `scale` is the
    constant one, or None where it is the ratio of the sizes (a Resize to `sizes`)."""
    ctm = node.attrs.get("coordinate_transformation_mode", "half_pixel")
    s = Const(float(scale), "f64") if scale is not None else fbin("div", _f64(n_out), _f64(n_in))
    length = fbin("mul", s, _f64(n_in))  # (ONNX's unrounded output length)
    x = Cast("f64", i)
    half = fbin("sub", fbin("div", fbin("add", x, Const(0.5, "f64")), s), Const(0.5, "f64"))
    one = cmp("eq", length, Const(1.0, "f64"))
    if ctm == "align_corners":
        return select(one, Const(0.0, "f64"), fbin("div", fbin("mul", x, fbin("sub", _f64(n_in), Const(1.0, "f64"))),
                                                    fbin("sub", length, Const(1.0, "f64"))))
    if ctm == "asymmetric":
        return fbin("div", x, s)
    if ctm == "tf_half_pixel_for_nearest":
        return fbin("div", fbin("add", x, Const(0.5, "f64")), s)
    if ctm == "pytorch_half_pixel":
        return select(one, Const(-0.5, "f64"), half)
    if ctm == "half_pixel_symmetric":
        centre = fbin("mul", fbin("div", _f64(n_in), Const(2.0, "f64")),
                      fbin("sub", Const(1.0, "f64"), fbin("div", _f64(n_out), length)))
        return fbin("add", centre, half)
    if ctm == "half_pixel":
        return half
    raise TypeError(f"a Resize of run-time sizes with {ctm} coordinates")


def _keys_expr(d, a: float):
    """_keys for one distance d (an f64 expression)."""
    d = call("abs", d)
    c = lambda v: Const(float(v), "f64")  # noqa: E731
    near = fbin("add", fbin("mul", fbin("mul", fbin("sub", fbin("mul", c(a + 2), d), c(a + 3)), d), d), c(1))
    far = fbin("sub", fbin("mul", fbin("add", fbin("mul", fbin("sub", fbin("mul", c(a), d), c(5 * a)), d), c(8 * a)),
                            d), c(4 * a))
    return select(cmp("le", d, c(1)), near, select(cmp("lt", d, c(2)), far, c(0)))


def _run_time_taps(node: Node, i, n_in, n_out, scale) -> list:
    """resize_taps (or the nearest index) of output index i along an axis whose sizes are
    known at run time only: [(source index, weight or None)], computed by the kernel."""
    a = node.attrs
    mode = a.get("mode", "nearest")
    coord = _run_time_coords(node, i, n_in, n_out, scale)
    last = sub(n_in, 1)
    if mode == "nearest":
        rounding = a.get("nearest_mode", "round_prefer_floor")
        half = Const(0.5, "f64")
        rounded = {"floor": lambda: call("floor", coord), "ceil": lambda: call("ceil", coord),
                   "round_prefer_floor": lambda: call("ceil", fbin("sub", coord, half)),
                   "round_prefer_ceil": lambda: call("floor", fbin("add", coord, half))}[rounding]()
        return [(iclamp(Cast("i64", rounded), 0, last), None)]
    antialias = bool(a.get("antialias", 0))
    if antialias and scale is None:
        raise TypeError("an antialiased Resize to sizes known at run time (its taps depend on the scale)")
    stretch = min(scale, 1.0) if antialias else 1.0
    base = fbin("sub", call("ceil", coord), Const(1.0, "f64"))
    t = fbin("sub", coord, base)
    reach = 1 if mode == "linear" else 2
    first = int(np.floor(-reach / stretch) + 1)
    taps = []
    for o in range(first, 2 - first):
        d = fbin("mul", fbin("sub", Const(float(o), "f64"), t), Const(stretch, "f64"))
        w = (fbin("max", fbin("sub", Const(1.0, "f64"), call("abs", d)), Const(0.0, "f64")) if mode == "linear"
             else _keys_expr(d, a.get("cubic_coeff_a", -0.75)))
        at = add(Cast("i64", base), o)
        if a.get("exclude_outside", 0):
            inside = and_(cmp("ge", at, Const(0)), cmp("le", at, last))
            w = select(inside, w, Const(0.0, "f64"))
        taps.append((at, w))
    if antialias or a.get("exclude_outside", 0):
        total = None
        for _, w in taps:
            total = w if total is None else fbin("add", total, w)
        taps = [(at, fbin("div", w, total)) for at, w in taps]
    return [(iclamp(at, 0, last), w) for at, w in taps]


def _resize_at_run_time(b: KernelBuilder, node: Node, x, ishape, oshape):
    """A Resize whose sizes are known at run time: per resized axis, tables of each output
    position's source indices and weights, computed by the kernel before its loops (b.setup)
    as large as the bounds allow, then read as the compile-time tables are; whole-scale
    nearest axes read input i // s with no table."""
    a = b.attrs(node)
    if a.get("roi"):
        raise TypeError("a tf_crop_and_resize Resize of run-time sizes")
    scales = a["scales"]
    if _by_whole_scales(node, scales):
        whole = [int(s) for s in scales]
        return lambda idx, passthrough=(): x([div(i, s) if s != 1 else i for i, s in zip(idx, whole)])
    in_dims, out_dims = b.type(node.inputs[0]).shape, b.type(node.outputs[0]).shape
    resized = [ax for ax in range(len(ishape)) if scales[ax] != 1 or in_dims[ax] != out_dims[ax]]
    compute = b.compute(node.inputs[0])
    wtype = "f64" if compute == "f64" else "f32"
    tables = {}
    for ax in resized:
        i = b.fresh("i")
        room = greatest(out_dims[ax])
        columns, fills = [], []
        for at, w in _run_time_taps(node, Var(i), ishape[ax], oshape[ax], scales[ax]):
            at_buf = b.workspace(room, "i32")
            w_buf = b.workspace(room, wtype) if w is not None else None
            fills.append(Store(at_buf, Var(i), Cast("i32", at)))
            if w is not None:
                fills.append(Store(w_buf, Var(i), w if wtype == "f64" else Cast(wtype, w)))
            columns.append((at_buf, w_buf))
        # (over the whole room: a position past this call's size is still read where a Concat
        # or Select evaluates a branch it does not take, and its source index must be one)
        b.setup.append(For(i, room, tuple(fills), "vectorize"))
        tables[ax] = columns

    return lambda idx, passthrough=(): _weighted_taps(x, tables, [ax for ax in resized if ax not in passthrough],
                                                      idx)


def _weighted_taps(x, tables: dict, axes: list, idx):
    """A Resize's value at idx: over every combination of the axes' taps, x at the taps'
    source indices times the product of their weights. tables[axis]: [(index buffer, weight
    buffer, or None for a weight of 1)], each indexed by the output position."""
    terms = [(list(idx), None)]
    for ax in axes:
        nxt = []
        for src, w in terms:
            for at, wt in tables[ax]:
                s2 = list(src)
                s2[ax] = Cast("i64", Load(at, idx[ax]))
                weight = None if wt is None else Load(wt, idx[ax])
                nxt.append((s2, weight if w is None or weight is None else fbin("mul", w, weight)))
        terms = nxt
    value = None
    for src, w in terms:
        term = x(src) if w is None else fbin("mul", x(src), w)
        value = term if value is None else fbin("add", value, term)
    return value


def resize_reader(b: KernelBuilder, node: Node):
    """Resize through per-axis index (and weight) tables computed at compile time in float64:
    exact where ONNX's coordinates land on .5, and a gather per element at run time. With
    tf_crop_and_resize, an output whose source lies outside the input on any axis is the
    extrapolation value. The reader's `passthrough` axes are read at the index given
    (resize_by_phases resizes the last one itself)."""
    x, ishape = b.reader(node.inputs[0]), b.shape(node.inputs[0])
    oshape = b.shape(node.outputs[0])
    a = b.attrs(node)
    mode = a.get("mode", "nearest")
    scales, roi, rank = a["scales"], a.get("roi"), len(ishape)
    if any(isinstance(d, Expr) for d in list(ishape) + list(oshape)):
        return _resize_at_run_time(b, node, x, ishape, oshape)
    wtype = np.float64 if b.compute(node.inputs[0]) == "f64" else np.float32
    resized = [ax for ax in range(rank) if ishape[ax] != oshape[ax] or scales[ax] != 1 or roi]
    tables, outside = {}, {}
    for ax in resized:
        coords, (idx, w) = _resize_axis(b, node, ax)
        if roi is not None and ((coords < 0) | (coords > ishape[ax] - 1)).any():
            outside[ax] = b.constant_param("resize_outside", (coords < 0) | (coords > ishape[ax] - 1))
        if mode == "nearest":
            tables[ax] = b.constant_param("resize_index", idx[0].astype(np.int32))
        else:
            tables[ax] = [(b.constant_param("resize_at", i.astype(np.int32)),
                           b.constant_param("resize_w", wk.astype(wtype))) for i, wk in zip(idx, w)]

    def extrapolated(idx, value):
        for ax, table in outside.items():
            value = select(Load(table, idx[ax]), Const(float(a.get("extrapolation_value", 0.0)), "f32"), value)
        return value

    if mode == "nearest":
        def near(idx, passthrough=()):
            src = list(idx)
            for ax in (ax for ax in resized if ax not in passthrough):
                src[ax] = Cast("i64", Load(tables[ax], idx[ax]))
            return extrapolated(idx, x(src))
        return near

    def interpolate(idx, passthrough=()):
        return extrapolated(idx, _weighted_taps(x, tables, [ax for ax in resized if ax not in passthrough], idx))
    return interpolate


def resize_by_phases(b: KernelBuilder, node: Node) -> tuple:
    """A Resize alone in its group that enlarges its last axis s times (a whole number):
    output column j = q*s + r reads input columns q + a_t[r] with weights w_t[r] that depend
    on r alone, away from the edges. So each output row is computed as s interleaved runs
    over q, whose loads are contiguous and whose weights are constants, instead of a gather
    per tap and element; the few edge columns (clamped taps) go through the tables."""
    ishape, out = b.shape(node.inputs[0]), node.outputs[0]
    oshape, param = b.shape(out), b.out_param(out)
    last = len(ishape) - 1
    reader = resize_reader(b, node)

    def generic():
        return b.loops(oshape, lambda idx: [Store(param, flat_index(idx, oshape), reader(idx))], parallel=True)
    if isinstance(ishape[last], Expr) or isinstance(oshape[last], Expr):  # (other axes may be run-time sizes)
        return generic()
    a = b.attrs(node)
    n_in, n_out = ishape[last], oshape[last]
    if a.get("roi") or a.get("mode", "nearest") == "cubic" or n_out % n_in or n_out // n_in < 2:
        return generic()
    scale = n_out // n_in
    _, (idx, w) = _resize_axis(b, node, last)
    mid = n_in // 2
    at = idx[:, mid * scale:(mid + 1) * scale] - mid  # [taps, scale]: column offsets of phase r
    weight = w[:, mid * scale:(mid + 1) * scale]

    def regular(q: int) -> bool:
        cols = slice(q * scale, (q + 1) * scale)
        return bool((idx[:, cols] == q + at).all() and np.allclose(w[:, cols], weight, rtol=0, atol=1e-12))
    lo, hi = mid, mid + 1
    if not regular(mid):
        return generic()
    while lo > 0 and regular(lo - 1):
        lo -= 1
    while hi < n_in and regular(hi):
        hi += 1
    if 2 * (hi - lo) < n_in:  # weights that drift along the axis (align_corners): tables it is
        return generic()
    inner = lambda idx: reader(idx, passthrough=(last,))  # noqa: E731  (the last axis: by phases)
    linear = a.get("mode", "nearest") != "nearest"

    def row(outer):
        def edge(first: int, count: int) -> tuple:
            j = b.fresh("j")
            at_j = list(outer) + [add(Var(j), first)]
            return (For(j, count, (Store(param, flat_index(at_j, oshape), reader(at_j)),)),) if count > 0 else ()
        q = b.fresh("q")
        col = add(Var(q), lo)
        stores = []
        for r in range(scale):
            value = None
            for t in range(idx.shape[0]):
                term = inner(list(outer) + [add(col, int(at[t, r]))])
                term = fbin("mul", term, Const(float(weight[t, r]), "f32")) if linear else term
                value = term if value is None else fbin("add", value, term)
            stores.append(Store(param, flat_index(list(outer) + [add(mul(col, scale), r)], oshape), value))
        return [*edge(0, lo * scale), For(q, hi - lo, tuple(stores)),
                *edge(hi * scale, n_out - hi * scale)]
    return b.loops(oshape[:-1], row, inner_kind="serial", parallel=True)
