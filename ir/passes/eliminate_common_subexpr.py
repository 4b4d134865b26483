"""eliminate_common_subexpr: merge equal constants, then nodes with equal op, inputs and attrs."""
from __future__ import annotations

import hashlib

import numpy as np

from ..graph import Graph, Subgraph
from ..transform import graph_pass


def _stable(value):
    if isinstance(value, np.ndarray):
        return ("array", value.dtype.str, value.shape, hashlib.sha256(value.tobytes()).hexdigest())
    if isinstance(value, (list, tuple)):
        return tuple(_stable(v) for v in value)
    if isinstance(value, Subgraph):
        return ("subgraph", id(value))  # (a loop body: never merged with another)
    return value


def _cheap_key(value: np.ndarray) -> tuple:
    """A prefilter: arrays that differ here cannot be equal, so most weights are never hashed."""
    flat = value.reshape(-1)
    return value.dtype.str, value.shape, flat[:16].tobytes(), flat[-16:].tobytes()


@graph_pass(opt_level=2)
def eliminate_common_subexpr(g: Graph, ctx) -> Graph:
    rename: dict[str, str] = {}
    buckets: dict[tuple, list[str]] = {}
    for name, value in g.constants.items():
        buckets.setdefault(_cheap_key(value), []).append(name)
    for names in buckets.values():
        by_content: dict[tuple, str] = {}
        for name in names if len(names) > 1 else ():
            key = _stable(g.constants[name])
            if key in by_content and name not in g.outputs:
                rename[name] = by_content[key]
            else:
                by_content.setdefault(key, name)
    seen: dict[tuple, list[str]] = {}
    kept = []
    for node in g.nodes:
        node.inputs = [rename.get(i, i) for i in node.inputs]
        key = (node.op, tuple(node.inputs), tuple(sorted((k, _stable(v)) for k, v in node.attrs.items())), node.guard)
        if key in seen and not any(o in g.outputs for o in node.outputs):
            rename.update(zip(node.outputs, seen[key]))
            continue
        seen[key] = node.outputs
        kept.append(node)
    g.nodes = kept
    for name in rename:
        g.constants.pop(name, None)
        g.types.pop(name, None)
    return g
