"""Symbols a call reads from its inputs' values: shape parameters fed at run time.

ONNX lets a Reshape's shape, a Slice's starts and ends, an Expand's shape, a Tile's repeats,
a Pad's pads, a Range's limits or a ConstantOfShape's shape arrive as graph inputs (onnx's
own node test cases feed them so). Their values decide output sizes, so Kiln cannot know
them when it builds; it can bound them. Where such a parameter is an integer graph input of
a fixed shape, type inference makes each size it decides a *value symbol*: a symbol defined
by an expression over the input's elements (`read`) and the other symbols, within bounds:
  - those the op allows, where it allows any: a Reshape's dims at most the elements it has
    (0 copying a dim and -1 inferred as ONNX says), a Slice's start and length within the dim;
  - else those the user gives the input's values (`--dim shape=1..64` for every element,
    `--dim 'shape[1]=1..8'` for one; `Graph.value_bounds`): its elements become symbols
    `shape[k]` (`bind_fed_values`), a symbolic value like a Shape's (ir/ops/inference.py),
    which every op taking sizes from a tensor reads.
It is a derived symbol like `symbolic.floor_div`'s, so everything after inference
treats it as any other symbol: `Graph.derived` holds its definition (a `Computed`), the
module evaluates it at the start of a call after the caller's symbols, checks its bounds
and the equalities the op needs (a Reshape's sizes must multiply to the elements), and the
kernels read its value like any symbol's.

Expressions are tuples: (op, *operands) with operands ints, Dims, `read`s and expressions.
Ops: add, sub, mul, div (floor of a non-negative numerator by a positive divisor, 0 where
the divisor is 0), min, max, select (c, a, b), eq, lt (1 or 0); and float32 steps with
float constants (ir/float_sizes.py): float (an integer as float32), fadd, fsub, fmul, fdiv,
fmin, fmax, floor, ceil, fneg, and trunc (back to an integer). `to_json` gives the form the
manifest stores and artifacts/expressions.py evaluates (in Python and as C).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..artifacts import expressions
from .errors import KilnError
from .symbolic import _DERIVED, COUNTED, Dim, definition_symbols, dim_to_json, greatest, late_symbols_in, least

MAX_VALUE_ELEMENTS = 64  # a shape parameter is a short vector, not data


@dataclass(frozen=True)
class Computed:
    """A value symbol's definition (in Graph.derived), and where it comes from for messages."""
    expr: tuple
    what: str


def _fed(g, name: str) -> bool:
    """Can a call's values of `name` be read as a shape parameter: an integer graph input of
    a fixed, small shape, whose values are not sizes known already (a loop body's captured
    image height), and which the caller gives (not a loop body's: Graph.inputs_from_around)?"""
    t = g.types.get(name)
    return name in g.inputs and not g.inputs_from_around and name not in g.constants \
        and name not in g.symbolic_values and t is not None and t.dtype in ("int64", "int32") and t.is_static \
        and t.size <= MAX_VALUE_ELEMENTS


def runtime_values(g, node, index: int) -> list | None:
    """The elements of input `index` of `node` as `read` expressions where it is fed at run
    time (`_fed`), else None."""
    if index >= len(node.inputs) or not node.inputs[index] or not _fed(g, node.inputs[index]):
        return None
    name, t = node.inputs[index], g.types[node.inputs[index]]
    return [("read", name, k, t.dtype) for k in range(t.size)]


def bounds_hint(g, names: list) -> str:
    """What an error adds where an op could read these inputs' values at run time, given
    bounds: how to give them."""
    fed = [n for n in names if _fed(g, n)]
    if not fed:
        return ""
    return (f"; to read its values at run time, bound them: --dim {fed[0]}=LEAST..GREATEST "
            f"(dims={{'{fed[0]}': (0, 64)}} in Python)")


