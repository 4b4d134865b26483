"""Unique: the distinct elements of a tensor (or its distinct slices along an axis), sorted or
in the order they first appear, with each one's first index, each element's index among
them and each one's count. How many there are is counted while the model runs
(value_symbols.counted), like NonZero's count.

One kernel, on one thread: the items (elements, or slices compared lexicographically, as
numpy compares them) heap-sorted by value then index, grouped where neighbours differ, then
written out; in first-appearance order each group's place is its first item's rank among the
groups' first items (a scan in index order). NaN sorts last and equals NaN, as numpy's unique
has it.
"""
from __future__ import annotations

import math

from ..attrs import normalize_axis
from ..graph import Node, ShapeError, TensorType
from ..loop import (Assign, Cast, Const, For, If, Let, Load, Local, Store, Var, add, cmp, div, fbin, mul, rem, select,
                    sub, unflatten)
from ..lower.selection import sift_down
from ..symbolic import greatest, is_symbolic
from ..value_symbols import counted
from .registry import OPAQUE, OpDef, expanded_only, register

UNIQUE = "Unique"
COUNT_UNIQUE = "kiln.Unique"  # Unique's outputs, then the count of distinct items (the size the module reads)


def _expand_unique(g, node):
    outs = list(node.outputs) + [""] * (4 - len(node.outputs))
    return [Node(COUNT_UNIQUE, list(node.inputs), outs + [f"{node.key}/count"],
                 {**node.attrs, "size_name": f"unique({node.inputs[0]})"}, node.name)]


def _unique_infer(g, node, p):
    x = g.types[node.inputs[0]]
    if any(is_symbolic(d) for d in x.shape):
        raise ShapeError(f"{node.describe()}: Unique of {x}, whose sizes are known at run time only (give them "
                         "with `shapes`)")
    axis = node.attrs.get("axis")
    axis = None if axis is None else normalize_axis(axis, len(x.shape), node)
    items = x.size if axis is None else x.shape[axis]
    p["axis"] = axis
    n = counted(node.attrs["size_name"], node.outputs[4], greatest(items), f"{node.describe()}: its count of distinct "
                + ("elements" if axis is None else f"slices along axis {axis}"))
    values = (n,) if axis is None else x.shape[:axis] + (n,) + x.shape[axis + 1:]
    return [TensorType(values, x.dtype), TensorType((n,), "int64"), TensorType((items,), "int64"),
            TensorType((n,), "int64"), TensorType((), "int64")]


