"""The value symbols' expressions (ir/value_symbols.py) as a manifest stores them, evaluated:
in Python when `Module.run` binds a call's symbols, and as C for the entry function, which
computes them from the input buffers before it checks anything. Both follow one meaning:
integers, `div` the floor of a non-negative numerator (0 where the divisor is 0), `select`
evaluating only the operand it picks.
"""
from __future__ import annotations

from .manifest import dim_c, dim_value

_C_TYPES = {"int64": "long long", "int32": "int"}


def value(expr, values: dict, read) -> int:
    """expr's value: `values` the symbols' (those it uses computed), read(input, index) an
    input element."""
    if isinstance(expr, int):
        return expr
    op, args = expr[0], expr[1:]
    if op == "dim":
        return dim_value(args[0], values)
    if op == "read":
        return int(read(args[0], args[1]))
    if op == "select":
        return value(args[1] if value(args[0], values, read) else args[2], values, read)
    a, b = (value(e, values, read) for e in args)
    if op == "div":
        return a // b if b else 0
    return {"add": a + b, "sub": a - b, "mul": a * b, "min": min(a, b), "max": max(a, b), "eq": int(a == b),
            "lt": int(a < b)}[op]


def c(expr, order: list, inputs: list) -> str:
    """expr as a C expression (long long) of dims[] (the symbols in `order`) and the entry's
    `inputs` (the model's input names in order)."""
    if isinstance(expr, int):
        return f"{expr}LL"
    op, args = expr[0], expr[1:]
    if op == "dim":
        return dim_c(args[0], order)
    if op == "read":
        return f"((long long)((const {_C_TYPES[args[2]]}*)inputs[{inputs.index(args[0])}])[{args[1]}])"
    if op == "select":
        return f"({c(args[0], order, inputs)} ? {c(args[1], order, inputs)} : {c(args[2], order, inputs)})"
    a, b = (c(e, order, inputs) for e in args)
    if op == "div":  # (operands evaluated once each: they may be long)
        return f"kiln_div({a}, {b})"
    if op in ("min", "max"):
        return f"kiln_{op}({a}, {b})"
    return f"({a} {dict(add='+', sub='-', mul='*', eq='==', lt='<')[op]} {b})"


C_HELPERS = ["static inline long long kiln_div(long long a, long long b) { return b ? a / b : 0; }",
             "static inline long long kiln_min(long long a, long long b) { return a < b ? a : b; }",
             "static inline long long kiln_max(long long a, long long b) { return a > b ? a : b; }"]
