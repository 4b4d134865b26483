"""MaxPool and AveragePool.

A 2-D float32 pool with a column stride copies each channel plane with a border (the max's
identity, or zero) split by column phase, then computes the plane's outputs from that copy
while it is in L1: every tap of a row of outputs is then one contiguous run, so a row is
whole vectors with no bounds checks (read in place, a stride-2 row is every other element,
which LLVM gathered or ran as scalar code); so does a max pool over sizes known only at run
time, its copy planned at the bounds. A plane past L1 is copied into a ring of the rows a
window spans instead, as a depthwise conv's is (planes.RING_MIN_PLANE_BYTES). Other pools
(stride 1, where the copy cost more than it saved; 1-D and 3-D; float64; an average over
run-time sizes) read the input in place, checking the taps of the windows at the border.
"""
from __future__ import annotations

import itertools
import math

import numpy as np

from ..dtypes import dtype
from ..graph import Node
from ..loop import (FLOAT_TYPES, Assign, Const, Expr, For, If, Let, Load, Local, Var, add, call, cmp, fbin,
                    flat_index, lowest, mul, rem, select, sub)
from ..symbolic import greatest, least
from .builder import KernelBuilder
from .gemm import bordered_copies_limit, image_workspace, images_in_parallel, over_images
from .planes import phase_split_copy, phase_split_row, ring_when, rows_through_a_ring, size_max
from .reduce import literal

MAX_TREE_TAPS = 64  # max pooling windows up to this size compute their maximum as a tree


def _f(v) -> Const:
    return Const(float(v), "f32")


def _on_bordered_planes(b: KernelBuilder, node: Node, t: str, is_max: bool) -> bool:
    """Whether the pool reads bordered plane copies (see the module's docstring): a max pool
    over run-time sizes too (an average's divisors are a table of the static sizes)."""
    shape = b.shape(node.inputs[0])
    run_time = any(isinstance(d, Expr) for d in shape[2:])
    return t == "f32" and len(shape) == 4 and not isinstance(shape[1], Expr) and (is_max or not run_time) and \
        b.attrs(node)["strides"][-1] > 1


def _tap_counts(out: int, size: int, k: int, s: int, d: int, before: int, after: int, include_pad: bool):
    """Per output along one axis, how many of its window's taps an average counts: those in
    the input, or with count_include_pad those in the padded input (never the taps a ceil_mode
    window has past the padding)."""
    lo, hi = (-before, size + after) if include_pad else (0, size)
    pos = np.arange(out)[:, None] * s - before + np.arange(k)[None, :] * d
    return ((pos >= lo) & (pos < hi)).sum(axis=1)


