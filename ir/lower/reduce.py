"""Reductions: Reduce*, global pools, Softmax, LayerNormalization (windows: pool.py).

Each writes its own loop nest: outer loops over the points it produces, inner loops over
what it reduces (innermost, so contiguous reductions vectorize: float ops carry reassoc).
`store(idx, value)` returns the statements that apply the group's epilogue to `value` and
write it at output index `idx`.
"""
from __future__ import annotations

import math

from ..graph import Node
from ..loop import (Assign, Cast, Const, Expr, For, If, Let, Load, Local, Store, Var, call, cmp, fbin, flat_index,
                    highest, lowest, select, sub, unflatten)
from ..schedule import CODEGEN_OPTIONS, REDUCE_INTERLEAVE
from .builder import KernelBuilder, broadcast_index

# How each reduction kind starts, combines its elements and finishes.
_COMBINE = {"sum": "add", "mean": "add", "max": "max", "min": "min", "prod": "mul", "l1": "add", "l2": "add",
            "sumsquare": "add", "logsum": "add", "logsumexp": "add"}
FLOAT_ONLY_REDUCTIONS = ("l2", "logsum", "logsumexp")


def _init(kind: str, t: str):
    return lowest(t) if kind == "max" else highest(t) if kind == "min" else 1 if kind == "prod" else 0


def _f(v) -> Const:
    return Const(float(v), "f32")


def literal(v) -> Const:
    """A literal of v's own kind (it takes its siblings' type where it is used)."""
    return Const(v, "f32") if isinstance(v, float) else Const(int(v), "i64")


def abs_value(x, t: str):
    if t in ("f32", "f64"):
        return call("abs", x)
    return x if t[0] == "u" else select(cmp("lt", x, Const(0)), sub(Const(0), x), x)


def _merge(rank, outer_axes, outer_idx, inner_axes, inner_idx) -> list:
    full = [None] * rank
    for a, i in zip(outer_axes, outer_idx):
        full[a] = i
    for a, i in zip(inner_axes, inner_idx):
        full[a] = i
    return full


def _accumulate(b: KernelBuilder, shape, axes, body_fn) -> tuple:
    """Loops over the reduced axes (serial except the innermost, vectorized with several
    partial results in flight: one chain of vector max or add waits on each step's latency)."""
    b.knob("reduce_interleave", REDUCE_INTERLEAVE, CODEGEN_OPTIONS["reduce_interleave"])
    extents = [shape[a] for a in axes]
    if len(axes) > 1 and list(axes) == list(range(len(shape) - len(axes), len(shape))):
        # Trailing axes, contiguous in memory: one loop over all of them. As a loop per axis,
        # a global pool over 28x28 summed each row of 28 apart, a horizontal sum per row
        # (120x28x28 took 3.5x OpenVINO's time; over run-time sizes, 320x7x7 took 12x its
        # static time). Over run-time sizes too: the index's division by the row length
        # folds away (loop.add's refolding).
        f = b.fresh("f")
        return (For(f, math.prod(extents), tuple(body_fn(unflatten(Var(f), extents))), "reduce"),)
    return b.loops(extents, body_fn, inner_kind="reduce")


