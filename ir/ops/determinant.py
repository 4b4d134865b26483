"""Det: the determinant of each square matrix in the last two dims, by Gaussian elimination
with partial pivoting in float64 (each matrix copied to a workspace, then reduced to upper
triangular form; the determinant is the product of the pivots, its sign flipped by each row
swap). Matrices are small where models take determinants (a pose's rotation, a normalizing
flow's Jacobian), so O(n^3) a matrix on one thread."""
from __future__ import annotations

import numpy as np

from ..dtypes import is_float
from ..graph import ShapeError, TensorType, UnsupportedError
from ..loop import Assign, Cast, Const, For, If, Let, Load, Local, Store, Var, add, call, cmp, fbin, flat_index, mul
from ..symbolic import is_symbolic
from .registry import OPAQUE, OpDef, register

F64 = "f64"


def _det(g, node, p):
    x = g.types[node.inputs[0]]
    if len(x.shape) < 2 or not is_float(x.dtype):
        raise UnsupportedError(f"{node.describe()}: Det of {x} (float matrices in the last two dims)")
    if is_symbolic(x.shape[-1]) or is_symbolic(x.shape[-2]) or x.shape[-1] != x.shape[-2]:
        raise ShapeError(f"{node.describe()}: Det of {x}: the last two dims must be one known size")
    return TensorType(tuple(x.shape[:-2]), x.dtype)


def _det_kernel(b, node):
    xs = b.shape(node.inputs[0])
    n, x, out = xs[-1], b.reader(node.inputs[0]), b.out_param(node.outputs[0])
    a = b.workspace(n * n, F64)
    det, pivot, best, col, r, j, f = (b.fresh(v) for v in ("det", "pivot", "best", "col", "r", "j", "f"))

    def at(row, column):
        return add(mul(row, Const(n)), column)

    def matrix(idx):
        copy = For(r, n, (For(j, n, (Store(a, at(Var(r), Var(j)), Cast(F64, x(list(idx) + [Var(r), Var(j)]))),)),))
        magnitude = call("abs", Load(a, at(Var(r), Var(col))))
        find = [Local(pivot, "i64", Var(col)), Local(best, F64, call("abs", Load(a, at(Var(col), Var(col))))),
                For(r, n, (If(fbin("and", cmp("gt", Var(r), Var(col)), cmp("gt", magnitude, Var(best, F64))),
                              (Assign(pivot, Var(r)), Assign(best, magnitude))),))]
        swap = If(cmp("ne", Var(pivot), Var(col)), (
            For(j, n, (Let(f, Load(a, at(Var(col), Var(j)))),
                       Store(a, at(Var(col), Var(j)), Load(a, at(Var(pivot), Var(j)))),
                       Store(a, at(Var(pivot), Var(j)), Var(f, F64)))),
            Assign(det, fbin("mul", Var(det, F64), Const(-1.0, F64)))))
        head = Load(a, at(Var(col), Var(col)))
        reduced = fbin("sub", Load(a, at(Var(r), Var(j))), fbin("mul", Var(f, F64), Load(a, at(Var(col), Var(j)))))
        row = (Let(f, fbin("div", Load(a, at(Var(r), Var(col))), head)),
               For(j, n, (If(cmp("gt", Var(j), Var(col)), (Store(a, at(Var(r), Var(j)), reduced),)),)))
        eliminate = If(cmp("ne", head, Const(0.0, F64)), (For(r, n, (If(cmp("gt", Var(r), Var(col)), row),)),))
        steps = For(col, n, (*find, swap, Assign(det, fbin("mul", Var(det, F64), head)), eliminate))
        return [copy, Local(det, F64, Const(1.0, F64)), steps,
                Store(out, flat_index(idx, b.shape(node.outputs[0])), Cast(b.compute(node.outputs[0]), Var(det, F64)))]
    # (one workspace: the matrices one after another)
    return b.loops(b.shape(node.outputs[0]), matrix, inner_kind="serial")


def _det_fold(a, values, g, node):
    return [np.linalg.det(values[0].astype(np.float64)).astype(values[0].dtype)]


register(OpDef("Det", OPAQUE, _det, _det_fold, alone=_det_kernel))