def _lower_pool_on_planes(b: KernelBuilder, node: Node, store, is_max: bool) -> tuple:
    x_name = node.inputs[0]
    _, channels, h, w = b.shape(x_name)  # (h, w, oh, ow: expressions over run-time sizes)
    oh, ow = b.shape(node.outputs[0])[2:]
    a = b.attrs(node)
    (kh, kw), (sh, sw), (dh, dw), (pt, pl, pb, pr) = a["kernel_shape"], a["strides"], a["dilations"], a["pads"]

    def padded(h, w, oh, ow):
        """The copy's rows and slots per phase (ints, or expressions over run-time sizes): it
        covers every tap (a ceil_mode window may reach past the padding)."""
        wide = size_max(w + pl + pr, ow * sw + (kw - 1) * dw + 1 - sw)
        return size_max(h + pt + pb, oh * sh + (kh - 1) * dh + 1 - sh), (wide + sw - 1) // sw
    hp, wq = padded(h, w, oh, ow)
    dims = [b.type(x_name).shape[2:], b.type(node.outputs[0]).shape[2:]]
    hp_bound, wq_bound = padded(*(greatest(d) for d in dims[0]), *(greatest(d) for d in dims[1]))
    # A plane past L1 is copied into a ring of the rows a window spans, as the depthwise conv's
    # (planes.RING_MIN_PLANE_BYTES).
    ring = (kh - 1) * dh + 1
    in_ring = ring_when(ring, mul(mul(hp, sw * 4), wq), hp_bound * sw * wq_bound * 4)
    plane_floats = channels * (ring if in_ring is True else hp_bound) * sw * wq_bound
    # (images on threads of their own: a slice of the copy each)
    limit = bordered_copies_limit(b, x_name)
    batch = b.type(x_name).shape[0]
    bv = b.fresh("b")
    planes, planes_off = image_workspace(b, bv, batch, plane_floats, images_in_parallel(b, batch, plane_floats, limit))
    x = b.reader(x_name)
    inline = x_name in b.readers  # (computed in this group: no buffer to deinterleave from)
    storage = b.storage(x_name)

    def read(c, i, j):
        return x([Var(bv), c, i, j])

    def row_start(c, i):
        return b.in_param(x_name), flat_index([Var(bv), c, i, Const(0)], storage)
    plain = not inline and dtype(b.type(x_name).dtype).storage == "f32"
    border = literal(lowest("f32")) if is_max else _f(0)
    if in_ring is True:  # (no whole planes: the channel loop only)
        copy, c = None, b.fresh("c")
    else:
        copy = phase_split_copy(b, read, channels, h, w, pt, pl, sw, hp, wq, planes, row_start if plain else None,
                                border, planes_off, least(dims[0][1]))
        c = copy.var
    r, q = b.fresh("r"), b.fresh("q")

    def output_row(ring: int) -> For:
        """Output row r of channel c, from its whole copied plane or (ring > 0) a ring of rows."""
        stmts = []

        def bound(value):
            stmts.append(Let(b.fresh("m"), value))
            return Var(stmts[-1].var, "f32")

        def tap(u: int, v: int):
            kx, row = v * dw, add(mul(Var(r), sh), u * dh)
            return Load(planes, add(planes_off, flat_index([Var(c), rem(row, ring) if ring else row, Const(kx % sw),
                                                            add(Var(q), kx // sw)], [channels, ring or hp, sw, wq])))
        if kh * kw <= MAX_TREE_TAPS:  # every tap loaded once, combined as a balanced tree
            taps = [bound(tap(u, v)) for u in range(kh) for v in range(kw)]
            value = _tap_maximum(taps, "f32", bound) if is_max else \
                _balanced(taps, lambda x, y: fbin("add", x, y), bound)
        else:  # one accumulator per window row: kh short chains instead of one long one
            parts = []
            for u in range(kh):
                acc = b.fresh("acc")
                stmts.append(Local(acc, "f32", literal(lowest("f32")) if is_max else _f(0)))
                for v in range(kw):
                    stmts.append(Assign(acc, _sticky_max(Var(acc, "f32"), tap(u, v)) if is_max else
                                        fbin("add", Var(acc, "f32"), tap(u, v))))
                parts.append(Var(acc, "f32"))
            value = _balanced(parts, (lambda x, y: _sticky_max(x, y)) if is_max else (lambda x, y: fbin("add", x, y)),
                              bound)
        if not is_max:
            include_pad = bool(a.get("count_include_pad", 0))
            counts = np.outer(_tap_counts(oh, h, kh, sh, dh, pt, pb, include_pad),
                              _tap_counts(ow, w, kw, sw, dw, pl, pr, include_pad)).astype(np.float32)
            divisor = _f(counts.flat[0]) if counts.min() == counts.max() else \
                Load(b.constant_param("pool_counts", counts), add(mul(Var(r), ow), Var(q)))
            value = fbin("div", value, divisor)
        return For(q, ow, (*stmts, *store([Var(bv), Var(c), Var(r), Var(q)], value)), "vector_masked")
    if in_ring is not False:
        i = b.fresh("y")
        row_in, inside, border_row = phase_split_row(b, read, c, i, rem(Var(i), ring), ring, channels, h, w, pt, pl,
                                                     sw, wq, planes, row_start if plain else None, border, planes_off,
                                                     least(dims[0][1]))
        in_rows = rows_through_a_ring(b, (If(row_in, inside, border_row),), i, r, oh, sh, ring, (output_row(ring),))
    # Each plane's outputs are computed right after its copy, while the copy is in L1.
    whole = () if copy is None else (*copy.body, For(r, oh, (output_row(0),)))
    body = whole if in_ring is False else in_rows if in_ring is True else (If(in_ring, in_rows, whole),)
    image = (For(c, channels, body, parallel=True),)
    return over_images(b, bv, batch, image, plane_floats, limit)


def _balanced(values: list, combine, bound):
    """values combined pairwise as a balanced tree, in order; each partial result bound once."""
    while len(values) > 1:
        values = [bound(combine(values[i], values[i + 1])) if i + 1 < len(values) else values[i]
                  for i in range(0, len(values), 2)]
    return values[0]


def _tap_maximum(taps: list, t: str, bound):
    """The maximum of a window's taps (each bound once), NaN where any tap is NaN. For floats, a
    tree of `x > y ? x : y`, which is one vmaxps (on equal values, +0 and -0, it takes the later
    tap, as onnxruntime's pooling does) but drops a NaN on its left, so NaN is put back by one
    test per pair of taps: two instructions a tap where a max keeping NaN itself took four."""
    if t not in FLOAT_TYPES:
        return _balanced(taps, lambda x, y: fbin("max", x, y), bound)
    pairs = [taps[i:i + 2] for i in range(0, len(taps), 2)]
    has_nan = _balanced([fbin("or", cmp("ne", p[0], p[0]), cmp("ne", p[-1], p[-1])) for p in pairs],
                        lambda x, y: fbin("or", x, y), lambda e: e)
    most = _balanced(taps, lambda x, y: select(cmp("gt", x, y), x, y), bound)
    return select(has_nan, Const(math.nan, t), most)


def _window_max(a, x, t: str):
    return _sticky_max(a, x) if t in ("f32", "f64") else fbin("max", a, x)


def _sticky_max(acc, x):
    """max(acc, x) that keeps a NaN from either side: take x where acc <= x or x is NaN.
    Two compares and a blend, against llvm.maximum's NaN and signed-zero fix-ups; on equal
    values (+0 and -0) it takes x, as x86's maxps(acc, x) and onnxruntime's pooling do."""
    return select(fbin("or", cmp("le", acc, x), cmp("ne", x, x)), x, acc)


def _lp_term(v, p: int):
    """|v| ** p: an LpPool's term."""
    return fbin("mul", v, v) if p == 2 else call("abs", v) if p == 1 else fbin("pow", call("abs", v), _f(p))


def _lp_root(total, p: int):
    """total ** (1 / p): an LpPool's output."""
    return call("sqrt", total) if p == 2 else total if p == 1 else fbin("pow", total, _f(1.0 / p))


def lower_pool(b: KernelBuilder, node: Node, store, is_max: bool, lp: int | None = None) -> tuple:
    """A max or average pool, or with `lp` an LpPool's p-norm over each window (taps outside
    the input count as zeros)."""
    t = b.compute(node.inputs[0])  # f32, or f64
    if lp is None and _on_bordered_planes(b, node, t, is_max):
        return _lower_pool_on_planes(b, node, store, is_max)
    x, xshape = b.reader(node.inputs[0]), b.shape(node.inputs[0])
    oshape = b.shape(node.outputs[0])
    a = b.attrs(node)
    kernel, strides, dil, pads = a["kernel_shape"], a["strides"], a["dilations"], a["pads"]
    nsp = len(kernel)
    spatial = xshape[2:]
    include_pad = a.get("count_include_pad", 0)

    def inside(i: int) -> tuple[int, int]:
        """The outputs [lo, hi) along spatial axis i whose whole window lies in the input."""
        lo = -(-pads[i] // strides[i])
        hi = (spatial[i] - 1 - (kernel[i] - 1) * dil[i] + pads[i]) // strides[i] + 1
        return min(lo, oshape[2 + i]), max(min(hi, oshape[2 + i]), min(lo, oshape[2 + i]))
    # Axes where some window leaves the input need bounds checks (every axis where sizes are
    # known only at run time).
    at_run_time = any(isinstance(d, Expr) for d in spatial)
    checked = [True] * nsp if at_run_time else [inside(i) != (0, oshape[2 + i]) for i in range(nsp)]

    def size(i: int, plus: int = 0):
        return add(spatial[i], plus) if isinstance(spatial[i], Expr) else Const(spatial[i] + plus)

    def point(oidx, inside_axes=frozenset()):
        """One output; along `inside_axes` its window lies in the input (no checks)."""
        def tap(kidx):
            """The tap's value, and whether it lies in the input and in the padded input."""
            src, ok, in_pad = list(oidx[:2]), None, None
            for i in range(nsp):
                pos = add(sub(mul(oidx[2 + i], strides[i]), pads[i]), mul(kidx[i], dil[i]))
                if checked[i] and i not in inside_axes:
                    within = fbin("and", cmp("ge", pos, Const(0)), cmp("lt", pos, size(i)))
                    padded = fbin("and", cmp("ge", pos, Const(-pads[i])), cmp("lt", pos, size(i, pads[nsp + i])))
                    ok = within if ok is None else fbin("and", ok, within)
                    in_pad = padded if in_pad is None else fbin("and", in_pad, padded)
                    pos = fbin("min", fbin("max", pos, Const(0)), size(i, -1))
                src.append(pos)
            return x(src), ok, in_pad

        if is_max and math.prod(kernel) <= MAX_TREE_TAPS:
            # A tree of maxima over the window's taps: depth log2(taps) instead of a chain.
            # Each value is bound once: a max reads its operands more than once, so
            # nesting the expressions would grow them fivefold per level (a 3x3 window's was
            # 600 copies of the taps, a 4.6 MB kernel that LLVM never fully recovered).
            stmts, values = [], []

            def bound(value):
                stmts.append(Let(b.fresh("m"), value))
                return Var(stmts[-1].var, t)
            for kidx in itertools.product(*(range(k) for k in kernel)):
                v, ok, _ = tap([Const(k) for k in kidx])
                values.append(bound(select(ok, v, literal(lowest(t))) if ok is not None else v))
            return stmts + list(store(oidx, _tap_maximum(values, t, bound)))

        acc, cnt = b.fresh("acc"), b.fresh("cnt")
        body = [Local(acc, t, literal(lowest(t) if is_max else 0)), Local(cnt, t, _f(0))]

        def accumulate(kidx):
            v, ok, in_pad = tap(kidx)
            if is_max:
                v = select(ok, v, literal(lowest(t))) if ok is not None else v
                return [Assign(acc, _window_max(Var(acc, t), v, t))]
            v = v if lp is None else _lp_term(v, lp)
            stmts = [Assign(acc, fbin("add", Var(acc, t), select(ok, v, _f(0)) if ok is not None else v))]
            counted = (in_pad if include_pad else ok)
            one = select(counted, _f(1), _f(0)) if counted is not None else _f(1)
            return stmts + [Assign(cnt, fbin("add", Var(cnt, t), one))]

        body += b.loops(kernel, accumulate, inner_kind="unroll")
        value = Var(acc, t) if is_max else _lp_root(Var(acc, t), lp) if lp is not None else \
            fbin("div", Var(acc, t), Var(cnt, t))
        return body + list(store(oidx, value))

    if at_run_time:
        return b.loops(oshape, point, inner_kind="serial", parallel=True)

    # Along the last two axes (H and W), the outputs whose windows lie inside run without
    # checks: a plane is up to 3 x 3 blocks, borders and inside, and only the border blocks
    # check and clamp their taps (before, every row checked H). Along W the inside loads are
    # affine (strided), so that stretch vectorizes. Threads divide the planes.
    def ranges(i: int) -> list:
        """(first, count, inside) runs of outputs along spatial axis i."""
        if not checked[i]:
            return [(0, oshape[2 + i], True)]
        lo, hi = inside(i)
        return [r for r in ((0, lo, False), (lo, hi - lo, True), (hi, oshape[2 + i] - hi, False)) if r[1]]
    tail = list(range(max(nsp - 2, 0), nsp))

    def plane(idx):
        stmts = []
        for runs in itertools.product(*(ranges(i) for i in tail)):
            names = [b.fresh("o") for _ in tail]
            inside_axes = frozenset(i for i, run in zip(tail, runs) if run[2])
            body = tuple(point(list(idx) + [add(Var(v), run[0]) for v, run in zip(names, runs)], inside_axes))
            # Inside, a row of stride 1 runs as whole vectors and one masked remainder (a
            # 28-wide row on AVX-512 had 10 scalar outputs of 26; strided loads masked would be
            # gathers, so a wider stride keeps a scalar remainder); every other loop stays
            # scalar (LLVM had vectorized a border column down H, with gathers and scatters).
            row_kind = "vector_masked" if strides[-1] == 1 else "vectorize"
            for j in reversed(range(len(tail))):
                last_inside = j == len(tail) - 1 and runs[j][2]
                body = (For(names[j], runs[j][1], body, row_kind if last_inside else "scalar"),)
            stmts += body
        return stmts
    return b.loops(oshape[:2 + tail[0]], plane, inner_kind="serial", parallel=True)


