"""Reading a node's parameters wherever its opset put them: attribute or constant input.

ONNX moved many attributes to inputs over the opsets (Slice, Squeeze, Clip, Reduce*, Split,
Pad, Resize). Kiln needs most of them at compile time, so an input that carries one must be
a constant by the time shapes are inferred; if it is not, the error names the node. (The
shape parameters a module can read at run time are ir/value_symbols.py's.)
"""
from __future__ import annotations

import numpy as np

from .graph import Graph, Node, UnsupportedError
from .symbolic import Dim
from .value_symbols import bounds_hint


class NotConstant(UnsupportedError):
    """An input a node needs at compile time is computed at run time, so far: type inference
    may fold its producers (ir/ops/inference.py) and ask again."""

    def __init__(self, message: str, tensors: list = ()):  # (re-raised with its node's name: no tensors)
        super().__init__(message)
        self.tensors = list(tensors)


def const_input(g: Graph, node: Node, index: int, what: str, required: bool = False, at_run_time: bool = False):
    """The value of input `index` as a numpy array, or None if it is omitted. `at_run_time`:
    the op can take it as sizes read at run time (ir/value_symbols.py), where bounded."""
    if index >= len(node.inputs) or not node.inputs[index]:
        if required:
            raise UnsupportedError(f"{node.describe()}: input {index} ({what}) is required")
        return None
    name = node.inputs[index]
    if name in g.symbolic_values:  # (an object array of ints and symbolic Dims)
        return g.symbolic_values[name]
    if name not in g.constants:
        hint = bounds_hint(g, [name]) if at_run_time else ""
        raise NotConstant(f"{node.describe()}: input '{name}' ({what}) must be known at compile time, "
                          f"but it is computed at run time{hint}", [name])
    return g.constants[name]


def attr_or_input(g: Graph, node: Node, attr: str, index: int, default=None, at_run_time: bool = False):
    """A list-valued parameter that lives in an attribute in old opsets and an input in new ones."""
    if attr in node.attrs:
        return list(node.attrs[attr])
    value = const_input(g, node, index, attr, at_run_time=at_run_time)
    if value is None:
        return default
    if value.dtype == object:  # symbolic values: ints and Dims
        return [v if isinstance(v, Dim) else int(v) for v in value.reshape(-1)]
    return [int(v) if np.issubdtype(value.dtype, np.integer) else float(v) for v in value.reshape(-1)]


def normalize_axis(axis: int, rank: int, node: Node) -> int:
    if not -rank <= axis < max(rank, 1):
        raise UnsupportedError(f"{node.describe()}: axis {axis} is out of range for rank {rank}")
    return axis % rank if rank else 0


def check_attrs(node: Node, supported: dict) -> None:
    """Reject attribute values Kiln does not implement: `supported` maps name -> allowed values."""
    for name, allowed in supported.items():
        if name in node.attrs and node.attrs[name] not in allowed:
            raise UnsupportedError(
                f"{node.describe()}: attribute {name}={node.attrs[name]!r} is not supported "
                f"(supported: {', '.join(map(repr, allowed))})")
