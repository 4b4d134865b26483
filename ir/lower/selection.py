"""Loop-IR pieces the selection kernels share (NonMaxSuppression, Unique, TopK): a scan that
tests a block of elements at once before visiting each, and a binary heap's sift-down."""
from __future__ import annotations

from ..loop import Assign, Cast, Const, For, If, Load, Local, Store, Var, add, cmp, div, fbin, mul, rem

# Elements a block's one vectorized test covers: most of a detector's scores fall below its
# threshold and most of a long line below TopK's worst kept value, so a block of them is
# passed over after one compare (YOLOv8's 80 x 8400 scores, none above: 0.168 -> 0.028 ms).
BLOCK = 16


def scan_in_blocks(b, start, count, could, visit) -> list:
    """Statements visiting j in [start, start + count) (visit(j): statements), where a whole
    block of BLOCK in which could(j) (an i1 expression, possibly true where visit does
    nothing) holds for none is passed over; the rest visited one by one."""
    blk, lane, hit, r = b.fresh("blk"), b.fresh("lane"), b.fresh("hit"), b.fresh("r")
    at = add(add(start, mul(Var(blk), Const(BLOCK))), Var(lane))
    test = For(lane, BLOCK, (Assign(hit, fbin("or", Var(hit, "i32"), Cast("i32", could(at)))),), "forced_vector")
    whole = div(count, BLOCK)
    tail = add(start, mul(whole, Const(BLOCK)))
    return [For(blk, whole, (Local(hit, "i32", Const(0)), test,
                             If(cmp("ne", Var(hit, "i32"), Const(0)), (For(lane, BLOCK, tuple(visit(at))),)))),
            For(r, rem(count, BLOCK), tuple(visit(add(tail, Var(r)))))]


def sift_down(b, heap: str, size, first, before, levels) -> list:
    """Statements restoring a binary heap (`heap`: i32 entries, `size` of them, at most
    `levels` deep; before(p, q) -> (statements, i1): whether entry p goes above entry q)
    below position `first`, whose entry may be out of place. The loop runs `levels` times,
    idle once the entry has settled."""
    at, moving, going, child, d = (b.fresh(v) for v in ("at", "moving", "going", "child", "d"))
    left = add(mul(Var(at), Const(2)), Const(1))
    right = add(left, Const(1))

    def entry(pos):
        return Cast("i64", Load(heap, pos))
    right_work, right_first = before(entry(right), entry(left))
    child_work, child_first = before(entry(Var(child)), Var(moving))
    # (nested Ifs, not "and": both operands of an "and" are evaluated, and a child past the
    # heap's end has no entry to read)
    step = (Local(child, "i64", left),
            If(cmp("lt", right, size), (*right_work, If(right_first, (Assign(child, right),)))),
            Assign(going, Const(0)),
            If(cmp("lt", Var(child), size), (*child_work, If(child_first, (
                Store(heap, Var(at), Load(heap, Var(child))), Assign(at, Var(child)), Assign(going, Const(1)))))))
    return [Local(at, "i64", first), Local(moving, "i64", entry(first)), Local(going, "i64", Const(1)),
            For(d, levels, (If(cmp("ne", Var(going), Const(0)), step),)),
            Store(heap, Var(at), Cast("i32", Var(moving)))]
