"""Symbolic dimensions: sizes known only at run time, bounded at build time.

A `Dim` is a polynomial with integer coefficients over named symbols (`batch`, `seq`),
each symbol with the bounds the user gave (`--dim seq=1..512`). Sums, differences and
products of dims are dims again; a result that is constant is a plain int, so a shape is a
tuple of ints and dims, and a static shape is exactly what it was before symbols existed.

Two dims are equal when their polynomials are (a dim never equals an int: `seq == 1` is
False, so a symbolic dim is never taken for a broadcast 1). Whether `seq` is below 64 is a
run-time question, so ordering a dim against a number, or using it as one, is an error
(TypeError) rather than a guess: code that has not been taught symbols fails loudly and the
op is refused by name. Bounds travel
with each dim so that any holder can ask for its least and greatest value (the memory
plan sizes buffers at the greatest).

This module imports nothing else of Kiln but the manifest's name for a counted size.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass

from ..artifacts.manifest import COUNTED  # (a derived symbol's expression head where a kernel counts its value)
from .errors import ShapeError


class SymbolError(ValueError):
    """A symbol or dim used where it cannot be (the message says which)."""


def _key(term):
    return term[0]


@dataclass(frozen=True, eq=False)
class Dim:
    terms: tuple  # ((monomial: sorted tuple of symbol names, coefficient), ...) sorted, no zero coefficients
    bounds: tuple  # ((symbol, least, greatest), ...) of the symbols in the terms, sorted

    # -- construction --------------------------------------------------------------------
    @staticmethod
    def symbol(name: str, least: int, greatest: int) -> "Dim":
        if not 0 <= least <= greatest:
            raise SymbolError(f"symbol '{name}': bounds {least}..{greatest} must satisfy 0 <= least <= greatest")
        return Dim((((name,), 1),), ((name, int(least), int(greatest)),))

    @staticmethod
    def _make(terms: dict, bounds: dict):
        terms = {m: c for m, c in terms.items() if c}
        if not terms:
            return 0
        if set(terms) == {()}:
            return terms[()]
        used = {s for m in terms for s in m}
        return Dim(tuple(sorted(terms.items(), key=_key)), tuple(sorted((s, *bounds[s]) for s in used)))

    def _parts(self):
        return dict(self.terms), {s: (lo, hi) for s, lo, hi in self.bounds}

    # -- arithmetic ----------------------------------------------------------------------
    def __add__(self, other):
        a, ab = self._parts()
        b, bb = _parts_of(other)
        for m, c in b.items():
            a[m] = a.get(m, 0) + c
        return Dim._make(a, {**ab, **bb})

    __radd__ = __add__

    def __neg__(self):
        a, ab = self._parts()
        return Dim._make({m: -c for m, c in a.items()}, ab)

    def __sub__(self, other):
        return self + -other

    def __rsub__(self, other):
        return (-self) + other

    def __mul__(self, other):
        if not isinstance(other, (Dim, int)):
            return NotImplemented
        a, ab = self._parts()
        b, bb = _parts_of(other)
        out: dict = {}
        for ma, ca in a.items():
            for mb, cb in b.items():
                m = tuple(sorted(ma + mb))
                out[m] = out.get(m, 0) + ca * cb
        return Dim._make(out, {**ab, **bb})

    __rmul__ = __mul__

    def __floordiv__(self, other):
        """Exact division by an int or a single term (3*seq) that divides every term (else a
        SymbolError): what a Reshape's -1 asks of a size."""
        if isinstance(other, Dim) and other == self:
            return 1
        if isinstance(other, Dim) and len(other.terms) > 1:  # (48*b*s + 48*b over 16*s + 16: 3*b)
            return _long_division(self, other)
        if isinstance(other, Dim) and len(other.terms) == 1:
            (divisor, coef), = other.terms
        elif isinstance(other, int) and other:
            divisor, coef = (), other
        else:
            raise SymbolError(f"{self} // {other} is not a polynomial of the symbols")
        a, ab = self._parts()
        out = {}
        for m, c in a.items():
            rest = list(m)
            for s in divisor:
                if s not in rest:
                    raise SymbolError(f"{self} // {other} is not a polynomial of the symbols")
                rest.remove(s)
            if c % coef:
                raise SymbolError(f"{self} // {other} is not a polynomial of the symbols")
            out[tuple(rest)] = c // coef
        return Dim._make(out, ab)

    def __rfloordiv__(self, other):
        if other == 0:
            return 0
        raise SymbolError(f"{other} // {self} is not a polynomial of the symbols")

    def __mod__(self, other):
        """Python's modulo (the divisor's sign) by a positive int: x - d * floor(x / d), in
        derived symbols where d does not divide every term (a Swin's padding to a window
        multiple, (window - w % window) % window)."""
        if isinstance(other, int) and other > 0:
            return self - other * floor_div(self, other)
        raise SymbolError(f"{self} % {other} is not a polynomial of the symbols")

    # -- comparison ----------------------------------------------------------------------
    def __eq__(self, other):
        return isinstance(other, Dim) and self.terms == other.terms

    def __hash__(self):
        return hash(self.terms)

    def _undecided(self, other):
        raise TypeError(f"whether {self} compares with {other} is known only at run time")

    __lt__ = __le__ = __gt__ = __ge__ = _undecided

    def __bool__(self):
        raise TypeError(f"whether {self} is zero is known only at run time")

    def __index__(self):
        raise TypeError(f"{self} is a symbolic dimension, not a number")

    __int__ = __index__

    # -- facts ---------------------------------------------------------------------------
    @property
    def symbols(self) -> tuple:
        return tuple(s for s, _, _ in self.bounds)

    def evaluate(self, values: dict) -> int:
        return sum(c * math.prod(values[s] for s in m) for m, c in self.terms)

    def least(self) -> int:
        return _interval(self)[0]

    def greatest(self) -> int:
        return _interval(self)[1]

    def __str__(self) -> str:
        parts = []
        for m, c in sorted(self.terms, key=lambda t: (-len(t[0]), t[0])):  # (highest degree first)
            names = "*".join(m)
            parts.append(names if c == 1 and names else f"{c}*{names}" if names else str(c))
        return " + ".join(parts).replace("+ -", "- ")

    __repr__ = __str__

    def to_json(self) -> list:
        return [[list(m), c] for m, c in self.terms]


