"""The graph IR: typed values, nodes in topological order, weights as constants.

Plain Python data, no ONNX types: every pass reads and writes this, and the frontend is
the only place that knows protobuf.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np

from .deferred import DeferredArray
from .dtypes import DTYPES, kiln_name
from . import errors
from .errors import KilnError
from .symbolic import Dim, greatest, product, shape_is_static


class UnsupportedError(KilnError):
    """Kiln does not implement this op, attribute, dtype or opset (the message names it)."""


ShapeError = errors.ShapeError  # (defined with the errors, so ir/symbolic.py raises it too)


@dataclass(frozen=True)
class TensorType:
    shape: tuple  # ints, and ir.symbolic.Dim where a dim is known only at run time
    dtype: str

    @property
    def size(self):
        """Elements: an int, or a Dim for a symbolic shape."""
        if self.is_static:
            return int(np.prod(self.shape, dtype=np.int64))
        return product(self.shape)

    @property
    def nbytes(self):
        return self.size * DTYPES[self.dtype].itemsize

    @property
    def is_static(self) -> bool:
        return shape_is_static(self.shape)

    @property
    def greatest_nbytes(self) -> int:
        """Bytes at the symbols' upper bounds: what memory is planned for."""
        return greatest(self.nbytes)

    def __str__(self) -> str:
        return f"{self.dtype}[{('x' if self.is_static else ' x ').join(map(str, self.shape))}]"


@dataclass
class Node:
    op: str
    inputs: list[str]  # "" marks an omitted optional input
    outputs: list[str]
    attrs: dict = field(default_factory=dict)
    name: str = ""
    # Run only where these (bool tensor, value) pairs hold: a branch of an If decided at run
    # time (ir/ops/control_flow.py). Empty: always.
    guard: tuple = ()

    def describe(self) -> str:
        return f"node '{self.name or self.outputs[0]}' ({self.op})"

    @property
    def key(self) -> str:
        """What stages key their per-node results by: the first output (unique in a graph)."""
        return next(o for o in self.outputs if o)


@dataclass
class Subgraph:
    """A graph-valued attribute: If's branches, Loop's and Scan's bodies. Names its nodes read
    without defining them (`free_names`) are values of the scope around the node."""
    name: str
    inputs: list[str]
    outputs: list[str]
    nodes: list[Node]
    constants: dict[str, np.ndarray]

    def defined(self) -> set[str]:
        return set(self.inputs) | set(self.constants) | {o for n in self.nodes for o in n.outputs if o}

    def free_names(self) -> set[str]:
        used = {i for n in self.nodes for i in n.inputs if i} | set(self.outputs)
        for n in self.nodes:
            used |= captured(n)
        return used - self.defined()


def captured(node: Node) -> set[str]:
    """What `node`'s subgraphs read from the scope around it (its implicit inputs)."""
    return set().union(*(v.free_names() for v in node.attrs.values() if isinstance(v, Subgraph)))


@dataclass(frozen=True)
class CachePair:
    """A graph input and output that share one caller-owned buffer: `present` is `past` with
    this call's entries appended along `axis` (an LLM's KV cache), written in place. The
    buffer holds `capacity` (a symbol the caller gives) entries along that axis, whatever the
    lengths, so both tensors are indexed with that stride (ir/passes/kv_cache.py). `writers`:
    other tensors that lie in the present's buffer (a merged decoder's branches' appends)."""
    past: str
    present: str
    axis: int
    capacity: str
    writers: tuple = ()


