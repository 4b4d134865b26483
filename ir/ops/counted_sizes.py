"""Ops whose output sizes depend on their inputs' values: NonZero, Compress built on it,
NonMaxSuppression, and any op whose shape parameter is computed from data (kiln.ReadSizes).

Their size is a *counted* symbol (value_symbols.counted): kiln.NonZero's kernel counts the
elements and writes the count to an int64 scalar it also outputs, the entry reads it after
that kernel, and everything after reads the size like any run-time size; memory is planned
and the caller's outputs allocated at its greatest (every element nonzero). On constants
NonZero folds to a constant as numpy computes it.

A shape parameter computed from the model's data (Mask R-CNN resizes each mask to its box's
size, cast from the box's corners) is read the same way: where type inference finds no
constant for it and ir/ops/value_ranges.py bounds its values, a kiln.ReadSizes node after its
producer writes each element as an int64 scalar, each a late symbol `tensor[k]` within its
bounds (an element whose bounds meet is that number), and the tensor becomes a symbolic
value of them for every op that takes sizes from it.
"""
from __future__ import annotations

import math

import numpy as np

from ..graph import Node, ShapeError, TensorType
from ..lower.selection import scan_in_blocks, sift_down
from ..loop import Assign, Cast, Const, For, If, Let, Load, Local, Store, Var, add, cmp, div, fbin, mul, sub
from ..symbolic import greatest, require_equal
from ..value_symbols import MAX_VALUE_ELEMENTS, counted
from .node_builder import NodeBuilder
from .registry import OPAQUE, OpDef, expanded_only, register
from .shape import CONCAT, GATHER, IDENTITY, RESHAPE, SQUEEZE, UNSQUEEZE
from .value_ranges import producers_of, value_range

NONZERO = "NonZero"
# x -> (indices [rank, n], n as an int64 scalar): NonZero's value and the count the module reads
COUNT_NONZERO = "kiln.NonZero"
NON_MAX_SUPPRESSION = "NonMaxSuppression"
# NonMaxSuppression's inputs -> (selected [n, 3], n as an int64 scalar)
COUNT_NON_MAX_SUPPRESSION = "kiln.NonMaxSuppression"
# an integer tensor computed from data -> each element as an int64 scalar: sizes the module reads
READ_SIZES = "kiln.ReadSizes"


def _with_count(node, op: str, attrs: dict) -> list:
    """The node as `op`, which also outputs the count of its rows (the size the module reads)."""
    return [Node(op, list(node.inputs), [node.outputs[0], f"{node.key}/count"], attrs, node.name)]


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
    return _with_count(node, COUNT_NONZERO, {"size_name": f"nonzero({node.inputs[0]})"})


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

def _expand_nms(g, node):
    return _with_count(node, COUNT_NON_MAX_SUPPRESSION, {**node.attrs, "size_name": f"selected({node.outputs[0]})"})


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


