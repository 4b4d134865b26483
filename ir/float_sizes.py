"""Sizes computed in float32 at run time: torchvision's detectors resize an image of any size
by `scale = min(800 / min(h, w), 1333 / max(h, w))` to `floor(h * scale)`, Casts, a
Reciprocal, Muls and a Floor on the image's Shape. Type inference follows such a chain as
`FloatSize` values (an expression over the symbols, and an interval holding every value it
takes within their bounds); the Cast back to an integer makes a value symbol the module
computes before it runs (ir/value_symbols.py), in float32 step by step as the ops do
(artifacts/expressions.py), so the size is the one onnxruntime computes. The ops themselves
still run, on the tensors, for whatever reads their values as data.
"""
from __future__ import annotations

import math

import numpy as np

from .symbolic import COUNTED, Dim, greatest, least
from .value_symbols import define

# Interval ends are widened by this much of their magnitude: float32 rounding at each step
# may land a value just outside bounds computed in float64.
_SLACK = 1e-5


class FloatSize:
    """A float32 value computed from sizes: `expr` (value_symbols' form, float ops) within
    [lo, hi]."""
    __slots__ = ("expr", "lo", "hi")

    def __init__(self, expr, lo: float, hi: float):
        self.expr, self.lo, self.hi = expr, lo, hi

    def __repr__(self) -> str:
        return f"FloatSize({self.expr}, {self.lo}..{self.hi})"


def operand(x):
    """(expression, lo, hi) of an operand: a FloatSize, a size (Dim or int) or a float."""
    if isinstance(x, FloatSize):
        return x.expr, x.lo, x.hi
    if isinstance(x, (Dim, int, np.integer)):
        return ("float", x if isinstance(x, Dim) else int(x)), float(least(x)), float(greatest(x))
    return float(np.float32(x)), float(np.float32(x)), float(np.float32(x))


def _widened(lo: float, hi: float) -> tuple:
    return lo - _SLACK * (abs(lo) + 1), hi + _SLACK * (abs(hi) + 1)


def _products(a, b) -> list:
    return [a[1] * b[1], a[1] * b[2], a[2] * b[1], a[2] * b[2]]


def combine(op: str, *args):
    """The FloatSize of `op` (fadd, fsub, fmul, fdiv, fmin, fmax, floor, ceil, fneg) over
    operands, None where its interval would be unbounded (a divisor that may be 0)."""
    p = [operand(a) for a in args]
    if op == "fadd":
        lo, hi = p[0][1] + p[1][1], p[0][2] + p[1][2]
    elif op == "fsub":
        lo, hi = p[0][1] - p[1][2], p[0][2] - p[1][1]
    elif op == "fmul":
        lo, hi = min(_products(*p)), max(_products(*p))
    elif op == "fdiv":
        if p[1][1] <= 0 <= p[1][2]:
            return None
        inverse = (None, 1 / p[1][2], 1 / p[1][1])
        lo, hi = min(_products(p[0], inverse)), max(_products(p[0], inverse))
    elif op in ("fmin", "fmax"):
        pick = min if op == "fmin" else max
        lo, hi = pick(p[0][1], p[1][1]), pick(p[0][2], p[1][2])
    elif op == "fneg":
        lo, hi = -p[0][2], -p[0][1]
    elif op in ("floor", "ceil"):
        lo, hi = p[0][1], p[0][2]
    else:
        raise ValueError(op)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return None
    lo, hi = _widened(lo, hi)
    if op in ("floor", "ceil"):  # (of the widened ends: still below and above every value)
        step = math.floor if op == "floor" else math.ceil
        lo, hi = step(lo), step(hi)
    return FloatSize((op, *(e for e, _, _ in p)), lo, hi)


# Bounds are found by evaluating the expression at every point of its symbols' ranges where
# there are at most this many (two sizes up to about 2000); beyond, from the intervals.
GRID_POINTS = 1 << 22


def to_size(x: FloatSize, name: str, what: str):
    """A Cast of x to an integer (truncated toward zero, as C and onnxruntime cast): a value
    symbol `name` the module computes before it runs, or None where it may be negative (no
    size: the Cast runs on the data). Its bounds are exact where the grid of its symbols is
    small: intervals lose how the terms move together (h * 320 / min(h, w) reaches 5120 on
    [64, 1024]^2 by the intervals, the min with 640 / max(h, w) keeps it under 640), and a
    bound too wide is memory planned for nothing."""
    lo, hi = _grid_bounds(x.expr)
    if lo is None:
        lo, hi = math.trunc(x.lo), math.trunc(x.hi)
    if not 0 <= lo <= hi < (1 << 62):
        return None
    return define(name, ("trunc", x.expr), lo, hi, what)


