"""Bounds of the values a tensor can hold, from the ops that compute it: interval arithmetic.

A size read from computed data (Mask R-CNN resizes each mask to its box's size: ints cast
from boxes clipped to the image, then scaled) needs bounds before the model runs, since
memory is planned at the greatest size. `value_range(g, name)` walks back from a tensor
through the ops that compute it and returns (lo, hi): float64 arrays, either of the
tensor's static shape (one interval per element, for tensors of at most ELEMENTWISE
elements: a `[1, 1, h, w]` sizes vector keeps its exact 1s) or 0-d (one interval for every
element). None where an op on the way is one it does not know, or a graph input has no
bounds: the caller then refuses by name. The bounds hold for float32 arithmetic because the
module checks each size read against them before using it (orchestrator/bundle.py's
`_after_count`): an interval off by a rounding step would be a named error, never a wrong
buffer.
"""
from __future__ import annotations

import contextvars
import functools
import math

import numpy as np

from ..symbolic import Dim, greatest, least
from .elementwise import (ABS, ADD, CAST, CEIL, CLIP, DIV, EXP, FLOOR, LOG, MAX, MIN, MUL, NEG, RELU, ROUND, SIGMOID,
                          SQRT, SUB, SUM, TANH, WHERE)
from .indexing import GATHER_ELEMENTS, GATHER_ND, TILE, TOPK
from .joint_ranges import ends_of, refined
from .reduce import MAX_POOL, REDUCE_MAX, REDUCE_MEAN, REDUCE_MIN, REDUCE_SUM
from .registry import op_def
from .shape import (CONCAT, EXPAND, FLATTEN, GATHER, IDENTITY, PAD, RESHAPE, SLICE, SPLIT, SQUEEZE, TRANSPOSE,
                    UNSQUEEZE)

ELEMENTWISE = 64  # a tensor this small keeps one interval per element
_PRODUCERS = contextvars.ContextVar("kiln_producers", default=None)  # (graph, {tensor: node}) while inferring

# Ops that move values without changing them: their result's intervals are the op applied to
# the intervals (each input that is data replaced by its lo, then its hi), or the union.
_MOVES = {IDENTITY, RESHAPE, SQUEEZE, UNSQUEEZE, FLATTEN, CONCAT, GATHER, SLICE, TRANSPOSE, EXPAND, TILE, SPLIT,
          GATHER_ELEMENTS, GATHER_ND, REDUCE_MAX, REDUCE_MIN, TOPK, PAD, WHERE, MAX_POOL}
# (which inputs hold the values moved; the rest, where given, are parameters: indices, axes, pads)
_DATA_INPUTS = {PAD: (0, 2), WHERE: (1, 2), CONCAT: None}  # (None: every input; others: the first)
_MONOTONE = {FLOOR: np.floor, CEIL: np.ceil, ROUND: np.round, RELU: lambda x: np.maximum(x, 0), EXP: np.exp,
             SQRT: lambda x: np.sqrt(np.maximum(x, 0)), SIGMOID: lambda x: 1 / (1 + np.exp(-x)), TANH: np.tanh,
             LOG: lambda x: np.log(np.maximum(x, 0))}


class producing_nodes:
    """While type inference walks `g`: its producers so far, for value_range (a `with`)."""

    def __init__(self, g, producers: dict):
        self.pair = (g, producers)

    def __enter__(self):
        self.token = _PRODUCERS.set(self.pair)

    def __exit__(self, *exc):
        _PRODUCERS.reset(self.token)


def value_range(g, name: str):
    """(lo, hi) bounding every value of tensor `name` (see the module's docstring), or None."""
    return value_ranges(g, [name])[name]


def value_ranges(g, names: list) -> dict:
    """{name: value_range(g, name)} for each of `names`, walking the graph once."""
    walk = _Walk(g, producers_of(g))
    out = {}
    for name in names:
        lo, hi = refined(g, *walk.range(name), walk.ends.get(name))  # (tighter where values move together)
        out[name] = (lo, hi) if np.all(np.isfinite(lo)) and np.all(np.isfinite(hi)) else None
    return out


def producers_of(g) -> dict:
    """{tensor: the node computing it} in g (as far as type inference has come, while it runs)."""
    pair = _PRODUCERS.get()
    return pair[1] if pair is not None and pair[0] is g else {o: n for n in g.nodes for o in n.outputs if o}


_KNOWN = _MOVES | set(_MONOTONE) | {CAST, NEG, ABS, CLIP, ADD, SUB, MUL, DIV, SUM, REDUCE_SUM, REDUCE_MEAN, MAX, MIN}


def unbounded_origin(g, name: str) -> str:
    """Where the bounds of `name`'s values are lost, for an error: the first tensor back
    along its unbounded inputs that is a graph input, or the node that derives none."""
    current, node = unbounded_source(g, name)
    if current in g.unbounded_why:
        return g.unbounded_why[current]
    if node is None:
        return f"the values of '{current}', which the graph {'reads' if current in g.inputs else 'gets'}, " \
               "have no bounds"
    return f"{node.describe()} gives '{current}' values Kiln cannot bound"