def value_bounds(g, given: dict) -> dict:
    """The user's bounds (`dims`) that name no input dim: each must name a fed input
    (`shape`) or one of its elements (`shape[1]`)."""
    for name in given:
        tensor, _, rest = name.partition("[")
        element = rest[:-1] if rest.endswith("]") else None
        ok = _fed(g, tensor) and (not rest or (element is not None and element.isdigit() and
                                               int(element) < g.types[tensor].size))
        if not ok:
            fed = [i for i in g.inputs if _fed(g, i)]
            raise KilnError(f"--dim {name}: no input has a dim of that name, and it names no element of an integer "
                            f"input whose values a call may read (dims: {', '.join(sorted(_dim_names(g))) or 'none'}; "
                            f"such inputs: {', '.join(fed) or 'none'})")
    return dict(given)


def _dim_names(g) -> set:
    return {s for name in g.inputs for d in g.types[name].shape if isinstance(d, Dim) for s in d.symbols}


def bind_fed_values(g) -> None:
    """Each fed input the user bounded becomes a symbolic value: its elements symbols
    `name[k]`, read at the start of a call (type inference calls this first)."""
    for name in g.inputs:
        if not _fed(g, name):
            continue
        t = g.types[name]
        bounds = [g.value_bounds.get(f"{name}[{k}]", g.value_bounds.get(name)) for k in range(t.size)]
        if all(b is None for b in bounds):
            continue
        if any(b is None for b in bounds):
            missing = [f"{name}[{k}]" for k, b in enumerate(bounds) if b is None]
            raise KilnError(f"input '{name}': bounds given for some of its values but not {', '.join(missing)} "
                            f"(--dim {name}=LEAST..GREATEST bounds them all)")
        g.symbolic_values[name] = np.array(
            [define(f"{name}[{k}]", ("read", name, k, t.dtype), lo, hi, f"element {k} of input '{name}'")
             for k, (lo, hi) in enumerate(bounds)], dtype=object).reshape(t.shape)


def define(name: str, expr, least: int, greatest: int, what: str) -> Dim:
    """A value symbol `name` = expr (within [least, greatest]), recorded while type inference
    runs (symbolic.deriving_symbols): a symbol after those it is computed from."""
    place = _DERIVED.get()
    if place is None:
        raise TypeError(f"{what} is read from a tensor at run time")
    symbols, derived = place
    expr = simplified(expr)
    if isinstance(expr, (int, np.integer)) and name not in derived:  # (known now: a size, no symbol)
        return int(expr)
    if name not in derived:
        symbols[name] = (int(least), int(greatest))
        derived[name] = Computed(expr, what)
    return Dim.symbol(name, *symbols[name])


def simplified(expr):
    """expr with each operation on plain ints computed (x[:5]'s bounds fold to ints)."""
    if not isinstance(expr, tuple) or expr[0] in ("read", COUNTED):
        return expr
    operands = [simplified(e) for e in expr[1:]]
    if all(isinstance(e, (int, np.integer)) for e in operands):
        return expressions.value((expr[0], *operands), {}, None)
    if expr[0] == "select" and isinstance(operands[0], (int, np.integer)):
        return operands[1] if operands[0] else operands[2]
    return (expr[0], *operands)


def counted(name: str, tensor: str, greatest: int, what: str, least: int = 0) -> Dim:
    """A size that a kernel counts while the call runs and writes to `tensor` (an int64
    scalar: NonZero's count of elements): the symbol `name`, in [least, greatest]. The
    module plans memory and sizes the outputs at the greatest, reads the value once that
    kernel has run, and hands the caller outputs of the counted size."""
    place = _DERIVED.get()
    if place is not None and name in place[1] and place[1][name].expr == (COUNTED, None):
        place[1][name] = Computed((COUNTED, tensor), what)  # (claimed again, where it was)
    return define(name, (COUNTED, tensor), least, greatest, what)


def counted_tensors(g) -> set:
    """The tensors counted sizes are read from (each must survive to the module)."""
    return {d.expr[1] for d in g.derived.values() if isinstance(d, Computed) and d.expr[0] == COUNTED}


def counted_tensors_of(size) -> list:
    """The tensors the late sizes in `size` wait for: those their counts are read from
    (during type inference)."""
    place = _DERIVED.get()
    if place is None:
        return []
    derived, late, tensors = place[1], late_symbols_in(size), []
    while late:  # (a symbol computed from counts waits for each of them)
        s = late.pop()
        definition = derived[s]
        if isinstance(definition, Computed) and definition.expr[0] == COUNTED:
            tensors.append(definition.expr[1])
        else:
            late += [t for t in definition_symbols(definition) if t in derived]
    return sorted(set(tensors))


