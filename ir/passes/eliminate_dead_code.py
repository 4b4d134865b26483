"""eliminate_dead_code: drop nodes and constants no graph output depends on."""
from __future__ import annotations

from ..graph import Graph
from ..transform import graph_pass
from ..value_symbols import counted_tensors


@graph_pass(opt_level=0)
def eliminate_dead_code(g: Graph, ctx) -> Graph:
    live = set(g.outputs)
    counted = counted_tensors(g)  # (a size a kept node counts is read after it runs: kept with it)
    kept = []
    for node in reversed(g.nodes):
        if any(o in live for o in node.outputs if o):
            kept.append(node)
            live.update(i for i in node.inputs if i)
            live.update(o for o in node.outputs if o in counted)
    g.nodes = kept[::-1]
    for name in [c for c in g.constants if c not in live]:
        del g.constants[name]
    for name in [t for t in g.types if t not in live and t not in g.inputs]:
        del g.types[name]
    return g
