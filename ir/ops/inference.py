"""Type inference over a graph: each node's output types and canonical parameters, in
topological order, folding on constants what may be folded (`resolve`). The passes
infer_types and fold_constants (ir/passes/infer_types.py) run it over the model; Loop runs
it over its body (ir/ops/control_flow.py), which is why it lives beside the op registry.
"""
from __future__ import annotations

import collections

import numpy as np

from ..dtypes import DTYPES, is_float, numpy_dtype
from ..graph import Graph, KilnError, Node, UnsupportedError, as_kiln_array
from ..validate import check_tensor_size
from .registry import op_def

# Do not materialize folded tensors larger than this (e.g. an Expand of a constant).
MAX_FOLDED_ELEMENTS = 1 << 24


def infer(g: Graph, node: Node) -> tuple[list, dict]:
    """(output types, canonical parameters) of one node, from its op's definition."""
    definition = op_def(node.op)
    if definition is None:
        raise UnsupportedError(f"{node.describe()}: op {node.op} is not supported")
    params: dict = {}
    out = definition.infer(g, node, params)
    return (out if isinstance(out, list) else [out]), params


def fold(g: Graph, node: Node, values: list) -> list | None:
    """The node's outputs evaluated on constant inputs, or None where its op does not fold."""
    evaluate = op_def(node.op).evaluate
    if evaluate is None:
        return None
    with np.errstate(all="ignore"):  # IEEE results (log(0) = -inf, 0/0 = NaN) are the folded values
        out = evaluate({**node.attrs, **g.params.get(node.key, {})}, values, g, node)
    # numpy may promote (an int8 mean, a float16 times a Python float): the inferred type rules.
    return [as_kiln_array(np.asarray(v).astype(numpy_dtype(g.types[name].dtype), copy=False)) if name else None
            for name, v in zip(node.outputs, out)]


def resolve(g: Graph, fold_floats: bool) -> Graph:
    """Types and canonical parameters of every node (anew: passes before may have rewritten
    nodes), folding what it may."""
    g.params = {}
    kept = []
    pending = collections.deque(g.nodes)
    while pending:
        node = pending.popleft()
        definition = op_def(node.op)
        if definition is not None and definition.expand is not None:  # its body takes its place
            body = definition.expand(g, node)
            for n in body:  # (a node in a branch decided at run time: so is what it expands to)
                n.guard = n.guard or node.guard
            pending.extendleft(reversed(body))
            continue
        try:
            types, g.params[node.key] = infer(g, node)
        except KilnError as e:
            msg = str(e)
            raise type(e)(msg if node.describe() in msg else f"{node.describe()}: {msg}") from None
        for name, t in zip(node.outputs, types):
            if name:
                check_tensor_size(name, t.shape, DTYPES[t.dtype].itemsize)
                g.types[name] = t
        definition = op_def(node.op)
        inputs_const = all(i in g.constants for i in node.inputs if i) or definition.shape_only
        wanted = definition.compile_time or (inputs_const and (
            fold_floats or not any(is_float(t.dtype) for t in types)))
        if wanted and inputs_const and sum(t.size for t in types) <= MAX_FOLDED_ELEMENTS:
            outs = fold(g, node, [g.constants.get(i) if i else None for i in node.inputs])
            if outs is not None:
                for name, value in zip(node.outputs, outs):
                    if name:
                        g.add_constant(name, value)
                continue
        if definition.compile_time:
            raise KilnError(f"{node.describe()}: its inputs must be known at compile time")
        kept.append(node)
    g.nodes = kept
    return g