def lower_reduce(b: KernelBuilder, node: Node, store, kind: str) -> tuple:
    """kind: one of _COMBINE, over the node's parameter axes."""
    x, xshape = b.reader(node.inputs[0]), b.shape(node.inputs[0])
    axes, keep = b.attrs(node)["axes"], b.attrs(node)["keepdims"]
    rank = len(xshape)
    kept = [a for a in range(rank) if a not in axes]
    oshape = b.shape(node.outputs[0])
    count = math.prod(xshape[a] for a in axes)
    t = b.compute(node.inputs[0])
    prep = {"l1": lambda v: abs_value(v, t), "l2": lambda v: fbin("mul", v, v),
            "sumsquare": lambda v: fbin("mul", v, v)}.get(kind, lambda v: v)

    def point(oidx):
        outer = [oidx[a] for a in kept] if keep else list(oidx)
        at = lambda iidx: x(_merge(rank, kept, outer, axes, iidx))  # noqa: E731
        acc, body = b.fresh("acc"), []
        if kind == "logsumexp":  # log(sum(exp(x - max))) + max: no overflow for large x
            top = b.fresh("top")
            body += [Local(top, t, literal(lowest(t)))]
            body += _accumulate(b, xshape, axes, lambda iidx: [Assign(top, fbin("max", Var(top, t), at(iidx)))])
            prep_ = lambda v: call("exp", fbin("sub", v, Var(top, t)))  # noqa: E731
        else:
            prep_ = prep
        body.append(Local(acc, t, literal(_init(kind, t))))
        body += _accumulate(b, xshape, axes, lambda iidx: [
            Assign(acc, fbin(_COMBINE[kind], Var(acc, t), prep_(at(iidx))))])
        value = Var(acc, t)
        if kind == "mean" and isinstance(count, Expr):  # (a count known at run time)
            value = fbin("div", value, Cast(t, count))
        elif kind == "mean":
            value = fbin("mul", value, _f(1 / count)) if t in ("f32", "f64") else fbin("div", value, Const(count))
        elif kind == "l2":
            value = call("sqrt", value)
        elif kind == "logsum":
            value = call("log", value)
        elif kind == "logsumexp":
            # An all -inf row has max -inf: log(0) + -inf is the right -inf, not NaN from inf - inf.
            value = select(cmp("eq", Var(top, t), _f(-math.inf)), Var(top, t),
                           fbin("add", call("log", value), Var(top, t)))
        return body + list(store(oidx, value))

    return b.loops(oshape, point, inner_kind="serial", parallel=True)


def lower_softmax(b: KernelBuilder, node: Node, store, out_param: str, log: bool = False) -> tuple:
    """Softmax (or LogSoftmax) over the parameter axes: a max pass, an exp-sum pass, a write."""
    t = b.compute(node.inputs[0])  # f32, or f64
    x, xshape = b.reader(node.inputs[0]), b.shape(node.inputs[0])
    axes = b.attrs(node)["axes"]
    rank = len(xshape)
    outer_axes = [a for a in range(rank) if a not in axes]
    # The exps wait in the group's output buffer when it holds them as well as `t` does (a
    # float16 buffer computes in f32 too). An epilogue that quantizes or casts to integers
    # leaves a buffer that would round every exp in (0, 1] to 0 or 1: then the normalize
    # pass computes each exp again instead.
    held = b.compute(b.outputs[int(out_param[1:])]) == t

    def row(oidx):
        mx, sm, inv = b.fresh("max"), b.fresh("sum"), b.fresh("inv")
        full = lambda iidx: _merge(rank, outer_axes, oidx, axes, iidx)
        body = [Local(mx, t, _f(-math.inf))]
        # The row maximum only keeps exp() in range: a NaN in the row makes every output NaN
        # through exp and the sum whatever the maximum is, so it needs no NaN fix-ups. With
        # them (llvm.maximum) each step was five dependent instructions, and the max pass 70%
        # of the kernel: rows of 128 took 2x onnxruntime's time, 1x without. (A select-max
        # LLVM left as a scalar chain.)
        body += _accumulate(b, xshape, axes, lambda iidx: [Assign(mx, call("max_no_nan", Var(mx, t),
                                                                             x(full(iidx))))])
        body.append(Local(sm, t, _f(0)))
        if log:  # x - max - log(sum(exp(x - max)))
            body += _accumulate(b, xshape, axes, lambda iidx: [Assign(sm, fbin("add", Var(sm, t), call(
                "exp", fbin("sub", x(full(iidx)), Var(mx, t)))))])
            body.append(Let(inv, fbin("add", Var(mx, t), call("log", Var(sm, t)))))
            body += _accumulate(b, xshape, axes, lambda iidx: store(full(iidx), fbin("sub", x(full(iidx)),
                                                                                      Var(inv, t))))
            return body

        def exp_of(iidx):
            return call("exp", fbin("sub", x(full(iidx)), Var(mx, t)))

        def exp_pass(iidx):
            if not held:
                return [Assign(sm, fbin("add", Var(sm, t), exp_of(iidx)))]
            e = b.fresh("e")
            return [Let(e, exp_of(iidx)), Store(out_param, flat_index(full(iidx), xshape), Var(e, t)),
                    Assign(sm, fbin("add", Var(sm, t), Var(e, t)))]
        body += _accumulate(b, xshape, axes, exp_pass)
        body.append(Let(inv, fbin("div", _f(1), Var(sm, t))))

        def normalize(iidx):
            e = Load(out_param, flat_index(full(iidx), xshape)) if held else exp_of(iidx)
            return store(full(iidx), fbin("mul", e, Var(inv, t)))
        body += _accumulate(b, xshape, axes, normalize)
        return body

    return b.loops([xshape[a] for a in outer_axes], row, inner_kind="serial", parallel=True)


