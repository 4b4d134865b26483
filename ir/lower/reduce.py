"""Reductions and windows: Reduce*, global pools, Softmax, LayerNormalization, pooling.

Each writes its own loop nest: outer loops over the points it produces, inner loops over
what it reduces (innermost, so contiguous reductions vectorize: float ops carry reassoc).
`store(idx, value)` returns the statements that apply the group's epilogue to `value` and
write it at output index `idx`.
"""
from __future__ import annotations

import math

from ..graph import Node
from ..loop import Assign, Const, Let, Load, Local, Store, Var, add, call, cmp, fbin, flat_index, mul, select, sub
from .builder import KernelBuilder, broadcast_index

_INIT = {"sum": 0.0, "mean": 0.0, "max": -math.inf}


def _f(v) -> Const:
    return Const(float(v), "f32")


def _merge(rank, outer_axes, outer_idx, inner_axes, inner_idx) -> list:
    full = [None] * rank
    for a, i in zip(outer_axes, outer_idx):
        full[a] = i
    for a, i in zip(inner_axes, inner_idx):
        full[a] = i
    return full


def _accumulate(b: KernelBuilder, shape, axes, body_fn) -> tuple:
    """Loops over the reduced axes (serial except the innermost, left to the vectorizer)."""
    return b.loops([shape[a] for a in axes], body_fn)


def lower_reduce(b: KernelBuilder, node: Node, store, kind: str) -> tuple:
    """kind: sum, mean or max over the node's parameter axes."""
    x, xshape = b.reader(node.inputs[0]), b.shape(node.inputs[0])
    axes, keep = b.attrs(node)["axes"], b.attrs(node)["keepdims"]
    rank = len(xshape)
    kept = [a for a in range(rank) if a not in axes]
    oshape = b.shape(node.outputs[0])
    count = math.prod(xshape[a] for a in axes)
    is_int = b.type(node.inputs[0]).dtype == "int64"

    def point(oidx):
        outer = [oidx[a] for a in kept] if keep else list(oidx)
        acc = b.fresh("acc")
        init = Const(-(2 ** 62) if kind == "max" else 0) if is_int else _f(_INIT[kind])
        op = "max" if kind == "max" else "add"
        body = [Local(acc, "i64" if is_int else "f32", init)]
        body += _accumulate(b, xshape, axes, lambda iidx: [
            Assign(acc, fbin(op, Var(acc, "i64" if is_int else "f32"), x(_merge(rank, kept, outer, axes, iidx))))])
        value = Var(acc, "i64" if is_int else "f32")
        if kind == "mean":
            value = fbin("mul", value, _f(1 / count)) if not is_int else fbin("div", value, Const(count))
        return body + list(store(oidx, value))

    return b.loops(oshape, point, inner_kind="serial")


def _select_max(acc, x):
    return select(cmp("gt", acc, x), acc, x)


def lower_softmax(b: KernelBuilder, node: Node, store, out_param: str) -> tuple:
    x, xshape = b.reader(node.inputs[0]), b.shape(node.inputs[0])
    axes = b.attrs(node)["axes"]
    rank = len(xshape)
    outer_axes = [a for a in range(rank) if a not in axes]

    def row(oidx):
        mx, sm, inv = b.fresh("max"), b.fresh("sum"), b.fresh("inv")
        full = lambda iidx: _merge(rank, outer_axes, oidx, axes, iidx)
        body = [Local(mx, "f32", _f(-math.inf))]
        # The row maximum only keeps exp() in range: a NaN in the row makes every output NaN
        # through exp and the sum whatever the maximum is, so a plain select reduction will
        # do (it vectorizes; the NaN-propagating max does not).
        body += _accumulate(b, xshape, axes, lambda iidx: [Assign(mx, _select_max(Var(mx, "f32"), x(full(iidx))))])
        body.append(Local(sm, "f32", _f(0)))

        def exp_pass(iidx):
            e = b.fresh("e")
            at = flat_index(full(iidx), xshape)
            return [Let(e, call("exp", fbin("sub", x(full(iidx)), Var(mx, "f32")))), Store(out_param, at, Var(e, "f32")),
                    Assign(sm, fbin("add", Var(sm, "f32"), Var(e, "f32")))]
        body += _accumulate(b, xshape, axes, exp_pass)
        body.append(Let(inv, fbin("div", _f(1), Var(sm, "f32"))))
        body += _accumulate(b, xshape, axes, lambda iidx: store(
            full(iidx), fbin("mul", Load(out_param, flat_index(full(iidx), xshape)), Var(inv, "f32"))))
        return body

    return b.loops([xshape[a] for a in outer_axes], row, inner_kind="serial")


