"""Einsum. A product of two operands (attention as XLNet or T5 writes it, "ibnd,jbnd->bnij";
projections, "ibh,hnd->ibnd") is a batched MatMul between transposes and reshapes: type
inference builds it so (`_as_matmul`; over run-time sizes too, its reshapes' shapes then
symbolic values), and it runs on the GEMM micro-kernel, its constant operand packed at build
time. Anything else (one or three operands, a diagonal "ii->i") is a loop nest of sums of
products (ir/lower/gemm.py's lower_einsum).
"""
from __future__ import annotations

import math

import numpy as np

from ..dtypes import is_float
from ..graph import Node, ShapeError, TensorType
from ..lower.gemm import lower_einsum
from ..symbolic import is_symbolic, require_equal
from .compile_time import symbolic_value_node
from .conv_gemm import MATMUL
from .reduce import REDUCE_SUM
from .registry import OUT_EWISE_FUSABLE, OpDef, register
from .shape import RESHAPE, TRANSPOSE


def parse_einsum(equation: str, ranks: list[int], node) -> tuple[list[str], str]:
    """Operand subscripts and output subscripts, with '...' expanded to capital letters (the
    broadcast dims, right-aligned) and an implicit output (letters seen once, sorted) made
    explicit."""
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        raise ShapeError(f"{node.describe()}: equation {equation!r} has {len(terms)} operands, the node {len(ranks)}")
    ell = max((r - len(t.replace("...", "")) for t, r in zip(terms, ranks) if "..." in t), default=0)
    fill = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"[:ell]
    subs = []
    for t, r in zip(terms, ranks):
        if "..." in t:
            n = r - len(t.replace("...", ""))
            t = t.replace("...", fill[ell - n:])
        if len(t) != r:
            raise ShapeError(f"{node.describe()}: subscripts {t!r} do not fit an operand of rank {r}")
        subs.append(t)
    if arrow:
        out = rhs.replace("...", fill)
    else:
        letters = "".join(subs)
        out = fill + "".join(sorted(c for c in set(letters) if letters.count(c) == 1 and c not in fill))
    return subs, out


def _joint_size(a, b, where: str):
    """The size of a letter that is `a` in one operand and `b` in another: a 1 broadcasts;
    run-time sizes must be equal (a check the module makes)."""
    if not is_symbolic(a) and a == 1:
        return b
    if not is_symbolic(b) and b == 1:
        return a
    return require_equal(a, b, where)


def _einsum(g, node, p):
    types = [g.types[i] for i in node.inputs]
    subs, out = parse_einsum(node.attrs["equation"], [len(t.shape) for t in types], node)
    dims: dict[str, int] = {}
    for s, t in zip(subs, types):
        for c, d in zip(s, t.shape):
            try:
                dims[c] = _joint_size(dims.get(c, 1), d, f"{node.describe()}: subscript {c}")
            except ShapeError:
                raise ShapeError(f"{node.describe()}: subscript {c} is {dims[c]} in one operand and {d} in another") \
                    from None
    p["subscripts"], p["output"], p["dims"] = subs, out, dims
    return TensorType(tuple(dims[c] for c in out), types[0].dtype)


def _einsum_fold(a, values, g, node):
    letters = {c: chr(ord("a") + i) for i, c in enumerate(dict.fromkeys("".join(a["subscripts"]) + a["output"]))}
    eq = ",".join("".join(letters[c] for c in s) for s in a["subscripts"]) + "->" + "".join(letters[c]
                                                                                         for c in a["output"])
    return [np.einsum(eq, *values)]


