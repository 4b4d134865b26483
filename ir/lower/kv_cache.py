"""The kernels of a KV cache kept in place (ir/passes/kv_cache.py): appending this call's
keys and values into the caller's buffer, and attention's scores read from the cached keys
as they lie. Both index the cache with its capacity as the stride (`KernelBuilder.storage`),
so nothing that grows with the past is copied."""
from __future__ import annotations

from ..graph import Node
from ..loop import Assign, Const, For, Local, Store, Var, add, fbin, flat_index
from .builder import KernelBuilder, broadcast_index
from .gemm import by_row_blocks

DOT_ROWS = 4  # rows of A per pass over the keys: each cached key is loaded once for all of them


def lower_append_cache(b: KernelBuilder, node: Node, store, out: str) -> tuple:
    """present[..., past + i, ...] = new[..., i, ...]: the past is already where it belongs."""
    past, new = node.inputs
    present = node.outputs[0]
    axis = b.attrs(node)["axis"]
    value, shape = b.reader(new), b.shape(new)
    start = b.dim(b.type(past).shape[axis])
    storage = b.storage(present)

    def point(idx):
        at = list(idx)
        at[axis] = add(at[axis], start)
        return [Store(out, flat_index(at, storage), value(idx))]
    return b.loops(shape, point, parallel=True)


def lower_matmul_transposed_b(b: KernelBuilder, node: Node, store, out: str) -> tuple:
    """out[..., m, n] = sum_k a[..., m, k] * x[..., n, k]: attention's scores against keys
    stored row by row (the cache's layout), each a dot product along the contiguous k,
    DOT_ROWS query rows at a time. The batch and head dims are one loop, divided across
    threads."""
    a_name, x_name = node.inputs
    oshape = b.shape(node.outputs[0])
    lead, m, n = list(oshape[:-2]), oshape[-2], oshape[-1]
    sa, sx = b.shape(a_name), b.shape(x_name)
    k, t = sa[-1], b.compute(a_name)
    ra, rx = b.reader(a_name), b.reader(x_name)

    def rows(bidx, m0, count: int) -> list:
        ai, xi = broadcast_index(bidx, lead, sa[:-2]), broadcast_index(bidx, lead, sx[:-2])
        col, kv = b.fresh("n"), b.fresh("k")
        row = [add(m0, r) for r in range(count)]
        acc = [b.fresh("dot") for _ in range(count)]
        key = rx(xi + [Var(col), Var(kv)])
        update = tuple(Assign(acc[r], fbin("add", Var(acc[r], t), fbin("mul", ra(ai + [row[r], Var(kv)]), key)))
                       for r in range(count))
        body = [*(Local(s, t, Const(0.0, t)) for s in acc), For(kv, k, update, "reduce")]
        for r in range(count):
            body += store(list(bidx) + [row[r], Var(col)], Var(acc[r], t))
        return [For(col, n, tuple(body))]
    return by_row_blocks(b, lead, m, DOT_ROWS, rows)