def _nms_kernel(b, node):
    """Per batch and class, ONNX's greedy selection as onnxruntime runs it, without sorting
    every box: the boxes above the score threshold listed with their corners and areas, a
    max-heap of them by score (the lowest index first among equal scores, as onnx's reference
    orders them), then boxes popped best first, each kept unless it overlaps one kept before
    it too much, until max_output_boxes_per_class are kept or none is left. Work: the
    candidates, plus log(candidates) and a test against each kept box per box popped. Rows go
    out in (batch, class, selection) order."""
    boxes, scores = b.reader(node.inputs[0]), b.reader(node.inputs[1])
    batches, classes, n = b.shape(node.inputs[1])
    out = b.out_param(node.outputs[0])
    count = b.out_param(node.outputs[1]) if node.outputs[1] in b.g.types else None
    center = bool(node.attrs.get("center_point_box", 0))

    def scalar(index, default, t):
        name = node.inputs[index] if index < len(node.inputs) else ""
        if not name:
            return Const(default, t)
        return Cast(t, b.reader(name)([Const(0)] * len(b.shape(name))))
    most, iou, floor = scalar(2, 0, "i64"), scalar(3, 0.0, "f32"), scalar(4, 0.0, "f32")
    has_floor = len(node.inputs) > 4 and bool(node.inputs[4])
    boxes_dim = b.type(node.inputs[1]).shape[2]
    # (per candidate, in listing order: its box's index, its score, its corners and area)
    index, key, geometry = b.workspace(boxes_dim, "i32"), b.workspace(boxes_dim), b.workspace(boxes_dim * 5)
    # (the kept boxes' corners and areas, each a row of its own: one vectorized test against all)
    heap, kept = b.workspace(boxes_dim, "i32"), b.workspace(boxes_dim * 5)
    rows, size, taken, hit, top = b.fresh("rows"), b.fresh("size"), b.fresh("taken"), b.fresh("hit"), b.fresh("top")
    bv, cv, i, h, step, t = (b.fresh(v) for v in ("b", "c", "i", "h", "step", "t"))

    def better(p, q):  # (candidate p above candidate q: a higher score, or an equal one and a lower index)
        kp, kq = Load(key, p), Load(key, q)
        earlier = cmp("lt", Load(index, p), Load(index, q))
        return [], fbin("or", cmp("gt", kp, kq), fbin("and", cmp("eq", kp, kq), earlier))

    def geo(p, c):
        return Load(geometry, add(mul(p, Const(5)), Const(c)))
    def score_of(box):
        return Cast("f32", scores([Var(bv), Var(cv), box]))
    score = score_of(Var(i))
    corners = _corners([Cast("f32", boxes([Var(bv), Var(i), Const(c)])) for c in range(4)], center)
    area = fbin("mul", fbin("sub", corners[3], corners[1]), fbin("sub", corners[2], corners[0]))
    listing = (Store(index, Var(size), Cast("i32", Var(i))), Store(key, Var(size), score),
               *[Store(geometry, add(mul(Var(size), Const(5)), Const(c)), v) for c, v in enumerate((*corners, area))],
               Store(heap, Var(size), Cast("i32", Var(size))), Assign(size, add(Var(size), Const(1))))
    def visit(box):  # (a box listed where its score passes the threshold)
        return [Let(i, box), If(cmp("gt", score, floor), listing)]
    gather = [Local(size, "i64", Const(0)),
              *(scan_in_blocks(b, Const(0), n, lambda box: cmp("gt", score_of(box), floor), visit) if has_floor
                else [For(i, n, listing)])]
    # The heap's depth: levels, with 2**levels (`room`) more than its entries. Kept as it
    # shrinks, so a pop's loop runs as deep as the heap is (a fixed 15 levels for YOLO's 8400
    # boxes cost 80 ns a pop, most of its time).
    levels, room, lv = b.fresh("levels"), b.fresh("room"), b.fresh("lv")
    depth = [Local(levels, "i64", Const(0)), Local(room, "i64", Const(1)),
             For(lv, max(greatest(boxes_dim), 1).bit_length() + 1, (If(cmp("le", Var(room), Var(size)), (
                 Assign(room, mul(Var(room), Const(2))), Assign(levels, add(Var(levels), Const(1))))),))]
    heapify = For(h, add(div(Var(size), Const(2)), Const(1)),  # (from the last parent up to the root)
                  tuple(sift_down(b, heap, Var(size), sub(div(Var(size), Const(2)), Var(h)), better, Var(levels))))
    shrink = If(cmp("lt", mul(Var(size), Const(2)), Var(room)), (Assign(room, div(Var(room), Const(2))),
                                                                  Assign(levels, sub(Var(levels), Const(1)))))
    pos = Var(top)
    mine = [b.fresh("g") for _ in range(5)]

    def kept_at(c, at):
        return add(mul(Const(c), n), at)
    overlaps = [*[Let(v, geo(pos, c)) for c, v in enumerate(mine)], Local(hit, "i32", Const(0)),
                For(t, Var(taken), (Assign(hit, fbin("or", Var(hit, "i32"), Cast("i32", _overlap_of(
                    [Var(v, "f32") for v in mine], [Load(kept, kept_at(c, Var(t))) for c in range(5)], iou)))),),
                    "vectorize")]
    keep = (*[Store(out, add(mul(Var(rows), Const(3)), Const(c)), v)
              for c, v in enumerate((Var(bv), Var(cv), Cast("i64", Load(index, pos))))],
            *[Store(kept, kept_at(c, Var(taken)), Var(v, "f32")) for c, v in enumerate(mine)],
            Assign(rows, add(Var(rows), Const(1))), Assign(taken, add(Var(taken), Const(1))))
    pop = [Local(top, "i64", Cast("i64", Load(heap, Const(0)))), Assign(size, sub(Var(size), Const(1))),
           Store(heap, Const(0), Load(heap, Var(size))), shrink,
           *sift_down(b, heap, Var(size), Const(0), better, Var(levels)),
           *overlaps, If(cmp("eq", Var(hit, "i32"), Const(0)), keep)]
    listed = b.fresh("listed")  # (a pop a step: as many steps as boxes listed, at most)
    select = For(step, Var(listed), (If(fbin("and", cmp("gt", Var(size), Const(0)), cmp("lt", Var(taken), most)),
                                        tuple(pop)),))
    per_class = (*gather, *depth, heapify, Local(taken, "i64", Const(0)), Local(listed, "i64", Var(size)), select)
    body = [Local(rows, "i64", Const(0)), For(bv, batches, (For(cv, classes, per_class),))]
    return body + ([Store(count, Const(0), Var(rows))] if count else [])


def _overlap_of(p: list, q: list, threshold):
    """Whether boxes p and q ([y_min, x_min, y_max, x_max, area]) overlap by more than
    `threshold` (intersection over union), as onnx's reference decides it: never where either
    box or their intersection is empty."""
    iy0, ix0, iy1, ix1 = (fbin("max", p[0], q[0]), fbin("max", p[1], q[1]), fbin("min", p[2], q[2]),
                          fbin("min", p[3], q[3]))
    inter = fbin("mul", fbin("sub", ix1, ix0), fbin("sub", iy1, iy0))
    union = fbin("sub", fbin("add", p[4], q[4]), inter)
    tests = [cmp("gt", ix1, ix0), cmp("gt", iy1, iy0), cmp("gt", inter, Const(0.0)), cmp("gt", p[4], Const(0.0)),
             cmp("gt", q[4], Const(0.0)), cmp("gt", union, Const(0.0)), cmp("gt", fbin("div", inter, union), threshold)]
    out = tests[0]
    for t in tests[1:]:
        out = fbin("and", out, t)
    return out


