"""The bundle's manifest: one type that writes it (at build time) and reads it (at load time).

A bundle is a folder: the manifest names every other file in it and says what the library
expects (inputs, outputs, arena, weights and their checksum, CPU features, versions).
Reading checks the format and ABI versions this Kiln understands before anything is mapped.
Plain JSON; imports nothing from the compiler, so a deployment needs numpy and ctypes only.
"""
from __future__ import annotations

import json
import os
from dataclasses import MISSING, asdict, dataclass, field, fields

from .errors import KilnError

KILN_VERSION = "0.1.0"  # the one place: pyproject.toml reads it from here
FORMAT_VERSION = 1  # of this file; bump when a field changes meaning
ENTRY_ABI_VERSION = 2  # of kiln_run & co. in the library; the library reports its own
OVERLAPPING_BUFFERS = 5  # what the entry returns, running nothing, where the caller's buffers overlap
TILES_REFUSED = 6  # what it returns, running nothing, where Linux refused the process AMX's tile state
MANIFEST = "manifest.json"
# A derived symbol's expression head where a kernel counts its value while the call runs
# (["after", tensor]: a NonZero's count; ir.symbolic imports it).
COUNTED = "after"


def is_counted(derived: dict) -> bool:
    """Is a manifest `derived` entry a size counted while the call runs?"""
    return derived.get("expr", [None])[0] == COUNTED


def _polynomial(dim, value_of) -> int:
    """A manifest dim's value, value_of(symbol, coefficient) each symbol's in its term."""
    if isinstance(dim, int):
        return dim
    total = 0
    for monomial, coef in dim:
        term = int(coef)
        for s in monomial:
            term *= value_of(s, coef)
        total += term
    return total


def dim_value(dim, values: dict) -> int:
    """A manifest dim's size: an int, or a polynomial of the symbols given their values."""
    return _polynomial(dim, lambda s, _: values[s])


def late_names(derived: list) -> set:
    """The manifest's derived symbols known only after a kernel has counted (a counted one,
    or one computed from one), as ir.symbolic.late_symbols finds them."""
    late: set = set()
    for d in derived:
        uses = {s for monomial, _ in d["numerator"] for s in monomial} if "numerator" in d else _expr_symbols(d["expr"])
        if is_counted(d) or uses & late:
            late.add(d["name"])
    return late


def _expr_symbols(expr) -> set:
    if not isinstance(expr, list) or not expr:
        return set()
    if expr[0] == "dim":
        return {s for monomial, _ in expr[1] for s in monomial}
    return set().union(*(_expr_symbols(e) for e in expr[1:]))


def dim_greatest(dim, bounds: dict) -> int:
    """The most a manifest dim can be with each symbol within its (least, greatest) bounds:
    what a buffer for a size not yet known is allocated at (symbols are never negative)."""
    return max(_polynomial(dim, lambda s, coef: bounds[s][1 if coef > 0 else 0]), 0)


def dim_c(dim, order: list, derived: list = ()) -> str:
    """A manifest dim as a C expression (long long) of dims[], the symbols' values in `order`;
    a derived symbol not in `order` written out from its definition (the manifest's `derived`)."""
    if isinstance(dim, int):
        return f"{dim}LL"

    def value(s: str) -> str:
        if s in order:
            return f"dims[{order.index(s)}]"
        d = next(d for d in derived if d["name"] == s)
        if "expr" in d:  # (read from an input's values, or counted: where there are none, its greatest)
            return f"{int(d['greatest'])}LL"
        return f"({dim_c(d['numerator'], order, derived)} / {int(d['divisor'])}LL)"
    terms = ["*".join([f"{c}LL"] + [value(s) for s in m]) for m, c in dim]
    return f"({' + '.join(terms)})"


def dim_text(dim) -> str:
    """A manifest dim as people read it: 64, batch, 768*batch*seq."""
    if isinstance(dim, int):
        return str(dim)
    return " + ".join("*".join(([str(c)] if c != 1 or not m else []) + list(m)) for m, c in dim)


def io_signature(inputs: list, outputs: list, arena_bytes: int, derived: list = (), caches: list = ()) -> str:
    """What the library was built to read and write: compiled into it (kiln_signature) and
    compared with the manifest at load, so a manifest edited to promise other shapes (a
    smaller output buffer: a heap overrun) is refused before the first call. Derived
    symbols' definitions too, where there are any: output sizes are computed from them; and
    the KV caches, whose buffers the library indexes by their capacity."""
    def spec(kind, s):
        return f"{kind}:{s['name']}:{s['dtype']}:{'x'.join(map(str, s['shape']))}"
    return ";".join([spec("in", s) for s in inputs] + [spec("out", s) for s in outputs] + [f"arena:{arena_bytes}"]
                    + [f"derived:{d['name']}={json.dumps(d['expr'])}" if "expr" in d else
                       f"derived:{d['name']}={json.dumps(d['numerator'])}//{d['divisor']}" for d in derived]
                    + [f"cache:{c['past']}>{c['present']}@{c['axis']}:{c['capacity']}" for c in caches])


