"""Ops whose output sizes depend on their inputs' values: NonZero, Compress built on it, and
NonMaxSuppression.

Their size is a *counted* symbol (value_symbols.counted): kiln.NonZero's kernel counts the
elements and writes the count to an int64 scalar it also outputs, the entry reads it after
that kernel, and everything after reads the size like any run-time size; memory is planned
and the caller's outputs allocated at its greatest (every element nonzero). On constants
NonZero folds to a constant as numpy computes it.
"""
from __future__ import annotations

import numpy as np

from ..graph import Node, ShapeError, TensorType
from ..loop import Assign, Cast, Const, For, If, Load, Local, Store, Var, add, cmp, fbin, mul
from ..symbolic import greatest, require_equal
from ..value_symbols import counted
from .node_builder import NodeBuilder
from .registry import OPAQUE, OpDef, expanded_only, register
from .shape import GATHER, RESHAPE

NONZERO = "NonZero"
# x -> (indices [rank, n], n as an int64 scalar): NonZero's value and the count the module reads
COUNT_NONZERO = "kiln.NonZero"
NON_MAX_SUPPRESSION = "NonMaxSuppression"
# NonMaxSuppression's inputs -> (selected [n, 3], n as an int64 scalar)
COUNT_NON_MAX_SUPPRESSION = "kiln.NonMaxSuppression"


def _rank_checked(g, node):
    x = g.types[node.inputs[0]]
    if not x.shape:
        raise ShapeError(f"{node.describe()}: a scalar input {x} has no dims to index (give it shape [1])")
    return x


def _nonzero_folded(g, node, p):
    """NonZero left as it is: its input is a constant, so its count is known now."""
    x = _rank_checked(g, node)
    return TensorType((len(x.shape), int(np.count_nonzero(g.constants[node.inputs[0]]))), "int64")


def _nonzero_fold(a, values, g, node):
    return [np.array(np.nonzero(values[0]), dtype=np.int64).reshape(values[0].ndim, -1)]


def _expand_nonzero(g, node):
    if node.inputs[0] in g.constants:
        return None
    # (the size is named after the input: twins, one count once CSE merges them, agree before it)
    return [Node(COUNT_NONZERO, [node.inputs[0]], [node.outputs[0], f"{node.key}/count"],
                 {"size_name": f"nonzero({node.inputs[0]})"}, node.name)]


def _count_nonzero_infer(g, node, p):
    x = _rank_checked(g, node)
    n = counted(node.attrs["size_name"], node.outputs[1], greatest(x.size),
                f"{node.describe()}: the count of nonzero elements")
    return [TensorType((len(x.shape), n), "int64"), TensorType((), "int64")]


def _count_nonzero_kernel(b, node):
    """Two passes in the input's order: count, then write each nonzero element's index down
    its column (the output is [rank, count], row-major, so the count is its row stride)."""
    x, xs = b.reader(node.inputs[0]), b.shape(node.inputs[0])
    out = b.out_param(node.outputs[0])
    # (no count where nothing reads it: a twin of a NonZero whose count the module reads)
    count = b.out_param(node.outputs[1]) if node.outputs[1] in b.g.types else None
    n, k = b.fresh("n"), b.fresh("k")

    def nonzero(idx):
        return cmp("ne", x(idx), Const(0))  # (NaN is nonzero: "ne" is unordered for floats)

    def tally(idx):
        return [If(nonzero(idx), (Assign(n, add(Var(n), Const(1))),))]

    def write(idx):
        stores = tuple(Store(out, add(mul(Const(axis), Var(n)), Var(k)), i) for axis, i in enumerate(idx))
        return [If(nonzero(idx), stores + (Assign(k, add(Var(k), Const(1))),))]
    return [Local(n, "i64", Const(0)), *b.loops(xs, tally, inner_kind="serial"),
            Local(k, "i64", Const(0)), *b.loops(xs, write, inner_kind="serial"),
            *([Store(count, Const(0), Var(n))] if count else [])]