def _unique_kernel(b, node):
    a = b.attrs(node)
    shape, axis = b.shape(node.inputs[0]), a["axis"]
    x, t = b.reader(node.inputs[0]), b.compute(node.inputs[0])
    floats = t in ("f32", "f64")
    if axis is None:
        items, outer, inner = math.prod(shape), 1, 1
    else:
        items, outer, inner = shape[axis], math.prod(shape[:axis]), math.prod(shape[axis + 1:])
    length = outer * inner  # (elements of one item)
    params = [b.out_param(o) if o and o in b.g.types else None for o in node.outputs]
    values, firsts, inverse, counts, count = params
    order, group, first, size, place = (b.workspace(items, "i32") for _ in range(5))
    levels = max(items, 1).bit_length()

    def element(item, l):  # (element l of an item, in C order over the other dims)
        if axis is None:
            return x(unflatten(item, shape))
        flat = add(mul(add(mul(div(l, inner), Const(items)), item), Const(inner)), rem(l, inner))
        return x(unflatten(flat, shape))

    def compare(p, q, res: str) -> list:
        """res := -1, 0 or 1 as item p sorts before, with, or after item q."""
        l, u, v = b.fresh("l"), b.fresh("u"), b.fresh("v")
        order_of = select(cmp("lt", Var(u, t), Var(v, t)), Const(-1), select(cmp("gt", Var(u, t), Var(v, t)),
                                                                               Const(1), Const(0)))
        if floats:  # (NaN after every number, and equal to NaN)
            nan_u, nan_v = cmp("ne", Var(u, t), Var(u, t)), cmp("ne", Var(v, t), Var(v, t))
            order_of = select(nan_u, select(nan_v, Const(0), Const(1)), select(nan_v, Const(-1), order_of))
        return [Assign(res, Const(0)), For(l, length, (If(cmp("eq", Var(res), Const(0)), (
            Let(u, element(p, Var(l))), Let(v, element(q, Var(l))), Assign(res, order_of))),))]

    def entry(pos):
        return Cast("i64", Load(order, pos))

    def greater(p, q):  # (item p after item q in sorted order: above it in the max-heap that sorts them)
        res = b.fresh("res")
        return [Local(res, "i64", Const(0)), *compare(p, q, res)], fbin("or", cmp("gt", Var(res), Const(0)), fbin(
            "and", cmp("eq", Var(res), Const(0)), cmp("gt", p, q)))

    def sift(start, heap_size) -> list:
        return sift_down(b, order, heap_size, start, greater, levels)

    i, h, e, s, u, res, k = (b.fresh(v) for v in ("i", "h", "e", "s", "u", "res", "k"))
    last = sub(Const(items - 1), Var(e))
    sort = [For(i, items, (Store(order, Var(i), Cast("i32", Var(i))),)),
            For(h, items // 2, tuple(sift(sub(Const(items // 2 - 1), Var(h)), Const(items)))),
            For(e, items - 1, (Let(k, Load(order, last)), Store(order, last, Load(order, Const(0))),
                               Store(order, Const(0), Var(k, "i32")), *sift(Const(0), last)))]
    # Groups of equal neighbours in sorted order: the first item of each is its lowest index.
    item = entry(Var(s))
    start_group = [Assign(u, add(Var(u), Const(1))), Store(first, Var(u), Cast("i32", item)),
                   Store(size, Var(u), Const(0, "i32"))]
    grouping = [Local(u, "i64", Const(-1)), Local(res, "i64", Const(1)),
                For(s, items, (*([] if items < 2 else [If(cmp("gt", Var(s), Const(0)),
                                                          tuple(compare(item, entry(sub(Var(s), Const(1))), res)))]),
                               If(fbin("or", cmp("eq", Var(s), Const(0)), cmp("ne", Var(res), Const(0))),
                                  tuple(start_group)),
                               Store(size, Var(u), add(Load(size, Var(u)), Const(1, "i32"))),
                               Store(group, item, Cast("i32", Var(u)))))]
    groups = add(Var(u), Const(1))
    # Each group's place: its own (sorted), or its first item's rank in index order.
    if a.get("sorted", 1):
        placing = [For(i, groups, (Store(place, Var(i), Cast("i32", Var(i))),))]
    else:
        nxt = b.fresh("next")
        mine = Cast("i64", Load(group, Var(i)))
        placing = [Local(nxt, "i64", Const(0)),
                   For(i, items, (If(cmp("eq", Cast("i64", Load(first, mine)), Var(i)), (
                       Store(place, mine, Cast("i32", Var(nxt))), Assign(nxt, add(Var(nxt), Const(1))))),))]
    where = Cast("i64", Load(place, Var(i)))
    of = Cast("i64", Load(first, Var(i)))
    writes = []
    if values:
        l = b.fresh("l")
        at = Var(l) if axis is None else add(mul(add(mul(div(Var(l), inner), groups), where), Const(inner)),
                                             rem(Var(l), inner))
        spot = where if axis is None else at
        writes.append(For(l, length, (Store(values, spot, element(of, Var(l))),)))
    if firsts:
        writes.append(Store(firsts, where, of))
    if counts:
        writes.append(Store(counts, where, Cast("i64", Load(size, Var(i)))))
    body = [*sort, *grouping, *placing, For(i, groups, tuple(writes))]
    if inverse:
        own_group = Cast("i64", Load(group, Var(i)))
        body.append(For(i, items, (Store(inverse, Var(i), Cast("i64", Load(place, own_group))),)))
    if count:
        body.append(Store(count, Const(0), groups))
    return body


register(
    OpDef(UNIQUE, OPAQUE, expanded_only, expand=_expand_unique),
    OpDef(COUNT_UNIQUE, OPAQUE, _unique_infer, alone=_unique_kernel),
)