def as_float_size(v):
    """A Cast to float32: of a size, a FloatSize; of a FloatSize or a number, itself rounded."""
    if isinstance(v, FloatSize):
        return v
    if isinstance(v, Dim):
        expr, lo, hi = operand(v)
        return FloatSize(expr, *_widened(lo, hi))
    return float(np.float32(v))


def is_float_size(v) -> bool:
    return isinstance(v, FloatSize)


def _grid_bounds(expr) -> tuple:
    """(least, greatest) of trunc(expr) over every point of its symbols' ranges, or (None,
    None) where it reads an input's values or a count, or the points are too many."""
    values = on_grid([expr])
    if values is None:
        return None, None
    return int(values[0].min()), int(values[0].max())


def grid_extremes(lo, hi, place: tuple) -> tuple | None:
    """(least of `lo`, greatest of `hi`) over every point of their symbols' ranges, as
    on_grid evaluates them: float32 step by step, widened by the rounding slack; None where
    on_grid has no grid for them."""
    values = on_grid([lo, hi], place)
    if values is None:
        return None
    return _widened(float(values[0].min()), float(values[1].max()))


def on_grid(exprs: list, place: tuple | None = None) -> list | None:
    """Each expression evaluated at every point of its symbols' ranges (numpy arrays that
    broadcast over the grid), or None where one reads an input's values or a count, or the
    points are more than GRID_POINTS. Shared subexpressions are evaluated once. place: the
    graph's (symbols, derived), by default those type inference is deriving."""
    from .symbolic import _DERIVED
    from .value_symbols import Computed
    place = place or _DERIVED.get()
    if place is None:
        return None
    symbols, derived = place
    base: dict = {}
    seen: set = set()

    def collect(e) -> bool:
        if id(e) in seen:
            return True
        seen.add(id(e))
        if isinstance(e, Dim):
            return all(collect_symbol(s) for s, _, _ in e.bounds)
        if isinstance(e, tuple):
            return e[0] not in ("read", COUNTED) and all(collect(a) for a in e[1:] if not isinstance(a, str))
        return True

    def collect_symbol(s: str) -> bool:
        d = derived.get(s)
        if d is None:
            base[s] = symbols[s]
            return True
        return collect(d[0]) if isinstance(d, tuple) else isinstance(d, Computed) and collect(d.expr)

    if not all(collect(e) for e in exprs) or math.prod(hi - lo + 1 for lo, hi in base.values()) > GRID_POINTS:
        return None
    names = sorted(base)
    axes = np.meshgrid(*(np.arange(lo, hi + 1, dtype=np.int64) for lo, hi in (base[n] for n in names)),
                       indexing="ij", sparse=True)
    grid, values, done = dict(zip(names, axes)), {}, {}

    def symbol(s: str):
        if s not in values:
            d = derived.get(s)
            values[s] = grid[s] if d is None else \
                np.floor_divide(evaluate(d[0]), d[1]) if isinstance(d, tuple) else evaluate(d.expr)
        return values[s]

    def evaluate(e):
        if id(e) in done:
            return done[id(e)][1]
        if isinstance(e, Dim):
            total = np.int64(0)
            for monomial, c in e.terms:
                term = np.int64(c)
                for s in monomial:
                    term = term * symbol(s)
                total = total + term
            out = total
        elif isinstance(e, (int, np.integer)):
            out = np.int64(e)
        elif isinstance(e, float):
            out = np.float32(e)
        else:
            out = _GRID_STEPS[e[0]](*(evaluate(a) for a in e[1:]))
        done[id(e)] = (e, out)  # (e kept alive: its id is not reused while this runs)
        return out

    with np.errstate(all="ignore"):
        return [np.asarray(evaluate(e)) for e in exprs]


_GRID_STEPS = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "min": np.minimum, "max": np.maximum,
    "div": lambda a, b: np.where(b != 0, np.floor_divide(a, np.where(b != 0, b, 1)), 0),
    "eq": lambda a, b: (a == b).astype(np.int64), "lt": lambda a, b: (a < b).astype(np.int64),
    "select": lambda c, a, b: np.where(c != 0, a, b),
    "float": lambda a: np.asarray(a).astype(np.float32),
    "fadd": np.add, "fsub": np.subtract, "fmul": np.multiply, "fdiv": np.divide, "fmin": np.minimum,
    "fmax": np.maximum, "floor": np.floor, "ceil": np.ceil, "fneg": np.negative,
    "trunc": lambda a: np.trunc(a).astype(np.int64),
}
