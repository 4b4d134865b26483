"""The value symbols' expressions (ir/value_symbols.py) as a manifest stores them, evaluated:
in Python when `Module.run` binds a call's symbols, and as C for the entry function, which
computes them from the input buffers before it checks anything. Both follow one meaning:
integers, `div` the floor of a non-negative numerator (0 where the divisor is 0), `select`
evaluating only the operand it picks.
"""
from __future__ import annotations

from .manifest import dim_c, dim_value

_C_TYPES = {"int64": "long long", "int32": "int"}


# Float32 steps (ir/float_sizes.py: a size computed as an image's resize is), each rounded to
# float32 as the ops that compute them at run time round: numpy's float32 here, C's float there.
# (numpy's ufuncs by name, imported where a float step is evaluated: a cache hit imports no numpy)
_FLOAT_OPS = {"fadd": "add", "fsub": "subtract", "fmul": "multiply", "fdiv": "divide", "fmin": "minimum",
              "fmax": "maximum"}
_FLOAT_UNARY = {"float": "float32", "floor": "floor", "ceil": "ceil", "fneg": "negative"}


def value(expr, values: dict, read):
    """expr's value: `values` the symbols' (those it uses computed), read(input, index) an
    input element. Float steps give Python floats holding float32 values."""
    if isinstance(expr, (int, float)):
        return expr
    op, args = expr[0], expr[1:]
    if op == "dim":
        return dim_value(args[0], values)
    if op == "read":
        return int(read(args[0], args[1]))
    if op == "select":
        return value(args[1] if value(args[0], values, read) else args[2], values, read)
    if op == "trunc":
        return int(value(args[0], values, read))
    if op in _FLOAT_UNARY or op in _FLOAT_OPS:
        import numpy as np
        step = getattr(np, _FLOAT_UNARY.get(op) or _FLOAT_OPS[op])
        return float(step(*(np.float32(value(e, values, read)) for e in args)))
    a, b = (value(e, values, read) for e in args)
    if op == "div":
        return a // b if b else 0
    return {"add": a + b, "sub": a - b, "mul": a * b, "min": min(a, b), "max": max(a, b), "eq": int(a == b),
            "lt": int(a < b)}[op]


def c(expr, order: list, inputs: list) -> str:
    """expr as a C expression (long long) of dims[] (the symbols in `order`) and the entry's
    `inputs` (the model's input names in order)."""
    if isinstance(expr, float):  # (a float32 constant, exactly: a hexadecimal literal)
        return f"{expr.hex()}f"
    if isinstance(expr, int):
        return f"{expr}LL"
    op, args = expr[0], expr[1:]
    if op == "dim":
        return dim_c(args[0], order)
    if op == "trunc":
        return f"((long long)({c(args[0], order, inputs)}))"
    if op == "float":
        return f"((float)({c(args[0], order, inputs)}))"
    if op in _FLOAT_UNARY or op in _FLOAT_OPS:  # (kiln_fmul and the rest: one rounding each, never fused)
        return f"kiln_{op}({', '.join(c(e, order, inputs) for e in args)})"
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
             "static inline long long kiln_max(long long a, long long b) { return a > b ? a : b; }",
             # (volatile: the compiler may not fuse a product into a sum, which rounds once)
             *(f"static inline float kiln_{name}(float a, float b) {{ volatile float r = {body}; return r; }}"
               for name, body in (("fadd", "a + b"), ("fsub", "a - b"), ("fmul", "a * b"), ("fdiv", "a / b"),
                                  ("fmin", "a < b ? a : b"), ("fmax", "a > b ? a : b"))),
             "static inline float kiln_fneg(float a) { return -a; }",
             # (sizes: |a| < 2**62, where the truncation is exact)
             "static inline float kiln_floor(float a) { float t = (float)(long long)a; return t > a ? t - 1.0f : t; }",
             "static inline float kiln_ceil(float a) { float t = (float)(long long)a; return t < a ? t + 1.0f : t; }"]