def lower_layernorm(b: KernelBuilder, node: Node, store) -> tuple:
    x, xshape = b.reader(node.inputs[0]), b.shape(node.inputs[0])
    axes = b.attrs(node)["axes"]
    rank = len(xshape)
    outer_axes = [a for a in range(rank) if a not in axes]
    n = math.prod(xshape[a] for a in axes)
    eps = _f(node.attrs.get("epsilon", 1e-5))
    scale, sshape = b.reader(node.inputs[1]), b.shape(node.inputs[1])
    has_bias = len(node.inputs) > 2 and node.inputs[2]
    bias, bshape = (b.reader(node.inputs[2]), b.shape(node.inputs[2])) if has_bias else (None, None)
    # Optional outputs 1 and 2: the mean and 1/std of each normalized row.
    stats = [(b.out_param(o), b.shape(o)) if o else None for o in (node.outputs[1:3] + ["", ""])[:2]]

    def row(oidx):
        s, mean, v, rstd = b.fresh("s"), b.fresh("mean"), b.fresh("var"), b.fresh("rstd")
        full = lambda iidx: _merge(rank, outer_axes, oidx, axes, iidx)
        body = [Local(s, "f32", _f(0))]
        body += _accumulate(b, xshape, axes, lambda iidx: [Assign(s, fbin("add", Var(s, "f32"), x(full(iidx))))])
        body += [Let(mean, fbin("mul", Var(s, "f32"), _f(1 / n))), Local(v, "f32", _f(0))]

        def sq(iidx):
            d = fbin("sub", x(full(iidx)), Var(mean, "f32"))
            return [Assign(v, fbin("add", Var(v, "f32"), fbin("mul", d, d)))]
        body += _accumulate(b, xshape, axes, sq)
        body.append(Let(rstd, fbin("div", _f(1), call("sqrt", fbin("add", fbin("mul", Var(v, "f32"), _f(1 / n)), eps)))))
        for stat, var in zip(stats, (mean, rstd)):
            if stat is not None:
                param, shape = stat
                body.append(Store(param, flat_index(full([Const(0)] * len(axes)), shape), Var(var, "f32")))

        def write(iidx):
            f = full(iidx)
            y = fbin("mul", fbin("mul", fbin("sub", x(f), Var(mean, "f32")), Var(rstd, "f32")),
                     scale(broadcast_index(f, xshape, sshape)))
            if has_bias:
                y = fbin("add", y, bias(broadcast_index(f, xshape, bshape)))
            return store(f, y)
        body += _accumulate(b, xshape, axes, write)
        return body

    return b.loops([xshape[a] for a in outer_axes], row, inner_kind="serial")


def lower_pool(b: KernelBuilder, node: Node, store, is_max: bool) -> tuple:
    x, xshape = b.reader(node.inputs[0]), b.shape(node.inputs[0])
    oshape = b.shape(node.outputs[0])
    a = b.attrs(node)
    kernel, strides, dil, pads = a["kernel_shape"], a["strides"], a["dilations"], a["pads"]
    nsp = len(kernel)
    spatial = xshape[2:]
    include_pad = a.get("count_include_pad", 0)
    # Windows that can never leave the input need no bounds checks.
    checked = any(pads) or any((oshape[2 + i] - 1) * strides[i] + (kernel[i] - 1) * dil[i] >= spatial[i]
                               for i in range(nsp))

    def point(oidx):
        acc, cnt = b.fresh("acc"), b.fresh("cnt")
        body = [Local(acc, "f32", _f(-math.inf if is_max else 0)), Local(cnt, "f32", _f(0))]

        def tap(kidx):
            src, ok, in_pad = list(oidx[:2]), None, None
            for i in range(nsp):
                pos = add(sub(mul(oidx[2 + i], strides[i]), pads[i]), mul(kidx[i], dil[i]))
                if checked:
                    inside = fbin("and", cmp("ge", pos, Const(0)), cmp("lt", pos, Const(spatial[i])))
                    padded = fbin("and", cmp("ge", pos, Const(-pads[i])),
                                  cmp("lt", pos, Const(spatial[i] + pads[nsp + i])))
                    ok = inside if ok is None else fbin("and", ok, inside)
                    in_pad = padded if in_pad is None else fbin("and", in_pad, padded)
                    pos = fbin("min", fbin("max", pos, Const(0)), Const(spatial[i] - 1))
                src.append(pos)
            v = x(src)
            if is_max:
                v = select(ok, v, _f(-math.inf)) if ok is not None else v
                return [Assign(acc, fbin("max", Var(acc, "f32"), v))]
            stmts = [Assign(acc, fbin("add", Var(acc, "f32"), select(ok, v, _f(0)) if ok is not None else v))]
            counted = (in_pad if include_pad else ok)
            one = select(counted, _f(1), _f(0)) if counted is not None else _f(1)
            return stmts + [Assign(cnt, fbin("add", Var(cnt, "f32"), one))]

        body += b.loops(kernel, tap, inner_kind="unroll")
        value = Var(acc, "f32") if is_max else fbin("div", Var(acc, "f32"), Var(cnt, "f32"))
        return body + list(store(oidx, value))

    return b.loops(oshape, point, inner_kind="serial")
