"""The ops of a KV cache kept in place, which ir/passes/kv_cache.py writes in place of a
Concat of a past input and of the Transpose of what it made: an append into the caller's
buffer, and a MatMul that reads its B operand transposed (the keys as they are cached)."""
from __future__ import annotations

from ..dtypes import DTYPES
from ..graph import Node, ShapeError, TensorType
from ..lower.kv_cache import lower_append_cache, lower_cache_write, lower_matmul_transposed_b
from ..symbolic import is_symbolic, require_equal
from .broadcast import broadcast
from .registry import OUT_EWISE_FUSABLE, REDUCTION, OpDef, op_def, register
from .shape import CONCAT

APPEND_CACHE = "kiln.AppendCache"  # (past, new[, starts]) -> present: Concat's (or CacheWrite's) meaning, in place
MATMUL_TRANSPOSED_B = "kiln.MatMulTransposedB"  # (a, x) -> MatMul(a, x with its last two dims swapped)
# (past, new, starts) -> present, as long as Concat(past, new) along `axis`: batch entry n
# holds the past's entries before starts[n] (clamped to [0, past]), then the new ones, then
# zeros. onnxruntime's GroupQueryAttention writes a batch of sequences of different lengths
# so; where every start is the past's length it is the Concat.
CACHE_WRITE = "kiln.CacheWrite"


def _append_cache(g, node, p):
    if len(node.inputs) == 3:
        return _cache_write(g, node, p)
    return op_def(CONCAT).infer(g, node, p)


def _cache_write(g, node, p):
    past, new, starts = node.inputs
    t = op_def(CONCAT).infer(g, Node(CONCAT, [past, new], node.outputs, {"axis": node.attrs["axis"]}, node.name), p)
    s = g.types[starts]
    if p["axis"] == 0 or len(s.shape) != 1 or not DTYPES[s.dtype].is_int:
        raise ShapeError(f"{node.describe()}: starts {s} must be integers, one per batch entry (axis 0), and the "
                         f"cache axis {p['axis']} another")
    require_equal(s.shape[0], g.types[past].shape[0], f"{node.describe()}: starts and the batch")
    return t


def _matmul_transposed_b(g, node, p):
    a, x = (g.types[i] for i in node.inputs)
    if len(a.shape) < 2 or len(x.shape) < 2:
        raise ShapeError(f"{node.describe()}: operands {a} and {x} must have two dims at least")
    if a.shape[-1] != x.shape[-1] and not (is_symbolic(a.shape[-1]) or is_symbolic(x.shape[-1])):
        raise ShapeError(f"{node.describe()}: inner dimensions of {a} and {x} (transposed) differ")
    require_equal(a.shape[-1], x.shape[-1], f"{node.describe()}: the inner dimensions")
    batch = broadcast([tuple(a.shape[:-2]), tuple(x.shape[:-2])], node)
    return TensorType(tuple(batch) + (a.shape[-2], x.shape[-2]), a.dtype)


register(
    # (a reduction's kind: it absorbs the index maps that compute its new entries)
    OpDef(APPEND_CACHE, REDUCTION, _append_cache, anchor=lower_append_cache),
    OpDef(CACHE_WRITE, REDUCTION, _cache_write, anchor=lower_cache_write),
    OpDef(MATMUL_TRANSPOSED_B, OUT_EWISE_FUSABLE, _matmul_transposed_b, anchor=lower_matmul_transposed_b),
)