def _as_matmul(g, node) -> list[Node] | None:
    """Two float operands as [batch.., M, K] x [batch.., K, N]: the letters both operands and
    the output have are batch dims (kept apart: MatMul broadcasts them), those both operands
    have are contracted (K), the rest are A's rows (M) or B's columns (N); a letter only one
    operand has is summed out of it first. None where the loop nest computes it."""
    if len(node.inputs) != 2:
        return None
    ta, tb = (g.types[i] for i in node.inputs)
    if not is_float(ta.dtype) or ta.dtype != tb.dtype:
        return None
    (sa, sb), out = parse_einsum(node.attrs["equation"], [len(ta.shape), len(tb.shape)], node)
    if any(len(set(s)) != len(s) for s in (sa, sb, out)):
        return None  # a diagonal, or a letter twice in the output
    size = {c: _joint_size(d, dict(zip(sb, tb.shape)).get(c, 1), f"{node.describe()}: subscript {c}")
            for c, d in zip(sa, ta.shape)}
    size.update({c: d for c, d in zip(sb, tb.shape) if c not in size})
    shared = [c for c in sa if c in sb]
    if any(ta.shape[sa.index(c)] != tb.shape[sb.index(c)] for c in shared if c not in out):
        return None  # a contracted dim of 1 against a longer one: numpy broadcasts it, MatMul cannot
    batch = [c for c in out if c in sa and c in sb]
    rows, cols = [c for c in out if c in sa and c not in sb], [c for c in out if c in sb and c not in sa]
    summed = [c for c in sa if c not in sb and c not in out], [c for c in sb if c not in sa and c not in out]
    contracted = [c for c in sa if c in sb and c not in out]
    at = lambda part: f"{node.key}/{part}"  # noqa: E731  (the body's own tensors)
    nodes = []

    def add(op, inputs, part, **attrs):
        nodes.append(Node(op, inputs, [at(part)], attrs, f"{node.name}/{part}"))
        return at(part)

    def constant(part, values):  # (sizes known at run time: a symbolic value)
        if any(is_symbolic(v) for v in values):
            nodes.append(symbolic_value_node(at(part), np.array(values, dtype=object), "int64"))
            return at(part)
        return g.add_constant(at(part), np.array(values, np.int64))

    def operand(src, subs, shape, extra, order, part):
        """`src` (subscripts `subs`, sizes `shape`) with the letters in `extra` summed out,
        transposed to `order`, each run of letters in it merged into one dim."""
        if extra:
            src = add(REDUCE_SUM, [src, constant(f"{part}_axes", [subs.index(c) for c in extra])], f"{part}_summed",
                      keepdims=0)
            shape = [d for c, d in zip(subs, shape) if c not in extra]
            subs = "".join(c for c in subs if c not in extra)
        perm = [subs.index(c) for c in order]
        if perm != sorted(perm):
            src = add(TRANSPOSE, [src], f"{part}_t", perm=perm)
        merged = [shape[subs.index(c)] for c in batch] + [math.prod(size[c] for c in run) for run in order_runs[part]]
        if merged != [shape[i] for i in perm]:
            src = add(RESHAPE, [src, constant(f"{part}_shape", merged)], f"{part}_merged")
        return src

    # Without batch letters A's rows stay dims of their own: MatMul makes [..., K] x [K, N] one
    # GEMM over them, and its output needs no reshape for an epilogue to fuse into it.
    row_runs = [rows] if batch else [[c] for c in rows]
    order_runs = {"a": row_runs + [contracted], "b": [contracted, cols]}
    a = operand(node.inputs[0], sa, ta.shape, summed[0], batch + rows + contracted, "a")
    b = operand(node.inputs[1], sb, tb.shape, summed[1], batch + contracted + cols, "b")
    produced = batch + rows + cols
    perm = [produced.index(c) for c in out]
    product_shape = [size[c] for c in batch] + [math.prod(size[c] for c in run) for run in row_runs] + \
        [math.prod(size[c] for c in cols)]
    unmerged = [size[c] for c in produced]
    # The last node writes the Einsum's output: MatMul, or the Reshape or Transpose after it.
    in_order = perm == sorted(perm)
    y = node.outputs[0]
    product = add(MATMUL, [a, b], "product")
    if in_order and unmerged == product_shape:
        nodes[-1].outputs = [y]
        return nodes
    unflat = add(RESHAPE, [product, constant("out_shape", unmerged)], "unmerged") \
        if unmerged != product_shape else product
    if in_order:
        nodes[-1].outputs = [y]
        return nodes
    nodes.append(Node(TRANSPOSE, [unflat], [y], {"perm": perm}, f"{node.name}/output"))
    return nodes


register(OpDef("Einsum", OUT_EWISE_FUSABLE, _einsum, _einsum_fold,
               anchor=lambda b, node, store, out: lower_einsum(b, node, store), expand=_as_matmul))
