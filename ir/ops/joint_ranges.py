"""Bounds of values that move together: each end of a value's interval as an expression of
the sizes (ir/float_sizes.py's form), bounded over every point of their grid.

Interval arithmetic forgets that two values come from the same sizes. torchvision's
detectors clip boxes to the resized image's width s, then scale them by w / s back to the
image's width w: by the intervals a box reaches 1333 * 1024 / 83 = 16445 on images of 64 to
1024 pixels a side, and Mask R-CNN, which resizes each mask to its box's size, had a
34069 x 34069 buffer planned for it. Kept as expressions, the box's ends are 0 and
s * (w / s) at each image size: at most 1024 over all of them. value_ranges.py intersects
its intervals with these where it hands bounds out.

Each op's rule is its interval rule with expressions for numbers; an op without one, or a
tensor read from around the graph, has its numeric interval as constant ends.
"""
from __future__ import annotations

import math

import numpy as np

from ..float_sizes import grid_extremes, operand
from .elementwise import ADD, CAST, CEIL, CLIP, DIV, FLOOR, MAX, MIN, MUL, NEG, RELU, ROUND, SUB, SUM
from .indexing import TOPK
from .shape import PAD


def ends_of(walk, name: str, node, moves: set, data_inputs: dict) -> tuple:
    """(lo, hi): expressions bounding `name`'s values from below and above at every point of
    the sizes, each None where nothing bounds it. walk: value_ranges' walk, with the numeric
    intervals (`memo`) of `name` and of the inputs of `node`, the op computing it (None: none
    it knows), and their `ends`; `moves` and `data_inputs` as value_ranges reads ops that move
    values."""
    g = walk.g
    if name in g.symbolic_values:
        parts = [operand(v)[0] for v in g.symbolic_values[name].reshape(-1)]
        if parts:
            return _fold("fmin", parts), _fold("fmax", parts)
    joint = (None, None)
    if node is not None and name not in g.constants and name not in g.value_ranges:
        ins = [walk.ends.get(i, (None, None)) if i else None for i in node.inputs]
        joint = _op_ends(walk, name, node, ins, moves, data_inputs) or (None, None)
    numeric = _numeric(walk.memo[name])
    return tuple(j if j is not None else n for j, n in zip(joint, numeric))


def refined(g, lo: np.ndarray, hi: np.ndarray, ends) -> tuple:
    """The intervals (lo, hi) within the extremes of `ends` over the grid of g's sizes (the
    same wherever it is asked: a loop body gets its bounds as it is inferred and lowered)."""
    if ends is None or None in ends or all(isinstance(e, float) for e in ends):
        return lo, hi
    try:
        extremes = grid_extremes(*ends, (g.symbols, g.derived))
    except RecursionError:  # (a chain of sizes thousands of ops deep: the intervals alone)
        extremes = None
    if extremes is None:
        return lo, hi
    return np.maximum(lo, extremes[0]), np.minimum(hi, extremes[1])


def _numeric(r) -> tuple:
    lo = float(np.min(r[0])) if np.size(r[0]) else math.inf
    hi = float(np.max(r[1])) if np.size(r[1]) else -math.inf
    return lo if math.isfinite(lo) else None, hi if math.isfinite(hi) else None


def _fold(op: str, parts: list):
    """parts combined by op, None where any is None."""
    if any(p is None for p in parts):
        return None
    out = parts[0]
    for p in parts[1:]:
        out = _step(op, out, p)
    return out


_NUMBERS = {"fadd": lambda a, b: a + b, "fsub": lambda a, b: a - b, "fmul": lambda a, b: a * b,
            "fdiv": lambda a, b: a / b if b else math.nan, "fmin": min, "fmax": max, "fneg": lambda a: -a,
            "floor": math.floor, "ceil": math.ceil}


def _step(op: str, *args):
    """(op, *args), None where any is None; a number where all are (as the intervals compute
    it: a chain of thousands of Adds stays one number, not an expression that deep)."""
    if any(a is None for a in args):
        return None
    if all(isinstance(a, float) for a in args):
        value = float(_NUMBERS[op](*args))
        return value if math.isfinite(value) else None
    return (op, *args)


def _op_ends(walk, name: str, node, ins: list, moves: set, data_inputs: dict):
    g, op = walk.g, node.op
    if op in moves:  # (within the union of the values moved)
        if op == TOPK and name != node.outputs[0]:  # (its indices)
            return None
        data = data_inputs.get(op, (0,))
        data = range(len(node.inputs)) if data is None else data
        present = [ins[i] for i in data if i < len(ins) and node.inputs[i]]
        if op == PAD and len(present) == 1:  # (no pad value: zeros)
            present.append((0.0, 0.0))
        return _fold("fmin", [p[0] for p in present]), _fold("fmax", [p[1] for p in present])
    (lo, hi), out_dtype = ins[0], g.types[node.outputs[0]].dtype
    if op == CAST:
        if out_dtype == "bool":
            return 0.0, 1.0
        if out_dtype.startswith(("int", "uint")) and g.types[node.inputs[0]].dtype.startswith(("float", "bfloat")):
            return _step("fsub", lo, 1.0), _step("fadd", hi, 1.0)  # (truncated: a step of slack, as the intervals)
        return lo, hi
    if op in (FLOOR, CEIL, ROUND):
        return _step("floor", lo), _step("ceil", hi)
    if op == RELU:
        return _step("fmax", lo, 0.0) if lo is not None else 0.0, _step("fmax", hi, 0.0)
    if op == NEG:
        return _step("fneg", hi), _step("fneg", lo)
    if op in (MIN, MAX):  # (one input bounds the min from above, the max from below)
        pick, present = ("fmin" if op == MIN else "fmax"), [r for n, r in zip(node.inputs, ins) if n]
        some_lo, some_hi = [r[0] for r in present if r[0] is not None], [r[1] for r in present if r[1] is not None]
        if op == MIN:
            return _fold(pick, [r[0] for r in present]), _fold(pick, some_hi) if some_hi else None
        return _fold(pick, some_lo) if some_lo else None, _fold(pick, [r[1] for r in present])
    if op == CLIP:
        low, high = (ins[k] if len(ins) > k and node.inputs[k] else None for k in (1, 2))
        if "min" in node.attrs:
            low = (float(node.attrs["min"]),) * 2
        if "max" in node.attrs:
            high = (float(node.attrs["max"]),) * 2
        if low is not None and low[0] is not None:
            lo, hi = _fold("fmax", [lo, low[0]]) if lo is not None else low[0], _step("fmax", hi, low[1])
        if high is not None and high[1] is not None:
            lo, hi = _step("fmin", lo, high[0]), _fold("fmin", [hi, high[1]]) if hi is not None else high[1]
        return lo, hi
    if op in (ADD, SUM, SUB, MUL, DIV):
        for k, (blo, bhi) in enumerate(ins[1:], 1):
            if op in (ADD, SUM):
                lo, hi = _step("fadd", lo, blo), _step("fadd", hi, bhi)
            elif op == SUB:
                lo, hi = _step("fsub", lo, bhi), _step("fsub", hi, blo)
            else:
                divisor = walk.memo[node.inputs[k]]
                if op == DIV and (out_dtype.startswith(("int", "uint")) or
                                  np.any((divisor[0] <= 0) & (divisor[1] >= 0))):
                    return None  # (a divisor that may be 0; an integer division's rounding: the intervals')
                step = "fmul" if op == MUL else "fdiv"
                corners = [_step(step, a, b) for a in (lo, hi) for b in (blo, bhi)]
                lo, hi = _fold("fmin", corners), _fold("fmax", corners)
        return lo, hi
    return None
