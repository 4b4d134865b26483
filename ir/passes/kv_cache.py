"""bind_kv_caches: an LLM's KV cache appended in place, in a buffer the caller owns.

A decoder exported with `past_key_values` takes each layer's cache as an input [batch,
heads, past, dh] and returns it grown by this call's entries: present = Concat(past, new)
along the past's axis, a graph output, which attention then reads (keys through a
Transpose). Run as written, each call copies the whole past into the present (and again
into the transposed keys): work that grows with the past at every token.

Where a model has that form, this pass makes the past and the present one buffer, laid out
with a `capacity` along the axis (a symbol: the caller's buffer size, at least past + seq):
  - the Concat becomes kiln.AppendCache, which writes only the new entries, after the past
    (a kiln.CacheWrite, GroupQueryAttention's, one with its starts: it writes each batch
    entry's new entries at its start and zeroes the rest after them);
  - a MatMul of a Transpose of the present (the scores) becomes kiln.MatMulTransposedB,
    which reads the keys as they lie;
  - `Graph.caches` records the pair, and every kernel indexes both tensors by the capacity
    (`Graph.storage_shape`).
The entry then reads the past from the present's buffer. A caller that passes one buffer
for both (`Module.new_cache`, or the same pointer from C) copies nothing per call; one that
passes separate arrays gets the past copied into the present first, as before.

HF optimum's merged decoder chooses between the decoder with past and the prefill-only one
with an If on `use_cache_branch` (ir/ops/control_flow.py inlines both branches, guarded,
and a kiln.IfMerge copies the taken one's present out). There the Concat's result and an
append of the prefill branch's entries (after a past that is empty whenever that branch
runs: the module checks it) both lie in the present's buffer (`CachePair.writers`), and the
IfMerge goes.

A pair is bound only where every reader of the present can read it strided (the output
itself, MatMuls taking it as B, a Transpose of its last two dims feeding one); anything else
keeps the Concat, and the model runs as written.
"""
from __future__ import annotations

from ..graph import CachePair, Graph, Node
from ..ops.control_flow import IF_MERGE
from ..ops.conv_gemm import MATMUL
from ..ops.kv_cache import APPEND_CACHE, CACHE_WRITE, MATMUL_TRANSPOSED_B
from ..ops.shape import CONCAT, IDENTITY, TRANSPOSE
from ..symbolic import greatest, is_symbolic, least
from ..transform import graph_pass


@graph_pass(opt_level=0)
def bind_kv_caches(g: Graph, ctx) -> Graph:
    if not g.symbols:
        return g
    capacities: dict = {}  # the present's length -> its capacity symbol (caches that grow together share one)
    for concat in [n for n in g.nodes if n.op in (CONCAT, CACHE_WRITE)]:
        found = _cache_of(g, concat)
        if found is None:
            continue
        present, namer, scores = found
        past, axis = concat.inputs[0], g.params_of(concat)["axis"]
        length = g.types[present].shape[axis]
        if length not in capacities:
            capacities[length] = _fresh_symbol(g, "capacity")
            _add_symbol(g, capacities[length], (least(length), greatest(length)))
        writers = _rewrite(g, concat, present, namer, scores)
        g.caches.append(CachePair(past, present, axis, capacities[length], writers))
    return g


def _cache_of(g: Graph, concat: Node):
    """(present, the node naming it (an Identity, a merged decoder's IfMerge) or None,
    [(Transpose, MatMul)] of the scores) where `concat` appends to a past input a present
    output that can be kept in place, else None."""
    uses = g.consumers()
    if len(concat.inputs) != (3 if concat.op == CACHE_WRITE else 2):
        return None
    past, out = concat.inputs[0], concat.outputs[0]
    axis = g.params_of(concat)["axis"]
    if past not in g.inputs or g.inputs.count(past) != 1 or [id(u) for u in uses.get(past, [])] != [id(concat)] or \
            g.types[out].dtype != "float32" or not is_symbolic(g.types[past].shape[axis]):
        return None
    readers = uses.get(out, [])
    namers = [u for u in readers if u.outputs[0] in g.outputs and _names(g, u, concat)]
    if out in g.outputs:
        present, namer = out, None
        if namers or concat.guard:
            return None
    elif len(namers) == 1:
        present, namer = namers[0].outputs[0], namers[0]
    else:
        return None
    if g.outputs.count(present) != 1 or present in g.inputs:
        return None
    scores = []
    for u in readers + (uses.get(present, []) if namer else []):  # (what reads either name reads the buffer)
        if u is namer:
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
    return present, namer, scores


def _names(g: Graph, node: Node, concat: Node) -> bool:
    """Does `node` make the Concat's result a graph output: an Identity of it (both
    unguarded), or the IfMerge of a merged decoder taking it from its then branch?"""
    out = concat.outputs[0]
    if node.op == IDENTITY:
        return not node.guard and not concat.guard
    return node.op == IF_MERGE and node.inputs[1] == out and node.inputs.count(out) == 1 and \
        concat.guard == node.guard + ((node.inputs[0], True),) and \
        g.types[node.inputs[2]].dtype == g.types[out].dtype


def _reads_as_b(g: Graph, matmul: Node, tensor: str) -> bool:
    """Does `matmul` read `tensor` as its B only, against an A computed at run time (the
    product of two run-time tensors, whose kernel reads B through its index map)?"""
    a, b = matmul.inputs[0], matmul.inputs[1]
    return b == tensor and a != tensor and a not in g.constants and len(g.types[a].shape) >= 2


def _rewrite(g: Graph, concat: Node, present: str, namer: Node | None, scores: list) -> tuple:
    """The Concat as an append, the scores reading the keys as cached, the namer gone.
    Returns the tensors other than the present written into its buffer (a merged decoder's
    two branches' appends)."""
    out, axis = concat.outputs[0], g.params_of(concat)["axis"]
    merged = namer is not None and namer.op == IF_MERGE
    written = out if merged else present  # (the name the append writes: each branch's own where merged)
    replaced = {id(concat): Node(APPEND_CACHE, list(concat.inputs), [written], {"axis": axis}, concat.name,
                                 concat.guard)}
    g.params[written] = {"axis": axis}
    writers = ()
    if merged:  # (the prefill branch's entries, appended after a past the module checks is empty)
        cond, _, prefill = namer.inputs
        appended = g.fresh_name(f"{present}/prefill")
        g.types[appended], g.params[appended] = g.types[present], {"axis": axis}
        replaced[id(namer)] = Node(APPEND_CACHE, [concat.inputs[0], prefill], [appended], {"axis": axis},
                                   namer.name, namer.guard + ((cond, False),))
        writers = (out, appended)
    elif namer is not None:
        replaced[id(namer)] = None
    for transpose, matmul in scores:
        replaced[id(transpose)] = None
        replaced[id(matmul)] = Node(MATMUL_TRANSPOSED_B, [matmul.inputs[0], written], list(matmul.outputs), {},
                                    matmul.name, matmul.guard)
    nodes = []
    for n in g.nodes:
        n = replaced.get(id(n), n)
        if n is not None:
            n.inputs = [written if i == out else i for i in n.inputs]
            nodes.append(n)
    g.nodes = nodes
    return writers


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