@dataclass
class Manifest:
    model: str
    target: dict
    opt_level: int
    inputs: list  # [{"name", "shape", "dtype"}]
    outputs: list
    arena_bytes: int
    weights_bytes: int
    weights_sha256: str
    calls: list  # [{"name", "symbol", "ops"}]: what kiln bench --profile names
    runnable: bool = True  # a linked library is in the bundle (False: objects only, no linker for the target)
    cpu_features: list = field(default_factory=list)  # as /proc/cpuinfo names them
    weights_file: str = "weights.bin"
    library: str = "model.so"
    library_bytes: int = 0  # size and sha256 of the library, checked before it is mapped
    library_sha256: str = ""
    kiln_version: str = KILN_VERSION
    format_version: int = FORMAT_VERSION
    abi_version: int = ENTRY_ABI_VERSION
    # [{"name", "least", "greatest"}] of a model built with symbolic dims: a symbolic dim of a
    # shape above is [[[symbol, ...], coefficient], ...], a polynomial (`dim_value`).
    symbols: list = field(default_factory=list)
    # [{"left", "right", "where"}]: sizes (dims as above) that must be equal at run time
    checks: list = field(default_factory=list)
    # [{"name", "numerator", "divisor", "least", "greatest"}]: symbols whose value is
    # floor(numerator / divisor) of those before them (a strided conv's output height); the
    # entry computes them, and a caller passes only `symbols`
    derived: list = field(default_factory=list)
    # [{"past", "present", "axis", "capacity"}]: an input and an output that share one buffer
    # (a KV cache appended in place, ir/passes/kv_cache.py), `capacity` (a symbol) entries
    # long along `axis`: the library reads the past from the present's buffer
    caches: list = field(default_factory=list)
    # A reduced-precision build's accuracy budget (orchestrator/accuracy_budget.py): the budget,
    # the error measured, the kernels kept in float32 and each kernel's own error
    accuracy: dict = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        fields_ = asdict(self)
        for name in ("symbols", "checks", "derived", "caches", "accuracy"):  # (a static bundle's: as before symbols)
            if not fields_[name]:
                del fields_[name]
        return json.dumps(fields_, indent=2, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> "Manifest":
        try:
            raw = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise KilnError(f"{where}: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise KilnError(f"{where}: not a Kiln manifest (a JSON object is expected)")
        version = raw.get("format_version")
        if version != FORMAT_VERSION:
            raise KilnError(f"{where}: bundle format {version} (written by Kiln {raw.get('kiln_version', '?')}); "
                            f"this Kiln {KILN_VERSION} reads format {FORMAT_VERSION}: rebuild the bundle")
        known = {f.name for f in fields(cls)}
        missing = sorted(f.name for f in fields(cls)
                         if f.name not in raw and f.default is MISSING and f.default_factory is MISSING)
        if missing:
            raise KilnError(f"{where}: missing {', '.join(missing)}")
        manifest = cls(**{k: v for k, v in raw.items() if k in known})
        for name in (manifest.weights_file, manifest.library):
            if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
                raise KilnError(f"{where}: file name {name!r} is not a plain name inside the bundle folder")
        if not isinstance(manifest.weights_sha256, str) or len(manifest.weights_sha256) != 64 or \
                (manifest.runnable and (not isinstance(manifest.library_sha256, str) or
                                        len(manifest.library_sha256) != 64)):
            raise KilnError(f"{where}: the checksums of the weights and the library are missing")
        return manifest

    def signature(self) -> str:
        return io_signature(self.inputs, self.outputs, self.arena_bytes, self.derived, self.caches)

    @classmethod
    def read(cls, folder: str) -> "Manifest":
        path = os.path.join(folder, MANIFEST)
        try:
            with open(path, "rb") as f:
                data = f.read(1 << 24)
        except FileNotFoundError:
            raise KilnError(f"'{folder}' is not a Kiln bundle: {MANIFEST} is missing") from None
        except OSError as e:
            raise KilnError(f"cannot read '{path}': {e}") from None
        return cls.from_bytes(data, f"manifest '{path}'")