def lower_hardmax(b: KernelBuilder, node: Node, store) -> tuple:
    """1 at the first maximum over the parameter axes, 0 elsewhere."""
    t = b.compute(node.inputs[0])
    x, xshape = b.reader(node.inputs[0]), b.shape(node.inputs[0])
    axes = b.attrs(node)["axes"]
    rank = len(xshape)
    outer_axes = [a for a in range(rank) if a not in axes]
    inner = [xshape[a] for a in axes]

    def row(oidx):
        best, at = b.fresh("best"), b.fresh("at")
        full = lambda iidx: _merge(rank, outer_axes, oidx, axes, iidx)
        body = [Local(best, t, literal(lowest(t))), Local(at, "i64", Const(-1))]

        def scan(iidx):
            v, pos = x(full(iidx)), flat_index(iidx, inner)
            wins = fbin("or", cmp("gt", v, Var(best, t)), cmp("lt", Var(at, "i64"), Const(0)))
            return [If(wins, (Assign(best, v), Assign(at, pos)))]
        body += b.loops(inner, scan, inner_kind="serial")
        body += _accumulate(b, xshape, axes, lambda iidx: store(full(iidx), select(
            cmp("eq", flat_index(iidx, inner), Var(at, "i64")), _f(1), _f(0))))
        return body

    return b.loops([xshape[a] for a in outer_axes], row, inner_kind="serial", parallel=True)


def lower_normalize(b: KernelBuilder, node: Node, store, shape, axes, x_at, out_at, eps: float, center: bool = True,
                    affine=None, stats=(), eps_after_sqrt: bool = False) -> tuple:
    """(x - mean) / sqrt(var + eps) over `axes` of `shape` (the normalized view of the input:
    x_at reads it, out_at maps its index to the output's), or x / sqrt(mean(x^2) + eps)
    without `center` (RMSNorm); then affine(index, y) (scale and bias). `stats` are
    (param, shape, compute type) of optional outputs for the mean and 1/std of each row."""
    t = b.compute(node.inputs[0])  # f32, or f64
    rank = len(shape)
    outer_axes = [a for a in range(rank) if a not in axes]
    n = math.prod(shape[a] for a in axes)
    count = Cast(t, n) if isinstance(n, Expr) else _f(n)  # (a count known at run time: the sizes')

    def row(oidx):
        s, mean, v, rstd = b.fresh("s"), b.fresh("mean"), b.fresh("var"), b.fresh("rstd")
        full = lambda iidx: _merge(rank, outer_axes, oidx, axes, iidx)
        body = []
        if center:
            # The mean as the row's first value plus the mean of the differences from it: a
            # constant row (a clipped or padded one) then centers to exact zeros, where a
            # rounded sum left ulps that 1/sqrt(eps) magnified 316-fold; other rows lose less
            # to cancellation too.
            first = b.fresh("x0")
            body.append(Let(first, x_at(full([Const(0)] * len(axes)))))
            body.append(Local(s, t, _f(0)))
            body += _accumulate(b, shape, axes, lambda iidx: [
                Assign(s, fbin("add", Var(s, t), fbin("sub", x_at(full(iidx)), Var(first, t))))])
            body.append(Let(mean, fbin("add", Var(first, t), fbin("div", Var(s, t), count))))
        centered = (lambda f: fbin("sub", x_at(f), Var(mean, t))) if center else x_at
        body.append(Local(v, t, _f(0)))

        def sq(iidx):
            d = centered(full(iidx))
            return [Assign(v, fbin("add", Var(v, t), fbin("mul", d, d)))]
        body += _accumulate(b, shape, axes, sq)
        var = fbin("div", Var(v, t), count)
        std = fbin("add", call("sqrt", var), _f(eps)) if eps_after_sqrt else call("sqrt", fbin("add", var, _f(eps)))
        body.append(Let(rstd, fbin("div", _f(1), std)))
        for stat, var in zip(stats, (mean, rstd)):
            if stat is not None:
                param, sshape, st = stat
                value = Var(var, t) if st == t else Cast(st, Var(var, t))
                body.append(Store(param, flat_index(out_at(full([Const(0)] * len(axes))), sshape), value))

        def write(iidx):
            f = full(iidx)
            y = fbin("mul", centered(f), Var(rstd, t))
            return store(out_at(f), affine(f, y) if affine else y)
        body += _accumulate(b, shape, axes, write)
        return body

    return b.loops([shape[a] for a in outer_axes], row, inner_kind="serial", parallel=True)