def _expand_compress(g, node):
    """Compress(data, condition, axis) = Gather(data, NonZero(condition) as a vector, axis),
    over the flattened data where axis is absent."""
    nb = NodeBuilder(g, node)
    data, condition = node.inputs[:2]
    axis = node.attrs.get("axis")
    if axis is None:
        data, axis = nb.add(RESHAPE, [data, nb.const(np.array([-1], np.int64))]), 0
    if len(g.types[condition].shape) != 1:
        raise ShapeError(f"{node.describe()}: condition {g.types[condition]} must be a vector")
    where = nb.add(NONZERO, [condition], f"{node.outputs[0]}/kept")
    nb.add(GATHER, [data, nb.add(RESHAPE, [where, nb.const(np.array([-1], np.int64))])], node.outputs[0], axis=axis)
    return nb.nodes


# ---- NonMaxSuppression --------------------------------------------------------------------------

def _with_count(g, node, op: str, attrs: dict) -> list:
    """The node as `op`, which also outputs the count of its rows (the size the module reads)."""
    return [Node(op, list(node.inputs), [node.outputs[0], f"{node.key}/count"], attrs, node.name)]


def _expand_nms(g, node):
    return _with_count(g, node, COUNT_NON_MAX_SUPPRESSION, {**node.attrs, "size_name": f"selected({node.outputs[0]})"})


def _nms_infer(g, node, p):
    boxes, scores = g.types[node.inputs[0]], g.types[node.inputs[1]]
    if len(boxes.shape) != 3 or boxes.shape[2] != 4 or len(scores.shape) != 3:
        raise ShapeError(f"{node.describe()}: boxes {boxes} must be [batches, boxes, 4] and scores {scores} "
                         "[batches, classes, boxes]")
    require_equal(boxes.shape[0], scores.shape[0], f"{node.describe()}: batches of boxes and scores")
    require_equal(boxes.shape[1], scores.shape[2], f"{node.describe()}: boxes and scores per class")
    if node.attrs.get("center_point_box", 0) not in (0, 1):
        raise ShapeError(f"{node.describe()}: center_point_box must be 0 or 1")
    per_class = greatest(boxes.shape[1])
    if len(node.inputs) > 2 and node.inputs[2] in g.constants:  # (a bound on the rows: usually a constant)
        per_class = min(per_class, max(int(g.constants[node.inputs[2]].reshape(-1)[0]), 0))
    elif len(node.inputs) < 3 or not node.inputs[2]:
        per_class = 0  # (no max_output_boxes_per_class: ONNX's default, none)
    n = counted(node.attrs["size_name"], node.outputs[1], greatest(scores.shape[0] * scores.shape[1]) * per_class,
                f"{node.describe()}: the count of boxes selected")
    return [TensorType((n, 3), "int64"), TensorType((), "int64")]


def _corners(box: list, center: bool) -> tuple:
    """(y_min, x_min, y_max, x_max) of a box as ONNX gives it: two opposite corners in either
    order ([y1, x1, y2, x2]), or [x_center, y_center, width, height]."""
    if center:
        x, y, w, h = box
        return (fbin("sub", y, fbin("mul", h, Const(0.5))), fbin("sub", x, fbin("mul", w, Const(0.5))),
                fbin("add", y, fbin("mul", h, Const(0.5))), fbin("add", x, fbin("mul", w, Const(0.5))))
    y1, x1, y2, x2 = box
    return fbin("min", y1, y2), fbin("min", x1, x2), fbin("max", y1, y2), fbin("max", x1, x2)


def _overlaps(a: tuple, b: tuple, threshold):
    """Whether boxes a and b (corners) overlap by more than `threshold` (intersection over
    union), as ONNX's reference decides it: never where either box or the overlap is empty."""
    iy0, ix0 = fbin("max", a[0], b[0]), fbin("max", a[1], b[1])
    iy1, ix1 = fbin("min", a[2], b[2]), fbin("min", a[3], b[3])
    inter = fbin("mul", fbin("sub", ix1, ix0), fbin("sub", iy1, iy0))
    area_a = fbin("mul", fbin("sub", a[3], a[1]), fbin("sub", a[2], a[0]))
    area_b = fbin("mul", fbin("sub", b[3], b[1]), fbin("sub", b[2], b[0]))
    union = fbin("sub", fbin("add", area_a, area_b), inter)
    tests = [cmp("gt", ix1, ix0), cmp("gt", iy1, iy0), cmp("gt", inter, Const(0.0)), cmp("gt", area_a, Const(0.0)),
             cmp("gt", area_b, Const(0.0)), cmp("gt", union, Const(0.0)),
             cmp("gt", fbin("div", inter, union), threshold)]
    out = tests[0]
    for t in tests[1:]:
        out = fbin("and", out, t)
    return out


