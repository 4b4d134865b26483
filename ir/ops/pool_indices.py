"""MaxPool's Indices output and MaxUnpool: where each window's maximum was, and putting values
back there (SegNet's and ENet's decoders).

A MaxPool asked for its Indices becomes the pool itself (its fast kernel, ir/lower/pool.py) and
a `kiln.MaxPoolIndices` node beside it: per output, the first tap holding the window's maximum
(taps in the padding skipped), as the offset of that element in the whole input (row-major, or
with `storage_order` 1 its spatial part column-major), int64. MaxUnpool writes zeros, then
each value of X at the offset its index names in the shape the pool's input had (inferred
from the window), placed at that shape's top-left corner within `output_shape` where one is
given, as onnx's reference does; an offset outside is skipped.
"""
from __future__ import annotations

import itertools
import math

from ..attrs import check_attrs, const_input
from ..graph import ShapeError, TensorType, UnsupportedError
from ..loop import (Assign, Const, If, Let, Local, Store, Var, add, cmp, const, fbin, flat_index, lowest, mul, select,
                    unflatten)
from .conv_gemm import resolve_window
from .reduce import MAX_POOL_INDICES, pool_output_type
from .registry import OPAQUE, OpDef, register


def _static_input(g, node, what: str) -> None:
    x = g.types[node.inputs[0]]
    if not x.is_static:
        raise UnsupportedError(f"{node.describe()}: {what} of {x}, sizes known at run time only, is not supported "
                               "yet; fix those dims with --shape")


def _indices_infer(g, node, p):
    check_attrs(node, {"storage_order": (0, 1)})
    _static_input(g, node, "MaxPool's Indices")
    return TensorType(pool_output_type(g, node, p).shape, "int64")


def _indices_kernel(b, node):
    xs, os_ = b.shape(node.inputs[0]), b.shape(node.outputs[0])
    a = b.attrs(node)
    kernel, strides, dilations, pads = a["kernel_shape"], a["strides"], a["dilations"], a["pads"]
    spatial, n = xs[2:], len(xs) - 2
    x, out, t = b.reader(node.inputs[0]), b.out_param(node.outputs[0]), b.compute(node.inputs[0])
    # The offset of a spatial position: row-major, or (storage_order 1) the first axis fastest.
    order = range(n) if node.attrs.get("storage_order", 0) else range(n - 1, -1, -1)
    strides_of, step = [0] * n, 1
    for axis in order:
        strides_of[axis], step = step, step * spatial[axis]

    def point(idx):
        best, arg = b.fresh("best"), b.fresh("arg")
        stmts = [Local(best, t, const(lowest(t), t)), Local(arg, "i64", Const(-1))]
        plane = mul(add(mul(idx[0], xs[1]), idx[1]), math.prod(spatial))
        for taps in itertools.product(*(range(k) for k in kernel)):
            pos = [add(mul(idx[2 + i], strides[i]), Const(taps[i] * dilations[i] - pads[i])) for i in range(n)]
            inside = [fbin("and", cmp("ge", pos[i], Const(0)), cmp("lt", pos[i], Const(spatial[i]))) for i in range(n)]
            valid = inside[0]
            for c in inside[1:]:
                valid = fbin("and", valid, c)
            safe = [select(inside[i], pos[i], Const(0)) for i in range(n)]
            v, take = b.fresh("v"), b.fresh("take")
            # (the first tap inside the input counts even where it is -inf or NaN, as onnx's reference has it)
            takes = fbin("and", valid, fbin("or", cmp("lt", Var(arg), Const(0)), cmp("gt", Var(v, t), Var(best, t))))
            offset = add(plane, sum((mul(safe[i], strides_of[i]) for i in range(n)), Const(0)))
            stmts += [Let(v, x(list(idx[:2]) + safe)), Let(take, takes),
                      Assign(best, select(Var(take, "i1"), Var(v, t), Var(best, t))),
                      Assign(arg, select(Var(take, "i1"), offset, Var(arg)))]
        return stmts + [Store(out, flat_index(idx, os_), Var(arg))]
    return b.loops(os_, point, inner_kind="serial", parallel=True)


def _unpool_infer(g, node, p):
    _static_input(g, node, "MaxUnpool")
    x, i = g.types[node.inputs[0]], g.types[node.inputs[1]]
    kernel = list(node.attrs["kernel_shape"])
    n = len(kernel)
    if len(x.shape) != n + 2 or i.dtype != "int64" or i.shape != x.shape:
        raise ShapeError(f"{node.describe()}: X {x} and I {i} must be int64 indices of X's shape, "
                         f"[N, C] and {n} spatial dims")
    strides, _, pads = resolve_window(node, p, x.shape[2:], kernel)
    p["inferred"] = [(x.shape[2 + d] - 1) * strides[d] - pads[d] - pads[n + d] + kernel[d] for d in range(n)]
    shape = const_input(g, node, 2, "output_shape")
    shape = tuple(x.shape[:2]) + tuple(p["inferred"]) if shape is None else tuple(int(d) for d in shape)
    if len(shape) != n + 2 or min(shape) <= 0:
        raise ShapeError(f"{node.describe()}: output_shape {list(shape)} for X {x}")
    return TensorType(shape, x.dtype)


def _unpool_kernel(b, node):
    xs, os_ = b.shape(node.inputs[0]), b.shape(node.outputs[0])
    inferred = list(xs[:2]) + b.attrs(node)["inferred"]
    x, ind, out = b.reader(node.inputs[0]), b.reader(node.inputs[1]), b.out_param(node.outputs[0])
    t = b.compute(node.inputs[0])
    zero = b.loops(os_, lambda idx: [Store(out, flat_index(idx, os_), const(0, t))], parallel=True)

    def put(idx):
        at = b.fresh("at")
        where = unflatten(Var(at), inferred)
        fits = fbin("and", cmp("ge", Var(at), Const(0)), cmp("lt", Var(at), Const(math.prod(inferred))))
        for axis, size in enumerate(os_):
            if inferred[axis] > size:  # (an output_shape smaller than the pool's input drops what falls outside)
                fits = fbin("and", fits, cmp("lt", where[axis], Const(size)))
        return [Let(at, ind(idx)), If(fits, (Store(out, flat_index(where, os_), x(idx)),))]
    return tuple(zero) + tuple(b.loops(xs, put, inner_kind="serial"))


register(OpDef(MAX_POOL_INDICES, OPAQUE, _indices_infer, alone=_indices_kernel),
         OpDef("MaxUnpool", OPAQUE, _unpool_infer, alone=_unpool_kernel))