def lower_layernorm(b: KernelBuilder, node: Node, store, center: bool = True) -> tuple:
    """LayerNormalization (center) and RMSNormalization: scale and bias broadcast over x."""
    x, xshape = b.reader(node.inputs[0]), b.shape(node.inputs[0])
    scale, sshape = b.reader(node.inputs[1]), b.shape(node.inputs[1])
    has_bias = len(node.inputs) > 2 and node.inputs[2]
    bias, bshape = (b.reader(node.inputs[2]), b.shape(node.inputs[2])) if has_bias else (None, None)
    # Optional outputs 1 and 2: the mean and 1/std of each normalized row.
    stats = [(b.out_param(o), b.shape(o), b.compute(o)) if o else None
             for o in (node.outputs[1:3] + ["", ""])[:2]] if center else []

    def affine(f, y):
        y = fbin("mul", y, scale(broadcast_index(f, xshape, sshape)))
        return fbin("add", y, bias(broadcast_index(f, xshape, bshape))) if has_bias else y
    return lower_normalize(b, node, store, xshape, b.attrs(node)["axes"], x, lambda f: f,
                           node.attrs.get("epsilon", 1e-5), center, affine, stats)


def lower_lp_normalize(b: KernelBuilder, node: Node, store) -> tuple:
    """x / ||x||_p along one axis, p = 1 or 2."""
    t = b.compute(node.inputs[0])
    x, xshape = b.reader(node.inputs[0]), b.shape(node.inputs[0])
    axes, p = b.attrs(node)["axes"], node.attrs.get("p", 2)
    rank = len(xshape)
    outer_axes = [a for a in range(rank) if a not in axes]

    def row(oidx):
        acc, inv = b.fresh("acc"), b.fresh("inv")
        full = lambda iidx: _merge(rank, outer_axes, oidx, axes, iidx)

        def term(iidx):
            v = x(full(iidx))
            return [Assign(acc, fbin("add", Var(acc, t), abs_value(v, t) if p == 1 else fbin("mul", v, v)))]
        norm = Var(acc, t) if p == 1 else call("sqrt", Var(acc, t))
        # An all-zero line stays zero (opset 22), not 0/0.
        inv_norm = select(cmp("eq", Var(acc, t), _f(0)), _f(0), fbin("div", _f(1), norm))
        return [Local(acc, t, _f(0)), *_accumulate(b, xshape, axes, term), Let(inv, inv_norm),
                *_accumulate(b, xshape, axes, lambda iidx: store(full(iidx), fbin("mul", x(full(iidx)),
                                                                                     Var(inv, t))))]
    return b.loops([xshape[a] for a in outer_axes], row, inner_kind="serial", parallel=True)