def _nms_kernel(b, node):
    """Per batch and class, greedy selection without sorting: take the best live box (the
    lowest index among equal scores, as ONNX's reference orders them), then retire every live
    box it overlaps too much; stop at max_output_boxes_per_class or when none is live. Rows
    go out in (batch, class, selection) order."""
    boxes, scores = b.reader(node.inputs[0]), b.reader(node.inputs[1])
    batches, classes, n = b.shape(node.inputs[1])
    out = b.out_param(node.outputs[0])
    count = b.out_param(node.outputs[1]) if node.outputs[1] in b.g.types else None
    center = bool(node.attrs.get("center_point_box", 0))

    def scalar(index, default, t):
        name = node.inputs[index] if index < len(node.inputs) else ""
        if not name:
            return Const(default, t)
        read = b.reader(name)
        return Cast(t, read([Const(0)] * len(b.shape(name))))
    most = scalar(2, 0, "i64")
    iou = scalar(3, 0.0, "f32")
    has_floor = len(node.inputs) > 4 and bool(node.inputs[4])
    floor = scalar(4, 0.0, "f32")
    live = b.workspace(b.type(node.inputs[1]).shape[2], "i32")  # (1 where a box is still a candidate)
    rows, taken, done = b.fresh("rows"), b.fresh("taken"), b.fresh("done")
    best, top, step, bv, cv = b.fresh("best"), b.fresh("top"), b.fresh("step"), b.fresh("b"), b.fresh("c")
    i, j, k = b.fresh("i"), b.fresh("j"), b.fresh("k")

    def score(box):
        return Cast("f32", scores([Var(bv), Var(cv), box]))

    def corners(box):
        return _corners([Cast("f32", boxes([Var(bv), box, Const(c)])) for c in range(4)], center)

    def alive(box):
        return cmp("ne", Load(live, box), Const(0))
    find = [Local(best, "i64", Const(-1)), Local(top, "f32", Const(0.0, "f32")),
            For(i, n, (If(fbin("and", alive(Var(i)), fbin("or", cmp("lt", Var(best), Const(0)),
                                                           cmp("gt", score(Var(i)), Var(top, "f32")))),
                          (Assign(best, Var(i)), Assign(top, score(Var(i))))),))]
    chosen = corners(Var(best))
    take = [Store(live, Var(best), Const(0, "i32")),
            *[Store(out, add(mul(Var(rows), Const(3)), Const(c)), v) for c, v in enumerate((Var(bv), Var(cv), Var(best)))],
            Assign(rows, add(Var(rows), Const(1))), Assign(taken, add(Var(taken), Const(1))),
            For(j, n, (If(fbin("and", alive(Var(j)), _overlaps(chosen, corners(Var(j)), iou)),
                          (Store(live, Var(j), Const(0, "i32")),)),))]
    select_one = If(fbin("and", cmp("eq", Var(done), Const(0)), cmp("lt", Var(taken), most)),
                    (*find, If(cmp("lt", Var(best), Const(0)), (Assign(done, Const(1)),), tuple(take))))
    candidates = For(k, n, (Store(live, Var(k), Cast("i32", cmp("gt", score(Var(k)), floor)) if has_floor
                                  else Const(1, "i32")),))
    per_class = (candidates, Local(taken, "i64", Const(0)), Local(done, "i64", Const(0)), For(step, n, (select_one,)))
    body = [Local(rows, "i64", Const(0)), For(bv, batches, (For(cv, classes, per_class),))]
    return body + ([Store(count, Const(0), Var(rows))] if count else [])


register(
    OpDef(NONZERO, OPAQUE, _nonzero_folded, _nonzero_fold, expand=_expand_nonzero),
    OpDef(COUNT_NONZERO, OPAQUE, _count_nonzero_infer, alone=_count_nonzero_kernel),
    OpDef("Compress", OPAQUE, expanded_only, expand=_expand_compress),
    OpDef(NON_MAX_SUPPRESSION, OPAQUE, expanded_only, expand=_expand_nms),
    OpDef(COUNT_NON_MAX_SUPPRESSION, OPAQUE, _nms_infer, alone=_nms_kernel),
)