def forget_counts(g) -> None:
    """Before type inference runs again: each counted size waits to be claimed anew by a node
    that counts it (`counted`), in its place (symbols computed from it stay after it), so a
    counting node a pass removed (merged into its twin by CSE, or dead) leaves no size the
    module would wait for in vain (drop_dangling)."""
    for name, d in g.derived.items():
        if isinstance(d, Computed) and d.expr[0] == COUNTED and name not in g.outer_symbols:
            g.derived[name] = Computed((COUNTED, None), d.what)


def drop_dangling(g) -> None:
    """After type inference: forget the counts no node claimed, and the symbols computed from
    them (nothing reads them: what did went with the count's node)."""
    for name, definition in list(g.derived.items()):
        unclaimed = isinstance(definition, Computed) and definition.expr == (COUNTED, None)
        if name not in g.outer_symbols and (unclaimed or not definition_symbols(definition) <= set(g.symbols)):
            del g.derived[name], g.symbols[name]


def select(c, a, b):
    return ("select", c, a, b)


def eq(a, b):
    return ("eq", a, b)


def lt(a, b):
    return ("lt", a, b)


def clamp(v, lo, hi):
    return ("min", ("max", v, lo), hi)


def to_json(expr):
    """The manifest's form: a Dim as ["dim", terms], a read as ["read", input, index, dtype]."""
    if isinstance(expr, (int, np.integer)):
        return int(expr)
    if isinstance(expr, float):  # (a float32 constant of ir/float_sizes.py's steps)
        return expr
    if isinstance(expr, Dim):
        return ["dim", dim_to_json(expr)]
    return [expr[0], *(to_json(e) if not isinstance(e, str) else e for e in expr[1:])]


def at_greatest(size, maximal: set, derived: dict):
    """`size` where every symbol in `maximal` takes its greatest value (and each computed
    from one, its value then), as a size over the other symbols, or None where their bounds
    do not decide it. A slice x[:, :w] of a row whose length the data decide is w wherever
    the row is at its longest: Mask R-CNN's pasted masks are the image's width."""
    def symbol(s: str, lo: int, hi: int):
        d = derived.get(s)
        computed = isinstance(d, Computed) and d.expr[0] not in ("read", COUNTED, "after")
        if computed and (s in maximal or definition_symbols(d) & maximal):
            return evaluate(d.expr)
        return hi if s in maximal else Dim.symbol(s, lo, hi)

    def evaluate(e):
        if isinstance(e, (int, np.integer)):
            return int(e)
        if isinstance(e, Dim):
            values = {s: symbol(s, lo, hi) for s, lo, hi in e.bounds}
            if any(v is None for v in values.values()):
                return None
            total = 0
            for monomial, c in e.terms:
                term = c
                for s in monomial:
                    term = term * values[s]
                total = total + term
            return total
        if not isinstance(e, tuple) or e[0] in ("read", COUNTED, "after"):
            return None
        args = [evaluate(a) for a in e[1:]]
        if any(a is None for a in args):
            return None
        op, a, b = e[0], args[0], args[-1]
        if op in ("add", "sub", "mul"):
            return a + b if op == "add" else a - b if op == "sub" else a * b
        if op in ("min", "max"):  # (decided where one's range lies wholly below the other's)
            low, high = (a, b) if greatest(a) <= least(b) else (b, a) if greatest(b) <= least(a) else (None, None)
            return low if op == "min" else high
        if op == "lt" and (greatest(a) < least(b) or least(a) >= greatest(b)):
            return int(greatest(a) < least(b))
        if op == "eq" and isinstance(a, int) and isinstance(b, int):
            return int(a == b)
        if op == "select" and a in (0, 1):
            return args[1] if a == 1 else args[2]
        if op == "div" and isinstance(b, int) and b > 0 and (isinstance(a, int) or b == 1):
            return a // b if isinstance(a, int) else a
        return None
    return evaluate(size)