LONG_DIVISION_STEPS = 64  # (a quotient may have more terms than its dividend: (a^n - 1)/(a - 1))


def _graded(monomial: tuple) -> tuple:
    return len(monomial), monomial


def _long_division(a: Dim, b: Dim):
    """a / b where b divides a exactly (polynomials with integer coefficients), term by
    term from the greatest monomial down (graded order); else a SymbolError."""
    quotient, rest = 0, a
    lead, lead_coef = max(b.terms, key=lambda t: _graded(t[0]))
    for _ in range(LONG_DIVISION_STEPS):
        if not isinstance(rest, Dim):
            if rest == 0:
                return quotient
            break
        top, coef = max(rest.terms, key=lambda t: _graded(t[0]))
        left, divides = list(top), coef % lead_coef == 0
        for name in lead:
            if name in left:
                left.remove(name)
            else:
                divides = False
        if not divides:
            break
        term = coef // lead_coef
        for name in left:
            term = term * Dim.symbol(name, *_bounds_of(rest, name))
        quotient, rest = quotient + term, rest - b * term
    raise SymbolError(f"{a} // {b} is not a polynomial of the symbols")


def _parts_of(x):
    if isinstance(x, Dim):
        return x._parts()
    whole = int(x)
    if whole != x:  # (h - 100.5 is no size: a float with a fraction, from a float tensor of sizes)
        raise TypeError(f"{x} is not a whole number")
    return {(): whole}, {}


def _interval(d: Dim) -> tuple[int, int]:
    bounds = {s: (lo, hi) for s, lo, hi in d.bounds}
    lo_sum = hi_sum = 0
    for m, c in d.terms:
        lo_m, hi_m = math.prod(bounds[s][0] for s in m), math.prod(bounds[s][1] for s in m)  # (symbols >= 0)
        lo_sum += c * (lo_m if c > 0 else hi_m)
        hi_sum += c * (hi_m if c > 0 else lo_m)
    return lo_sum, hi_sum


def is_symbolic(x) -> bool:
    return isinstance(x, Dim)


def shape_is_static(shape) -> bool:
    return not any(isinstance(d, Dim) for d in shape)


def least(x) -> int:
    return x.least() if isinstance(x, Dim) else int(x)


def greatest(x) -> int:
    return x.greatest() if isinstance(x, Dim) else int(x)


def evaluate(x, values: dict) -> int:
    return x.evaluate(values) if isinstance(x, Dim) else int(x)


