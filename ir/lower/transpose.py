"""A group that only moves 4-byte elements across their last axis (a Transpose, with the
Reshapes, Flattens, Squeezes and Unsqueezes around it) as blocks transposed in registers.

Such a group swaps two runs of axes: collapsed, it is a batch of [R, C] -> [C, R]
transposes. Element by element, every output row read a column of the input, a gather per
element (a [128, 16384] plane took 6.6 ms, onnxruntime 1.5). As 16 x 16 blocks
(ir.loop.TransposeBlock), 16 rows load as vectors, shuffle and store as 16 columns: 0.97 ms.
(The other way, [16384, 128], takes 1.3 ms to onnxruntime's 0.8: each block's 16 stores land
64 KB apart, in 16 pages.)
"""
from __future__ import annotations

from ..dtypes import dtype
from ..graph import Node
from ..loop import TRANSPOSE_LANES, Const, For, Let, TransposeBlock, Var, add, div, mul, rem
from ..ops.shape import FLATTEN, RESHAPE, SQUEEZE, TRANSPOSE, UNSQUEEZE, lane_transpose
from .builder import KernelBuilder

_VIEWS = (RESHAPE, FLATTEN, SQUEEZE, UNSQUEEZE)


def lower_blocked_transpose(b: KernelBuilder, members: list[Node]) -> tuple | None:
    """The group's kernel as transposed blocks, or None where it is not such a group."""
    transposes = [m for m in members if m.op == TRANSPOSE]
    if len(transposes) != 1 or any(m.op not in _VIEWS + (TRANSPOSE,) for m in members):
        return None
    if any(m.inputs[0] != prev.outputs[0] for prev, m in zip(members, members[1:])):
        return None  # (not one chain)
    x_name, y_name = members[0].inputs[0], members[-1].outputs[0]
    t = transposes[0]
    shape = b.type(t.inputs[0]).shape
    if dtype(b.type(x_name).dtype).itemsize != 4 or x_name in b.readers or b.g.storage_shape(x_name) is not None:
        return None
    found = lane_transpose(shape, b.attrs(t)["perm"])
    if found is None or not all(isinstance(d, int) for d in found[1:]):
        return None
    batch, rows, cols = b.dim(found[0]), *found[1:]  # (a run-time batch: a loop over it at run time)
    src, dst = b.in_param(x_name), b.out_param(y_name)
    n = TRANSPOSE_LANES

    def block(bi, r0, c0, height: int, width: int) -> TransposeBlock:
        """Input rows [r0, r0 + height) x columns [c0, c0 + width) of batch bi."""
        return TransposeBlock(src, mul(add(mul(add(mul(bi, rows), r0), cols), c0), 4), cols * 4,
                              dst, mul(add(mul(add(mul(bi, cols), c0), rows), r0), 4), rows * 4, height, width)

    def row_of_blocks(bi, r0, height: int) -> tuple:
        cb = b.fresh("cb")
        stmts = [For(cb, cols // n, (block(bi, r0, mul(Var(cb), n), height, n),))] if cols >= n else []
        if cols % n:
            stmts.append(block(bi, r0, Const(cols - cols % n), height, cols % n))
        return tuple(stmts)
    body = []
    full = rows // n
    if full:  # every full row of blocks of every batch, divided across threads
        p, bi, rb = b.fresh("p"), b.fresh("bt"), b.fresh("rb")
        body.append(For(p, batch * full, (Let(bi, div(Var(p), full)), Let(rb, rem(Var(p), full)),
                                          *row_of_blocks(Var(bi), mul(Var(rb), n), n)), parallel=True))
    if rows % n:
        bi = b.fresh("bt")
        body.append(For(bi, batch, row_of_blocks(Var(bi), Const(rows - rows % n), rows % n)))
    return tuple(body)
