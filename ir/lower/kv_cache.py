"""The kernels of a KV cache kept in place (ir/passes/kv_cache.py): appending this call's
keys and values into the caller's buffer, and attention's scores read from the cached keys
as they lie. Both index the cache with its capacity as the stride (`KernelBuilder.storage`),
so nothing that grows with the past is copied."""
from __future__ import annotations

from ..graph import Node
from ..loop import Assign, Cast, Const, For, If, Local, Store, Var, add, cmp, const, fbin, flat_index, sub
from .builder import KernelBuilder, broadcast_index
from .gemm import by_row_blocks

DOT_ROWS = 4  # rows of A per pass over the keys: each cached key is loaded once for all of them


def lower_append_cache(b: KernelBuilder, node: Node, store, out: str) -> tuple:
    """present[..., past + i, ...] = new[..., i, ...]: the past is already where it belongs.
    With a third input (kiln.CacheWrite's starts, kept in place): each batch entry's new
    entries go at its start, and the entries after them are zeroed."""
    past, new = node.inputs[:2]
    present = node.outputs[0]
    axis = b.attrs(node)["axis"]
    if len(node.inputs) == 3:
        return _rows_from_starts(b, node, out, in_place=True)
    value, shape = b.reader(new), b.shape(new)
    start = b.dim(b.type(past).shape[axis])
    storage = b.storage(present)

    def point(idx):
        at = list(idx)
        at[axis] = add(at[axis], start)
        return [Store(out, flat_index(at, storage), value(idx))]
    return b.loops(shape, point, parallel=True)


def lower_cache_write(b: KernelBuilder, node: Node, store, out: str) -> tuple:
    """kiln.CacheWrite as a tensor of its own (its cache not kept in place): every entry."""
    return _rows_from_starts(b, node, out, in_place=False)


def _rows_from_starts(b: KernelBuilder, node: Node, out: str, in_place: bool) -> tuple:
    """present's entries along the cache axis, for each batch entry n and leading index: the
    past's before starts[n], then the new ones, then zeros. In place, the past's are where
    they belong already: the new rows are written after starts[n], and only an entry that
    starts inside the past (a sequence shorter than the cache) has rows to zero, so a
    decoding step writes one row per head, not the cache."""
    past, new, starts = node.inputs
    present = node.outputs[0]
    axis = b.attrs(node)["axis"]
    shape, new_rows, past_rows = b.shape(present), b.shape(new)[axis], b.shape(past)[axis]
    lead, trail = list(shape[:axis]), list(shape[axis + 1:])
    storage = b.storage(present)
    value, t = b.reader(new), b.compute(present)
    old = None if in_place else b.reader(past)  # (in place, the past is where it belongs: not read)
    start_of = b.reader(starts)  # (computed inline where its ops fused into this kernel)

    def rows(idx):  # (a start outside [0, past] is clamped: no write lands outside the present)
        start = fbin("min", fbin("max", Cast("i64", start_of([idx[0]])), Const(0)), past_rows)

        def copy(at_row, of=None, from_row=None):  # one row: `of`'s row from_row, or zeros
            def point(tidx):
                value_at = of(list(idx) + [from_row] + list(tidx)) if of else const(0, t)
                return [Store(out, flat_index(list(idx) + [at_row] + list(tidx), storage), value_at)]
            return b.loops(trail, point)
        row = b.fresh("row")
        if in_place:
            k = b.fresh("k")
            zeros = For(row, past_rows, (If(cmp("ge", Var(row), start), copy(add(Var(row), new_rows))),))
            return [For(k, new_rows, copy(add(start, Var(k)), value, Var(k))),
                    If(cmp("lt", start, past_rows), (zeros,))]
        k = sub(Var(row), start)  # (the new entry a row after the start holds)
        body = If(cmp("lt", Var(row), start), copy(Var(row), old, Var(row)),
                  (If(cmp("lt", k, new_rows), copy(Var(row), value, k), copy(Var(row))),))
        return [For(row, shape[axis], (body,))]
    return b.loops(lead, rows, inner_kind="serial", parallel=True)


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