def unbounded_source(g, name: str) -> tuple:
    """(tensor, the node computing it or None): where unbounded_origin says the bounds of
    `name`'s values are lost."""
    producers = producers_of(g)
    walk = _Walk(g, producers)

    def bounded(t):
        lo, hi = walk.range(t)
        return np.all(np.isfinite(lo)) and np.all(np.isfinite(hi))
    current = name
    while True:
        node = producers.get(current)
        if node is None:
            return current, None
        loose = [i for i in node.inputs if i and not bounded(i)]
        if node.op not in _KNOWN or not loose:
            return current, node
        current = loose[0]


def _whole(r):
    lo, hi = r
    return np.array(np.min(lo) if np.size(lo) else math.inf), np.array(np.max(hi) if np.size(hi) else -math.inf)


def _shaped(g, name: str, r):
    """r as intervals of `name`'s elements where its shape is static and small, else 0-d."""
    t = g.types.get(name)
    lo, hi = (np.asarray(x, np.float64) for x in r)
    if t is not None and t.is_static and t.size <= ELEMENTWISE:
        if lo.shape == hi.shape == tuple(t.shape):
            return lo, hi
        if lo.ndim == hi.ndim == 0:  # (one interval for all: each element's)
            return np.full(t.shape, lo), np.full(t.shape, hi)
    return _whole((lo, hi))


_UNBOUNDED = (np.array(-math.inf), np.array(math.inf))


class _Walk:
    """Intervals of tensors, each computed once, walking back through the producers of the
    ops it knows (without recursion: a chain may be thousands of nodes long); an unknown op or
    an unbounded input is (-inf, inf), which an op after it may still bound (a Clip, a Min
    with a constant)."""

    def __init__(self, g, producers: dict):
        self.g, self.producers, self.memo = g, producers, {}
        self.ends = {}  # (tensor: its interval's ends as expressions of the sizes: ir/ops/joint_ranges.py)

    def range(self, name: str):
        if name in self.memo:
            return self.memo[name]
        order, stack, seen = [], [(name, False)], set()
        while stack:  # (post-order: each tensor after the inputs its op reads)
            t, ready = stack.pop()
            if ready:
                order.append(t)
                continue
            if t in self.memo or t in seen:
                continue
            seen.add(t)
            stack.append((t, True))
            node = self._walked(t)
            stack += [(i, False) for i in (node.inputs if node is not None else ()) if i]
        for t in order:
            r = self._compute(t)
            lo, hi = (np.asarray(x, np.float64) for x in (r if r is not None else _UNBOUNDED))
            self.memo[t] = _shaped(self.g, t, (np.where(np.isnan(lo), -math.inf, lo),
                                               np.where(np.isnan(hi), math.inf, hi)))
            self.ends[t] = ends_of(self, t, self._walked(t), _MOVES, _DATA_INPUTS)
        return self.memo[name]

    def _walked(self, name: str):
        """The node computing `name` where its inputs' ranges are needed, else None."""
        g = self.g
        if name in g.constants or name in g.symbolic_values or name in g.value_ranges:
            return None
        node = self.producers.get(name)
        return node if node is not None and node.op in _KNOWN else None

    def _compute(self, name: str):
        g = self.g
        if name in g.constants:
            v = np.asarray(g.constants[name])
            if v.dtype.kind not in "iufb":
                return None
            v = v.astype(np.float64)
            return (v, v) if v.size <= ELEMENTWISE else (np.array(v.min(initial=math.inf)),
                                                         np.array(v.max(initial=-math.inf)))
        if name in g.symbolic_values:
            return _symbolic_range(g.symbolic_values[name])
        if name in g.value_ranges:  # (given: a loop body's tensors from the graph around it)
            return g.value_ranges[name]
        node = self._walked(name)
        return None if node is None else _op_range(self, node, node.outputs.index(name))


def _symbolic_range(values):
    lo, hi = np.empty(values.shape), np.empty(values.shape)
    for i, v in enumerate(values.reshape(-1)):
        if isinstance(v, (Dim, int, np.integer)):
            lo.reshape(-1)[i], hi.reshape(-1)[i] = least(v), greatest(v)
        elif hasattr(v, "lo"):  # (a FloatSize: ir/float_sizes.py)
            lo.reshape(-1)[i], hi.reshape(-1)[i] = v.lo, v.hi
        else:
            lo.reshape(-1)[i] = hi.reshape(-1)[i] = float(v)
    return lo, hi


