"""The symbols of a bundle built with symbolic dims, at run time: their values read from the
input arrays' shapes, checked (ranks, fixed sizes, one value per symbol, bounds) before
anything runs, and the output shapes they give.

A shape in the manifest holds ints and symbolic dims: a polynomial of the symbols, as
[[[symbol, ...], coefficient], ...] (`manifest.dim_value`). An input's dims are plain
symbols or ints (the frontend names no others).
"""
from __future__ import annotations

import numpy as np

from . import expressions
from .errors import KilnError
from .manifest import dim_greatest, dim_text, dim_value, late_names


def _plain_symbol(dim) -> str | None:
    if isinstance(dim, list) and len(dim) == 1 and dim[0][1] == 1 and len(dim[0][0]) == 1:
        return dim[0][0][0]
    return None


def _known(dim, values: dict) -> bool:
    return isinstance(dim, int) or all(s in values for monomial, _ in dim for s in monomial)


def shape_text(shape) -> str:
    return "[" + ", ".join(dim_text(d) for d in shape) + "]"


class Symbols:
    """Binds a call's symbol values; `order` is the entry function's (dims[k])."""

    def __init__(self, symbols: list, inputs: list, outputs: list, checks: list = (), derived: list = (),
                 caches: list = ()):
        self.order = [s["name"] for s in symbols]
        self.bounds = {s["name"]: (int(s["least"]), int(s["greatest"])) for s in symbols}
        self.inputs, self.outputs, self.checks, self.derived = inputs, outputs, list(checks), list(derived)
        self.caches = list(caches)
        # Sizes known only after a kernel has counted them (a NonZero's), and those computed
        # from them: unknown until the call returns, when the entry has written every derived
        # symbol after the caller's (the array has room for them all). Outputs they size are
        # allocated at their greatest.
        self.late = late_names(self.derived)
        self.greatest_of = {**self.bounds, **{d["name"]: (int(d["least"]), int(d["greatest"])) for d in self.derived}}
        self.written_back = [(len(self.order) + j, d["name"]) for j, d in enumerate(self.derived)] if self.late else []
        size = len(self.order) + (len(self.derived) if self.late else 0)
        self.dims = np.zeros(max(size, 1), np.int64)  # what the entry function reads
        # A serving loop repeats its shapes: where the values follow from the shapes alone (no
        # symbol or check reads an input's values, no KV cache), a bound call is remembered.
        self._remember = not self.caches and not any("expr" in d for d in self.derived) and \
            not any(c.get("unless") for c in self.checks)
        self._known: dict = {}  # input shapes -> (values, dims, output shapes)
        self._last = None  # the last call's (values, dims, output shapes)

    def bind(self, shapes: list, arrays: list = (), capacities: dict | None = None) -> dict:
        """The symbols' values from the inputs' shapes (in the manifest's input order), checked;
        also written to `self.dims`. `arrays` (the inputs) decide checks that hold unless a
        bool input has a value. A KV cache's capacity is the buffer's (`capacities`, symbol ->
        entries) or, for separate arrays, the present's length."""
        key = tuple(map(tuple, shapes)) if self._remember and not capacities else None
        known = self._known.get(key) if key is not None else None
        if known is not None:
            self.dims[:] = known[1]
            self._last = known
            return known[0]
        values = self._bind(shapes, arrays, capacities)
        self._last = (values, None, self._output_shapes(values))
        if key is not None:
            if len(self._known) >= 256:  # (bounded: a caller may sweep every size)
                self._known.clear()
            self._known[key] = (values, self.dims.copy(), self._last[2])
        return values

    def _bind(self, shapes: list, arrays: list, capacities: dict | None) -> dict:
        values, source = {}, {}
        for spec, shape in zip(self.inputs, shapes):
            want = spec["shape"]
            if len(shape) != len(want):
                raise KilnError(f"input '{spec['name']}': expected rank {len(want)} {shape_text(want)}, "
                                f"got shape {tuple(shape)}")
            for axis, (dim, size) in enumerate(zip(want, shape)):
                symbol = _plain_symbol(dim)
                if symbol is None:
                    continue
                if symbol in values and values[symbol] != size:
                    raise KilnError(f"input '{spec['name']}': dim {axis} is {symbol} = {size}, but input "
                                    f"'{source[symbol]}' has {symbol} = {values[symbol]}: the two must agree")
                least, greatest = self.bounds[symbol]
                if not least <= size <= greatest:
                    raise KilnError(f"input '{spec['name']}': dim {axis} is {symbol} = {size}, outside the bounds "
                                    f"the bundle was built for ({symbol} = {least}..{greatest})")
                values.setdefault(symbol, size)
                source.setdefault(symbol, spec["name"])
        self._bind_capacities(values, capacities or {})
        missing = [s for s in self.order if s not in values]
        if missing:  # (the frontend only makes symbols that inputs name; a hand-edited manifest could not)
            raise KilnError(f"no input gives the value of {', '.join(missing)}")
        for spec, shape in zip(self.inputs, shapes):
            for axis, (dim, size) in enumerate(zip(spec["shape"], shape)):
                if dim_value(dim, values) != size:
                    value = "" if isinstance(dim, int) else f" = {dim_value(dim, values)}"
                    raise KilnError(f"input '{spec['name']}': dim {axis} must be {dim_text(dim)}{value}, got {size} "
                                    f"(expected {shape_text(spec['shape'])})")
        for d in self.derived:  # (in order: each may use those before it)
            if d["name"] in self.late:  # (known after the call: the outputs it sizes at their greatest)
                continue
            if "expr" in d:  # (read from an input's values: checked like a caller's)
                values[d["name"]] = self._read_symbol(d, values, arrays)
            else:
                values[d["name"]] = dim_value(d["numerator"], values) // int(d["divisor"])
        names = [spec["name"] for spec in self.inputs]
        for check in self.checks:  # (sizes the model needs equal: two inputs broadcast together, ...)
            unless = check.get("unless")
            if not _known(check["left"], values) or not _known(check["right"], values):
                continue  # (a size counted while the call runs: the entry checks it then, error 3)
            if unless and arrays and bool(np.asarray(arrays[names.index(unless["input"])]).reshape(-1)[0]) == \
                    bool(unless["value"]):
                continue
            left, right = dim_value(check["left"], values), dim_value(check["right"], values)
            if left != right:
                raise KilnError(f"{check['where']}: {dim_text(check['left'])} = {left} and "
                                f"{dim_text(check['right'])} = {right} must be equal")
        for k, s in enumerate(self.order):
            self.dims[k] = values[s]
        return values

    def _read_symbol(self, d: dict, values: dict, arrays: list) -> int:
        names = [spec["name"] for spec in self.inputs]

        def read(name: str, k: int) -> int:
            return np.asarray(arrays[names.index(name)]).reshape(-1)[k]
        value = expressions.value(d["expr"], values, read)
        if not int(d["least"]) <= value <= int(d["greatest"]):
            raise KilnError(f"{d['what']} is {value}, outside {d['least']}..{d['greatest']}")
        return value

    def _bind_capacities(self, values: dict, capacities: dict) -> None:
        for c in self.caches:
            present = next(s for s in self.outputs if s["name"] == c["present"])
            length = dim_value(present["shape"][c["axis"]], values)
            capacity = capacities.get(c["capacity"], length)
            if length > capacity:
                raise KilnError(f"the KV cache is full: '{c['present']}' would hold {length} entries along axis "
                                f"{c['axis']}, its buffer has room for {capacity}")
            least, greatest = self.bounds[c["capacity"]]
            if not least <= capacity <= greatest:
                raise KilnError(f"'{c['present']}': a cache of {capacity} entries is outside the bounds the bundle was "
                                f"built for ({c['capacity']} = {least}..{greatest})")
            values[c["capacity"]] = capacity

    def late_fault(self, code: int) -> str:
        """What a call that stopped with `code` (2: a size read while it ran is outside its
        bounds, 3: sizes it needs equal differ) found, from the values the entry wrote back."""
        values = {**{name: int(self.dims[k]) for k, name in enumerate(self.order)},
                  **{name: int(self.dims[k]) for k, name in self.written_back}}
        if code == 2:
            faults = [f"{d['what']} ('{d['name']}') is {values[d['name']]}, outside {d['least']}..{d['greatest']}"
                      for d in self.derived if d["name"] in self.late
                      and not int(d["least"]) <= values[d["name"]] <= int(d["greatest"])]
        else:
            faults = [f"{c['where']}: {dim_value(c['left'], values)} and {dim_value(c['right'], values)}"
                      for c in self.checks if _known(c["left"], values) and _known(c["right"], values)
                      and dim_value(c["left"], values) != dim_value(c["right"], values)]
        return "; ".join(faults[:3])

    def after_call(self, values: dict) -> dict:
        """The symbols' values with the late ones, as the entry wrote them back."""
        return {**values, **{name: int(self.dims[k]) for k, name in self.written_back}}

    def output_shapes(self, values: dict) -> list[tuple]:
        last = self._last
        return last[2] if last is not None and last[0] is values else self._output_shapes(values)

    def _output_shapes(self, values: dict) -> list[tuple]:
        """Each output's shape; a dim that a late symbol still unknown sizes at its greatest."""
        return [tuple(dim_value(d, values) if _known(d, values) else dim_greatest(d, self.greatest_of)
                      for d in spec["shape"]) for spec in self.outputs]

    def greatest(self) -> dict:
        return {s: hi for s, (_, hi) in self.bounds.items()}
