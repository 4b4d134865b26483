"""bind_kv_caches: an LLM's KV cache appended in place, in a buffer the caller owns.

A decoder exported with `past_key_values` takes each layer's cache as an input [batch,
heads, past, dh] and returns it grown by this call's entries: present = Concat(past, new)
along the past's axis, a graph output, which attention then reads (keys through a
Transpose). Run as written, each call copies the whole past into the present (and again
into the transposed keys): work that grows with the past at every token.

Where a model has that form, this pass makes the past and the present one buffer, laid out
with a `capacity` along the axis (a symbol: the caller's buffer size, at least past + seq):
  - the Concat becomes kiln.AppendCache, which writes only the new entries, after the past;
  - a MatMul of a Transpose of the present (the scores) becomes kiln.MatMulTransposedB,
    which reads the keys as they lie;
  - `Graph.caches` records the pair, and every kernel indexes both tensors by the capacity
    (`Graph.storage_shape`).
The entry then reads the past from the present's buffer. A caller that passes one buffer
for both (`Module.new_cache`, or the same pointer from C) copies nothing per call; one that
passes separate arrays gets the past copied into the present first, as before.

A pair is bound only where every reader of the present can read it strided (the output
itself, MatMuls taking it as B, a Transpose of its last two dims feeding one); anything else
keeps the Concat, and the model runs as written.
"""
from __future__ import annotations

from ..graph import CachePair, Graph, Node
from ..ops.conv_gemm import MATMUL
from ..ops.kv_cache import APPEND_CACHE, MATMUL_TRANSPOSED_B
from ..ops.shape import CONCAT, IDENTITY, TRANSPOSE
from ..symbolic import greatest, is_symbolic, least
from ..transform import graph_pass


@graph_pass(opt_level=0)
def bind_kv_caches(g: Graph, ctx) -> Graph:
    if not g.symbols:
        return g
    capacities: dict = {}  # the present's length -> its capacity symbol (caches that grow together share one)
    for concat in [n for n in g.nodes if n.op == CONCAT]:
        found = _cache_of(g, concat)
        if found is None:
            continue
        present, identity, scores = found
        past, axis = concat.inputs[0], g.params_of(concat)["axis"]
        length = g.types[present].shape[axis]
        if length not in capacities:
            capacities[length] = _fresh_symbol(g, "capacity")
            _add_symbol(g, capacities[length], (least(length), greatest(length)))
        _rewrite(g, concat, present, identity, scores)
        g.caches.append(CachePair(past, present, axis, capacities[length]))
    return g


def _cache_of(g: Graph, concat: Node):
    """(present, the Identity naming it or None, [(Transpose, MatMul)] of the scores) where
    `concat` appends to a past input a present output that can be kept in place, else None."""
    uses = g.consumers()
    if len(concat.inputs) != 2 or concat.guard:
        return None
    past, out = concat.inputs[0], concat.outputs[0]
    axis = g.params_of(concat)["axis"]
    if past not in g.inputs or g.inputs.count(past) != 1 or [id(u) for u in uses.get(past, [])] != [id(concat)] or \
            g.types[out].dtype != "float32" or not is_symbolic(g.types[past].shape[axis]):
        return None
    readers = uses.get(out, [])
    identities = [u for u in readers if u.op == IDENTITY and u.outputs[0] in g.outputs]
    if out in g.outputs:
        present, identity = out, None
        if identities:
            return None
    elif len(identities) == 1:
        present, identity = identities[0].outputs[0], identities[0]
    else:
        return None
    if g.outputs.count(present) != 1 or present in g.inputs:
        return None
    scores = []
    for u in readers + (uses.get(present, []) if identity else []):  # (what reads either name reads the buffer)
        if u is identity:
            continue
        if u.op == MATMUL and _reads_as_b(g, u, out):
            continue
        rank = len(g.types[out].shape)
        swap = list(range(rank - 2)) + [rank - 1, rank - 2]
        after = uses.get(u.outputs[0], [])
        if u.op == TRANSPOSE and rank >= 2 and list(g.params_of(u).get("perm", [])) == swap and \
                u.outputs[0] not in g.outputs and len(after) == 1 and after[0].op == MATMUL and \
                _reads_as_b(g, after[0], u.outputs[0]):
            scores.append((u, after[0]))
            continue
        return None  # a reader that would need the present dense
    return present, identity, scores


def _reads_as_b(g: Graph, matmul: Node, tensor: str) -> bool:
    """Does `matmul` read `tensor` as its B only, against an A computed at run time (the
    product of two run-time tensors, whose kernel reads B through its index map)?"""
    a, b = matmul.inputs[0], matmul.inputs[1]
    return b == tensor and a != tensor and a not in g.constants and len(g.types[a].shape) >= 2


def _rewrite(g: Graph, concat: Node, present: str, identity: Node | None, scores: list) -> None:
    out = concat.outputs[0]
    replaced = {id(concat): Node(APPEND_CACHE, list(concat.inputs), [present], {"axis": g.params_of(concat)["axis"]},
                                 concat.name, concat.guard)}
    g.params[present] = {"axis": g.params_of(concat)["axis"]}
    for transpose, matmul in scores:
        replaced[id(transpose)] = None
        replaced[id(matmul)] = Node(MATMUL_TRANSPOSED_B, [matmul.inputs[0], present], list(matmul.outputs), {},
                                    matmul.name, matmul.guard)
    if identity is not None:
        replaced[id(identity)] = None
    nodes = []
    for n in g.nodes:
        n = replaced.get(id(n), n)
        if n is not None:
            n.inputs = [present if i == out else i for i in n.inputs]
            nodes.append(n)
    g.nodes = nodes


def _fresh_symbol(g: Graph, base: str) -> str:
    name, i = base, 1
    while name in g.symbols:
        i += 1
        name = f"{base}_{i}"
    return name


def _add_symbol(g: Graph, name: str, bounds: tuple) -> None:
    """A symbol the caller gives: before the derived ones (the entry computes those after
    the caller's, ir/symbolic.floor_div)."""
    given = {s: b for s, b in g.symbols.items() if s not in g.derived}
    g.symbols = {**given, name: bounds, **{s: g.symbols[s] for s in g.derived}}