# ---- Sizes read from data --------------------------------------------------------------------

def readable(g, tensor: str) -> bool:
    """Can the module read `tensor`'s values as sizes: a small integer tensor of a static
    shape that a node computes (in a loop body, or the graph around it)?"""
    t = g.types.get(tensor)
    return t is not None and t.dtype in ("int64", "int32") and t.is_static and t.size <= MAX_VALUE_ELEMENTS \
        and (tensor not in g.inputs or g.inputs_from_around)


def read_sizes_node(g, tensor: str, guard: tuple) -> Node | None:
    """A kiln.ReadSizes node making the values of `tensor` (`readable`, computed while the
    model runs) sizes the module reads after computing them, or None where its values have
    no bounds (ir/ops/value_ranges.py)."""
    t = g.types[tensor]
    bounds = value_range(g, tensor)
    if bounds is None:
        return None
    lo, hi = (np.broadcast_to(b, t.shape).reshape(-1) for b in bounds)
    limit = np.iinfo(np.int64).max // 4
    if np.any(np.abs(lo) > limit) or np.any(np.abs(hi) > limit):
        return None
    pairs = [(int(math.floor(a)), int(math.ceil(b))) for a, b in zip(lo, hi)]
    return Node(READ_SIZES, [tensor], [f"{tensor}/size{k}" for k in range(t.size)], {"bounds": pairs},
                f"{tensor}/read_sizes", guard)


def _read_sizes_infer(g, node, p):
    tensor = node.inputs[0]
    t = g.types[tensor]
    # (a symbol is never negative: an element that may be is its least plus a symbol from 0, the
    # kernel writing the difference)
    values, known = [], _known_elements(g, tensor)
    for k, ((lo, hi), out) in enumerate(zip(node.attrs["bounds"], node.outputs)):
        if known[k] is not None:  # (a size the graph already names: no read, no new symbol)
            values.append(known[k])
            continue
        what = f"element {k} of '{tensor}', a size computed from the model's data" + \
            (f", plus {-lo} (a symbol is never negative)" if lo < 0 else "")
        values.append(lo if lo == hi else counted(f"{tensor}[{k}]", out, hi - min(lo, 0), what, least=max(lo, 0))
                      + min(lo, 0))
    g.symbolic_values[tensor] = np.array(values, dtype=object).reshape(t.shape)
    return [TensorType((), "int64")] * len(node.outputs)


def _known_elements(g, tensor: str) -> list:
    """Each element of a small integer tensor as type inference knows it (an int or a Dim),
    else None: torch writes `zeros(h, n)` as a Concat of h's Unsqueeze, a size, and n's, read
    from data."""
    t = g.types[tensor]
    if tensor in g.symbolic_values:
        return list(g.symbolic_values[tensor].reshape(-1))
    if tensor in g.constants:
        return [int(v) for v in np.asarray(g.constants[tensor]).reshape(-1)]
    node = producers_of(g).get(tensor)
    if node is not None and node.op in (UNSQUEEZE, SQUEEZE, RESHAPE, IDENTITY) and \
            g.types[node.inputs[0]].dtype == t.dtype:
        return _known_elements(g, node.inputs[0])
    if node is not None and node.op == CONCAT and len(t.shape) == 1:
        return [v for i in node.inputs if i for v in _known_elements(g, i)]
    return [None] * t.size


def _read_sizes_kernel(b, node):
    x = b.reader(node.inputs[0])
    rank = len(b.shape(node.inputs[0]))
    shape = b.shape(node.inputs[0])
    out = []
    for k, name in enumerate(node.outputs):
        if name not in b.g.types:
            continue
        index = list(np.unravel_index(k, shape)) if rank else []
        value, least = Cast("i64", x([Const(int(i)) for i in index])), node.attrs["bounds"][k][0]
        out.append(Store(b.out_param(name), Const(0), sub(value, Const(least)) if least < 0 else value))
    return out


register(
    OpDef(READ_SIZES, OPAQUE, _read_sizes_infer, alone=_read_sizes_kernel),
    OpDef(NONZERO, OPAQUE, _nonzero_folded, _nonzero_fold, expand=_expand_nonzero),
    OpDef(COUNT_NONZERO, OPAQUE, _count_nonzero_infer, alone=_count_nonzero_kernel),
    OpDef("Compress", OPAQUE, expanded_only, expand=_expand_compress),
    OpDef(NON_MAX_SUPPRESSION, OPAQUE, expanded_only, expand=_expand_nms),
    OpDef(COUNT_NON_MAX_SUPPRESSION, OPAQUE, _nms_infer, alone=_nms_kernel),
)