@dataclass
class Graph:
    inputs: list[str]
    outputs: list[str]
    nodes: list[Node]
    types: dict[str, TensorType] = field(default_factory=dict)
    constants: dict[str, np.ndarray] = field(default_factory=dict)
    opset: int = 17
    name: str = "model"
    # What the passes found, kept apart from the nodes they describe: type inference's
    # canonical parameters of each node (axes normalized, pads resolved, ...) by node key,
    # and fusion's partition (lists of node keys, in run order; None before fusion).
    params: dict[str, dict] = field(default_factory=dict)
    groups: list[list[str]] | None = None
    # The symbolic dims' bounds, symbol -> (least, greatest), in the order kernels and the
    # entry function number them (ir/symbolic.py). Empty: a static model.
    symbols: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Symbols defined from the others (in `symbols` too, after those they are computed from):
    # name -> (numerator, divisor), the value floor(numerator / divisor) (ir/symbolic.floor_div),
    # or a value read from inputs at run time (an ir.value_symbols.Computed).
    derived: dict = field(default_factory=dict)
    # Integer tensors whose values type inference knows as expressions of the symbols (a
    # Shape of a symbolic tensor, what Gather/Concat/... make of it): numpy object arrays of
    # ints and Dims. An op that needs a parameter at compile time reads them like constants
    # (ir/attrs.const_input); one that reads them at run time reads the tensor a
    # kiln.SymbolicValue node writes.
    symbolic_values: dict[str, np.ndarray] = field(default_factory=dict)
    # (size, size, where) pairs of sizes that must be equal at run time, one at least symbolic
    # (two inputs broadcast together, a MatMul's inner dims): the module checks them first.
    checks: list = field(default_factory=list)
    # The checks an op's expansion required (OpDef.expand): its node is gone once expanded,
    # so type inference, which rebuilds `checks` each time it runs, starts from these.
    expansion_checks: list = field(default_factory=list)
    caches: list = field(default_factory=list)  # CachePair: inputs and outputs sharing a buffer
    # Bounds the user gave for values a call reads from integer inputs (`--dim shape=1..64`,
    # `--dim 'shape[1]=1..8'`): ir/value_symbols.py makes those inputs' elements symbols.
    value_bounds: dict = field(default_factory=dict)
    # Bounds of the values of tensors this graph reads but does not compute (a loop body's, from
    # the graph around it): {name: (lo, hi)}, as ir/ops/value_ranges.py gives them.
    value_ranges: dict = field(default_factory=dict)
    # The sizes among those (a loop body's captured image height): {name: values as in
    # symbolic_values}, which type inference starts from each time it runs.
    given_values: dict = field(default_factory=dict)
    # A loop body's inputs are tensors the graph around it computes, not the caller's arrays: a
    # size read from one is read where it is (kiln.ReadSizes in the body), never from the call's
    # inputs (ir/value_symbols._fed).
    inputs_from_around: bool = False
    # Why some of those have none, where the graph around knows: {name: text for an error} (a
    # loop's iteration number: its trip count has no bounds, and how to give them).
    unbounded_why: dict = field(default_factory=dict)
    # Sequences type inference expanded (ir/ops/sequences.py): {name: items}, while it runs.
    sequences: dict = field(default_factory=dict)
    # Derived symbols a loop body takes from the graph around it: counted there, not here, so
    # type inference of the body neither waits for their counts nor drops them.
    outer_symbols: frozenset = frozenset()
    # Constants lowering computed from others, by what they are made of: {recipe: name}, so
    # the kernels of one weight share its packing (a detector head's conv at each scale).
    packed: dict = field(default_factory=dict)

    def copy(self) -> "Graph":
        # Constants and params are never mutated in place, so sharing them is safe.
        g = copy.copy(self)
        g.inputs, g.outputs = list(self.inputs), list(self.outputs)
        g.nodes = [Node(n.op, list(n.inputs), list(n.outputs), dict(n.attrs), n.name, n.guard) for n in self.nodes]
        g.types, g.constants, g.params = dict(self.types), dict(self.constants), dict(self.params)
        g.symbols, g.symbolic_values, g.checks = dict(self.symbols), dict(self.symbolic_values), list(self.checks)
        g.expansion_checks = list(self.expansion_checks)
        g.derived, g.caches, g.value_bounds = dict(self.derived), list(self.caches), dict(self.value_bounds)
        g.value_ranges, g.unbounded_why = dict(self.value_ranges), dict(self.unbounded_why)
        g.given_values = dict(self.given_values)
        g.sequences, g.packed = dict(self.sequences), dict(self.packed)
        g.groups = None if self.groups is None else [list(m) for m in self.groups]
        return g

    def storage_shape(self, name: str) -> tuple | None:
        """The shape `name` is laid out by where that is not its own (a KV cache's tensors:
        the capacity along the cache's axis), else None."""
        return storage_shape(self.caches, self.types, self.symbols, name)

    def params_of(self, node: Node) -> dict:
        """The canonical parameters type inference found for `node`."""
        return self.params[node.key]

    def producers(self) -> dict[str, Node]:
        return {o: n for n in self.nodes for o in n.outputs if o}

    def consumers(self) -> dict[str, list[Node]]:
        uses: dict[str, list[Node]] = {}
        for n in self.nodes:
            for i in n.inputs:
                if i:
                    uses.setdefault(i, []).append(n)
        return uses

    def add_constant(self, name: str, value) -> str:
        """value: an array, or a DeferredArray (ir/deferred.py) that lowering packs later."""
        value = value if isinstance(value, DeferredArray) else _contiguous(value)
        self.constants[name] = value
        self.types[name] = TensorType(tuple(int(d) for d in value.shape), normalize_dtype(value.dtype))
        return name

    def fresh_name(self, base: str) -> str:
        taken = set(self.types) | {o for n in self.nodes for o in n.outputs}
        i = 0
        while f"{base}_{i}" in taken:
            i += 1
        return f"{base}_{i}"

    def summary(self) -> str:
        lines = [f"graph {self.name} (opset {self.opset})"]
        for i in self.inputs:
            lines.append(f"  input  {i}: {self.types.get(i)}")
        for n in self.nodes:
            ins = ", ".join(i if i not in self.constants else f"{i}(const)" for i in n.inputs)
            outs = ", ".join(f"{o}: {self.types.get(o)}" for o in n.outputs)
            lines.append(f"  {n.op}({ins}) -> {outs}")
        for o in self.outputs:
            lines.append(f"  output {o}: {self.types.get(o)}")
        return "\n".join(lines)


def storage_shape(caches: list, types: dict, symbols: dict, name: str) -> tuple | None:
    """Graph.storage_shape, from the parts a LoweredModel keeps too."""
    for c in caches:
        if name in (c.past, c.present, *c.writers):
            shape = list(types[c.present].shape)
            shape[c.axis] = Dim.symbol(c.capacity, *symbols[c.capacity])
            return tuple(shape)
    return None


def normalize_dtype(dt) -> str:
    """Kiln's name of a numpy dtype; an error for one Kiln does not compute in."""
    name = kiln_name(dt)
    if name is None:
        raise UnsupportedError(f"dtype {np.dtype(dt)} is not supported (supported: {', '.join(DTYPES)})")
    return name


def as_kiln_array(value) -> np.ndarray:
    """A C-contiguous array of a dtype Kiln computes in (checked, never converted)."""
    value = np.asarray(value)
    normalize_dtype(value.dtype)
    return _contiguous(value)


def _contiguous(value) -> np.ndarray:
    """Like np.ascontiguousarray, but a 0-d array stays 0-d (a scalar is not a 1-vector)."""
    value = np.asarray(value)
    return value if value.flags.c_contiguous else value.copy(order="C")