def _op_range(walk: _Walk, node, index: int):
    g, op = walk.g, node.op
    ins = [walk.range(i) if i else None for i in node.inputs]
    if op in _MOVES:
        data = _DATA_INPUTS.get(op, (0,))
        if data is None:
            data = tuple(range(len(node.inputs)))
        if op == TOPK and index == 1:  # (indices, not values)
            return None
        moved = _moved(g, node, index, ins, data)
        if moved is not None:
            return moved
        present = [ins[i] for i in data if i < len(ins) and node.inputs[i]]
        if op == PAD and len(data) == 2 and (len(node.inputs) < 3 or not node.inputs[2]):
            present.append((np.array(0.0), np.array(0.0)))
        wholes = [_whole(r) for r in present]
        return np.array(min(w[0] for w in wholes)), np.array(max(w[1] for w in wholes))
    if op in _MONOTONE:
        f = _MONOTONE[op]
        with np.errstate(all="ignore"):
            return f(ins[0][0]), f(ins[0][1])
    if op == CAST:
        to = g.types[node.outputs[0]].dtype
        lo, hi = ins[0]
        if to == "bool":
            return np.zeros_like(lo), np.ones_like(hi)
        if to.startswith(("int", "uint")) and g.types[node.inputs[0]].dtype.startswith(("float", "bfloat")):
            return np.trunc(lo) - 1, np.trunc(hi) + 1  # (truncated toward zero: one step of slack for rounding)
        return lo, hi
    if op == NEG:
        return -ins[0][1], -ins[0][0]
    if op == ABS:
        lo, hi = ins[0]
        return np.where((lo <= 0) & (hi >= 0), 0.0, np.minimum(abs(lo), abs(hi))), np.maximum(abs(lo), abs(hi))
    if op == CLIP:
        lo, hi = ins[0]
        low = ins[1] if len(ins) > 1 and ins[1] is not None else None
        high = ins[2] if len(ins) > 2 and ins[2] is not None else None
        if "min" in node.attrs:
            low = (np.array(node.attrs["min"]),) * 2
        if "max" in node.attrs:
            high = (np.array(node.attrs["max"]),) * 2
        if low is not None:
            lo, hi = np.maximum(lo, low[0]), np.maximum(hi, low[1])
        if high is not None:
            lo, hi = np.minimum(lo, high[0]), np.minimum(hi, high[1])
        return lo, hi
    if op in (MAX, MIN):  # (elementwise, broadcasting: an unbounded side bounds one end still)
        pick = np.maximum if op == MAX else np.minimum
        present = [r for i, r in zip(node.inputs, ins) if i]
        return functools.reduce(pick, [r[0] for r in present]), functools.reduce(pick, [r[1] for r in present])
    if op in (ADD, SUB, MUL, DIV, SUM):
        return _arithmetic(g, node, op, ins)
    if op in (REDUCE_SUM, REDUCE_MEAN):
        lo, hi = _whole(ins[0])
        n = greatest(g.types[node.inputs[0]].size) if op == REDUCE_SUM else 1
        return np.array(min(lo, lo * n)), np.array(max(hi, hi * n))
    return None


def _moved(g, node, index: int, ins: list, data: tuple):
    """The op evaluated on the lower and then the upper intervals, where every input that is
    not data is a constant (Gather's indices, Slice's starts) and every data input keeps one
    interval per element; None otherwise."""
    evaluate = op_def(node.op).evaluate if op_def(node.op) else None
    if evaluate is None or node.op in (TOPK, MAX_POOL):
        return None
    for i, name in enumerate(node.inputs):
        if not name:
            continue
        if i in data:
            t = g.types.get(name)
            if t is None or not t.is_static or ins[i][0].shape != tuple(t.shape):
                return None
        elif name not in g.constants:
            return None
    out = []
    for side in (0, 1):
        values = [None if not name else ins[i][side] if i in data else g.constants[name]
                  for i, name in enumerate(node.inputs)]
        try:
            with np.errstate(all="ignore"):
                result = evaluate({**node.attrs, **g.params.get(node.key, {})}, values, g, node)
        except Exception:  # (an evaluator that wants its real dtype: fall back to the union)
            return None
        out.append(np.asarray(result[index], np.float64))
    if node.op == WHERE:  # (picks between inputs: each side may come from either)
        return np.minimum(out[0], out[1]), np.maximum(out[0], out[1])
    return out[0], out[1]


def _arithmetic(g, node, op: str, ins: list):
    (alo, ahi), *rest = ins
    with np.errstate(all="ignore"):  # (inf * 0: NaN, read as unbounded)
        return _combined(g, node, op, alo, ahi, rest)


def _combined(g, node, op: str, alo, ahi, rest):
    for blo, bhi in rest:
        if op in (ADD, SUM):
            alo, ahi = alo + blo, ahi + bhi
        elif op == SUB:
            alo, ahi = alo - bhi, ahi - blo
        elif op == MUL:
            corners = [alo * blo, alo * bhi, ahi * blo, ahi * bhi]
            alo, ahi = np.minimum.reduce(corners), np.maximum.reduce(corners)
        else:
            if np.any((blo <= 0) & (bhi >= 0)):
                return None  # (a divisor that may be 0)
            corners = [alo / blo, alo / bhi, ahi / blo, ahi / bhi]
            alo, ahi = np.minimum.reduce(corners), np.maximum.reduce(corners)
            if g.types[node.outputs[0]].dtype.startswith(("int", "uint")):
                alo, ahi = np.floor(alo) - 1, np.ceil(ahi) + 1
    return alo, ahi