def product(dims) -> "int | Dim":
    out = 1
    for d in dims:
        out = out * d if isinstance(out, Dim) or isinstance(d, Dim) else out * int(d)
    return out


def symbols_of(shape) -> set:
    return {s for d in shape if isinstance(d, Dim) for s in d.symbols}


def floor_div(x, d: int):
    """floor(x / d) of a size x and an int d > 0: an int or a polynomial where the terms d
    divides are all that is symbolic; the rest, r, a derived symbol `(r)//d` (see
    deriving_symbols) whose constant term lies in [0, d), the whole multiples of d moved out.
    A quotient of a quotient is one quotient: ((N)//a + k)//d = (N + k*a)//(a*d). So one size
    has one spelling however it was reached: a stride-2 conv's output height (H - 1)//2 + 1
    is (H + 1)//2, two 2x2 max pools' (((H - 2)//2 + 1) - 2)//2 + 1 is (H)//4, and sizes
    that agree compare equal (a UNet's upsampled map padded back to its skip's size)."""
    if not isinstance(x, Dim):
        return int(x) // d
    terms, bounds = x._parts()
    const = terms.get((), 0)
    whole = {m: c // d for m, c in terms.items() if m and c % d == 0}
    rest = {m: c for m, c in terms.items() if m and c % d}
    out = Dim._make(whole, bounds) + const // d
    if not rest:
        return out
    if all(c < 0 for c in rest.values()):  # floor((c - P) / d) = -floor((P - c + d - 1) / d), P >= 0
        return out - floor_div(Dim._make({m: -c for m, c in rest.items()}, bounds) + (d - 1 - const % d), d)
    place = _DERIVED.get()
    if len(rest) == 1 and place is not None:
        (monomial, coef), = rest.items()
        inner = place[1].get(monomial[0]) if len(monomial) == 1 and coef == 1 else None
        if isinstance(inner, tuple):  # (a floor_div's; a value symbol's is no quotient)
            numerator, a = inner
            return out + floor_div(numerator + const % d * a, a * d)
    rest[()] = const % d
    return out + _derived_symbol(Dim._make(rest, bounds), d)


_DERIVED: contextvars.ContextVar = contextvars.ContextVar("kiln_derived_symbols", default=None)


@contextlib.contextmanager
def deriving_symbols(symbols: dict, derived: dict):
    """While type inference runs: a size that is no polynomial of the symbols becomes a symbol
    of its own, defined from the others: its bounds go to `symbols`, its definition
    (numerator, divisor) to `derived`, in the order they must be computed. The module
    computes their values before it runs."""
    token = _DERIVED.set((symbols, derived))
    try:
        yield
    finally:
        _DERIVED.reset(token)


def definition_symbols(definition) -> set:
    """The symbols a derived symbol's definition reads: a quotient's numerator's, or those in
    a value symbol's expression (tuples of an op and operands: ints, Dims, names, tuples)."""
    if isinstance(definition, tuple) and definition and isinstance(definition[0], Dim):
        return set(definition[0].symbols)
    found: set = set()

    def walk(e):
        if isinstance(e, Dim):
            found.update(e.symbols)
        elif isinstance(e, tuple):
            for operand in e[1:]:
                walk(operand)
    walk(getattr(definition, "expr", ()))
    return found


def late_symbols(derived: dict) -> list:
    """The derived symbols (in order) known only once a kernel has counted: the counted sizes
    themselves and every symbol computed from one. The module computes these after the
    counting kernel runs, and checks what uses them then."""
    late: list = []
    for name, definition in derived.items():
        if getattr(definition, "expr", (None,))[0] == COUNTED or definition_symbols(definition) & set(late):
            late.append(name)
    return late


def late_symbols_in(x) -> list:
    """The late symbols (late_symbols) a size x uses, while type inference runs."""
    place = _DERIVED.get()
    if place is None or not isinstance(x, Dim):
        return []
    late = set(late_symbols(place[1]))
    return [s for s in x.symbols if s in late]


def _derived_symbol(numerator: Dim, d: int) -> Dim:
    place = _DERIVED.get()
    if place is None:
        raise TypeError(f"({numerator}) // {d} is not a polynomial of the symbols")
    symbols, derived = place
    name = f"({numerator})//{d}"
    if name not in derived:
        # (C's division truncates: a derived size is never negative; where intervals alone
        # cannot tell, at_most may: (h)//2 - 2*(h)//4, what a UNet pads by)
        if numerator.least() < 0 and not at_most(0, numerator):
            raise TypeError(f"({numerator}) // {d} divides a size that may be negative")
        symbols[name] = (max(numerator.least(), 0) // d, numerator.greatest() // d)
        derived[name] = (numerator, d)
    return Dim.symbol(name, *symbols[name])


def at_most(a, b) -> bool:
    """Whether a <= b at every value of the symbols in their bounds, as far as intervals tell,
    after a derived symbol D = floor(X / k) in a linear term c*D, k dividing c, is replaced by
    what bounds it in the right direction: c*X/k above (c > 0), c*(X - k + 1)/k below. X is
    D's numerator (k its divisor), or a finer quotient of it ((h + 3)//4 is floor(((h + 1)//2
    + 1) / 2)). So 2*((h - 1)//2) <= h - 1, the size a 2x upsample of a stride-2 map gives
    back, 2*((h + 1)//4) <= (h + 1)//2 and (h + 1)//2 <= 2*((h + 3)//4)."""
    e = a - b
    place = _DERIVED.get()
    derived = place[1] if place else {}
    for _ in range(2 * len(derived) + 1):
        if not isinstance(e, Dim):
            return e <= 0
        if e.greatest() <= 0:
            return True
        terms, _ = e._parts()
        hit = next(((m[0], c, x, k) for m, c in terms.items() if len(m) == 1
                    for x, k in _quotient_of(derived, m[0], e) if c % k == 0), None)
        if hit is None:
            return False
        name, c, x, k = hit
        e = e - c * Dim.symbol(name, *_bounds_of(e, name)) + (c // k) * (x if c > 0 else x - k + 1)
    return False


def _quotient_of(derived: dict, name: str, e: Dim) -> list:
    """[(X, k)] with derived symbol `name` = floor(X / k): its own numerator and divisor, and
    each finer quotient it is a quotient of: (N + j*a)//(a*b) = ((N)//a + j)//b (a value
    symbol is no quotient: none)."""
    inner = derived.get(name)
    if not isinstance(inner, tuple):
        return []
    numerator, d = inner
    out = [(numerator, d)]
    for other, spec in derived.items():
        if not isinstance(spec, tuple) or spec[1] >= d or d % spec[1]:
            continue
        shift = numerator - spec[0]
        if not isinstance(shift, Dim) and shift % spec[1] == 0:
            bounds = next(((lo, hi) for s, lo, hi in e.bounds if s == other), None)
            out.append((Dim.symbol(other, *(bounds or _derived_bounds(spec))) + shift // spec[1], d // spec[1]))
    return out


def _derived_bounds(spec: tuple) -> tuple:
    numerator, d = spec  # (as _derived_symbol bounds it: a numerator is never negative)
    return max(numerator.least(), 0) // d, numerator.greatest() // d


def _bounds_of(d: Dim, name: str) -> tuple:
    return next((lo, hi) for s, lo, hi in d.bounds if s == name)


def dim_from_json(value, bounds: dict):
    """A dim or int from `to_json`'s form (an int stays an int); bounds: symbol -> (lo, hi)."""
    if isinstance(value, int):
        return value
    return Dim._make({tuple(m): int(c) for m, c in value}, bounds)


def dim_to_json(x):
    return x.to_json() if isinstance(x, Dim) else int(x)


# ---- sizes that must agree at run time ---------------------------------------------------------

_CHECKS: contextvars.ContextVar = contextvars.ContextVar("kiln_symbol_checks", default=None)


@contextlib.contextmanager
def collecting_checks(into: list):
    """While type inference runs: the equalities ops require of symbolic sizes go to `into`."""
    token = _CHECKS.set(into)
    try:
        yield into
    finally:
        _CHECKS.reset(token)


def require_equal(a, b, where: str, unless: tuple | None = None):
    """a and b (sizes) must be equal: where one is symbolic, an equality the module checks
    before it runs (`collecting_checks`), unless the bool input unless[0] has the value
    unless[1]; two numbers that differ are a ShapeError now. Returns the size to go on with.
    Outside type inference a TypeError (not supported there)."""
    if a == b:
        return a
    if not (is_symbolic(a) or is_symbolic(b)):
        raise ShapeError(f"{where}: {a} and {b} differ")
    checks = _CHECKS.get()
    if checks is None:
        raise TypeError(f"{a} and {b} must agree at run time")
    if (a, b, where, unless) not in checks:
        checks.append((a, b, where, unless))
    return a if isinstance(a, int) else b if isinstance(b, int) else a
