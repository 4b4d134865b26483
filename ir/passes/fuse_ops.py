"""fuse_ops: group nodes into kernels by op pattern kind, with TVM-like rules.

Walking in topological order, a node joins the group of the producer of one of its inputs
when that producer's output feeds this node only (and is not a graph output), and:
  - an elementwise/broadcast node joins any group whose anchor leaves the domain alone:
    injective chains, and as an epilogue a conv/matmul or reduction whose output has the
    node's shape (bias, BatchNorm scale, relu/clip, residual add);
  - an injective node joins only injective/elementwise groups (index maps compose);
  - a reduction (pooling, softmax, layernorm, reduce) absorbs an injective/elementwise group
    that feeds it (its reads are inlined);
  - conv/matmul start their own group: their operands are read from buffers.
Views (Reshape, Flatten, Squeeze, Unsqueeze, Identity) do not join groups here: alone, they are aliases of
a buffer, no kernel at all. A Transpose across the last axis by whole 16 x 16 blocks
(`moves_lanes`) neither joins nor is joined: it runs as blocks transposed in registers, and
its readers read a contiguous buffer instead of gathering through it. Nodes with several outputs (Split, LayerNorm with its
statistics) stand alone.

Then an elementwise group whose input feeds it in several places and nothing else (GELU
reads x twice or three times) joins that input's producer as its epilogue (_merge_diamonds);
and small producer groups of index maps and elementwise math (views included) are inlined
into every group that reads them element by element, recomputed there instead of written out (see
_inline_producer_groups; math calls such as exp are recomputed in one reader at most): a
node may stand in several groups. Nodes under different guards (If branches decided at run
time) never share a group.

The result is the graph's partition, `g.groups`: lists of node keys, each group in node
order, the groups in the order they run.
"""
from __future__ import annotations

import collections

from ..dtypes import DTYPES
from ..graph import Graph, Node
from ..loop import TRANSPOSE_LANES
from ..ops import BROADCAST, INJECTIVE, OPAQUE, OUT_EWISE_FUSABLE, REDUCTION, op_def
from ..ops.shape import TRANSPOSE, lane_transpose
from ..transform import graph_pass

MAX_GROUP_SIZE = 24


def kind_of(node: Node) -> int:
    definition = op_def(node.op)
    if definition.view or sum(1 for o in node.outputs if o) > 1:
        return OPAQUE  # views alias; multi-output nodes (Split, LayerNorm stats) stand alone
    return definition.kind


def moves_lanes(g: Graph, node: Node) -> bool:
    """Whether `node` is a Transpose of 4-byte elements across their last axis by at least
    a 16 x 16 block each way: it runs alone, as blocks transposed in registers
    (ir/lower/transpose.py). Fused, whatever read it or fed it did so through the transpose,
    a gather per element (SegFormer's first LayerNorm over its transposed tokens: 0.73 ms)."""
    if node.op != TRANSPOSE:
        return False
    x = g.types[node.inputs[0]]
    if DTYPES[x.dtype].itemsize != 4:
        return False
    found = lane_transpose(x.shape, g.params_of(node)["perm"])  # (a run-time batch may lead: B)
    return found is not None and all(isinstance(d, int) and d >= TRANSPOSE_LANES for d in found[1:])


def _can_join(g: Graph, node: Node, via: str, group: list[Node]) -> bool:
    if node.guard != group[0].guard:
        return False  # one kernel call runs under one guard
    if moves_lanes(g, node) or any(moves_lanes(g, m) for m in group):
        return False
    k = kind_of(node)
    anchor = max(kind_of(m) for m in group)
    if anchor == OPAQUE or len(group) >= MAX_GROUP_SIZE:
        return False
    if k <= BROADCAST:
        if anchor <= INJECTIVE:
            return True
        # As an epilogue: computed at the anchor's output points, so the domain must match.
        return g.types[via].shape == g.types[node.outputs[0]].shape
    if k == INJECTIVE:
        return anchor <= INJECTIVE
    if k == REDUCTION:
        return anchor <= INJECTIVE
    return False


@graph_pass(opt_level=1)
def fuse_ops(g: Graph, ctx) -> Graph:
    uses = g.consumers()
    producer_group: dict[str, int] = {}
    groups: list[list[Node]] = []
    for node in g.nodes:
        target = None
        if kind_of(node) != OPAQUE and kind_of(node) != OUT_EWISE_FUSABLE:
            # Prefer the group with the heaviest anchor: a residual add joins its conv.
            candidates = []
            for i in dict.fromkeys(node.inputs):
                readers = uses.get(i, ())  # (stops at the first other reader: a tensor may feed thousands)
                feeds_only_this = bool(readers) and all(u is node for u in readers)
                if i in producer_group and feeds_only_this and i not in g.outputs:
                    gid = producer_group[i]
                    if _can_join(g, node, i, groups[gid]):
                        candidates.append((max(kind_of(m) for m in groups[gid]), gid))
            if candidates:
                target = max(candidates)[1]
        if target is None:
            target = len(groups)
            groups.append([])
        groups[target].append(node)
        for o in node.outputs:
            if o:
                producer_group[o] = target
    groups = _merge_diamonds(g, groups, uses)
    groups = _inline_producer_groups(g, groups, uses)
    # Each group runs where its last member stands: all its inputs exist by then.
    position = {id(n): i for i, n in enumerate(g.nodes)}
    groups.sort(key=lambda members: position[id(members[-1])])
    g.groups = [[m.key for m in members] for members in groups]
    return g


def _merge_diamonds(g: Graph, groups: list[list[Node]], uses) -> list[list[Node]]:
    """Merge an elementwise group into the group producing its input where that input feeds
    several of its nodes and nothing else: GELU's x * 0.5 * (1 + erf(x / sqrt 2)) reads x
    twice, so it did not join x's producer one node at a time. As that producer's epilogue
    it reads x from registers instead of memory. Sweeps until nothing merges: GPT-2's tanh
    GELU reads x in three places and walks into two groups, which become one group only
    after the sweep has passed the first, and only that one group can join x's producer."""
    home = {id(m): i for i, grp in enumerate(groups) for m in grp}
    producer = g.producers()
    while _merge_diamonds_once(g, groups, uses, home, producer):
        pass
    return [grp for grp in groups if grp]


def _merge_diamonds_once(g: Graph, groups: list[list[Node]], uses, home: dict, producer: dict) -> bool:
    merged = False
    for i, grp in enumerate(groups):
        if not grp or any(kind_of(m) > BROADCAST for m in grp):
            continue
        inside = {id(m) for m in grp}
        shape = g.types[grp[-1].outputs[0]].shape
        sources = {home[id(producer[t])] for m in grp for t in m.inputs if t in producer} - {i}
        for j in sorted(sources):
            src = groups[j]
            if not src or max(kind_of(m) for m in src) == OPAQUE or src[0].guard != grp[0].guard or \
                    any(moves_lanes(g, m) for m in src):
                continue
            mine = {id(x) for x in src}
            outs = [o for m in src for o in m.outputs if o and any(id(u) not in mine for u in uses.get(o, []))]
            if (len(outs) == 1 and outs[0] not in g.outputs and g.types[outs[0]].shape == shape
                    and all(id(u) in inside for u in uses[outs[0]])
                    and len(src) + len(grp) <= MAX_GROUP_SIZE):
                groups[j] = src + grp
                for m in grp:
                    home[id(m)] = j
                groups[i] = []
                merged = True
                break
    return merged


MAX_INLINED_MEMBERS = 8


def _inlinable(group: list[Node]) -> bool:
    """A small group of index maps and elementwise math (views included), one output each."""
    return len(group) <= MAX_INLINED_MEMBERS and all(
        sum(1 for o in m.outputs if o) == 1 and (op_def(m.op).view or op_def(m.op).kind <= INJECTIVE) and
        op_def(m.op).reader is not None for m in group)


def _inline_producer_groups(g: Graph, groups: list[list[Node]], uses) -> list[list[Node]]:
    """Inline a group of cheap index maps and elementwise math into every group that reads
    it, where those read it element by element (an epilogue, an elementwise chain, a
    reduction's input), so it is recomputed there instead of written out and read back. This
    keeps an attention mask (Equal/Where/Expand over a [batch, seq] mask, broadcast to
    [batch, heads, seq, seq]) from being materialized: it becomes part of each layer's score
    epilogue. Conv/MatMul and opaque ops read their operands from buffers, so a group
    feeding one stays."""
    homes = {id(m): {i} for i, grp in enumerate(groups) for m in grp}  # a node's groups
    # Per group, kept as groups grow (a Concat of thousands of inlined branches rescanned its
    # whole group for each: quadratic, 2.6 s of a 2000-branch model's build): whether it holds
    # a blocked transpose, and its call guard. (What inlines holds no such transpose.)
    moving = [any(moves_lanes(g, m) for m in grp) for grp in groups]
    guards = [call_guard(grp) if grp else () for grp in groups]
    merged = True
    while merged:
        merged = False
        for i, grp in enumerate(groups):
            if not grp or not _inlinable(grp) or moving[i]:
                continue
            inside = {id(m) for m in grp}
            # (uses lists a node once per input slot that reads the tensor)
            readers = [u for m in grp for o in m.outputs if o for u in uses.get(o, []) if id(u) not in inside]
            if not readers or any(o in g.outputs for m in grp for o in m.outputs):
                continue
            if any(kind_of(u) == OUT_EWISE_FUSABLE or (kind_of(u) == OPAQUE and not op_def(u.op).view)
                   for u in readers):
                continue  # operands read from buffers: a GEMM's, an opaque op's (a scatter's)
            # Each reading group reads it once per element: a value read along two paths of one
            # expression (a Concat of two Slices of it) would be recomputed on each, and
            # nested, the expression would double at every level.
            per_target = collections.Counter(t for u in readers for t in homes[id(u)])
            if any(n > 1 for n in per_target.values()):
                continue
            # Recomputed only where it would have run: under its own guard or a narrower one.
            if any(not set(guards[i]) <= set(guards[t]) for t in per_target):
                continue
            targets = sorted(per_target)
            if any(moving[t] for t in targets) and not all(op_def(m.op).view for m in grp):
                continue  # (a blocked transpose takes views of its input only)
            if len(targets) > 1 and any(op_def(m.op).costly for m in grp):
                continue  # (written once and read back beats computing exp or erf in each reader)
            for t in targets:
                groups[t] = grp + groups[t]  # producers first: they inline before what reads them
                guards[t] = max((guards[i], guards[t]), key=len)  # (call_guard of the joined list)
            for m in grp:
                homes[id(m)] = set(targets)
            groups[i] = []
            merged = True
    return [grp for grp in groups if grp]


def call_guard(members: list[Node]) -> tuple:
    """The guard a group's kernel call runs under: its own nodes' (producers inlined into it
    may have a wider one, an unconditional one)."""
    return max((m.guard for m in members), key=len)


def groups_of(g: Graph) -> list[list[Node]]:
    """The fused groups as nodes, in run order; without fusion, one node per group. A
    partition that no longer covers the graph (a pass ran after fusion) is not used."""
    by_key = {n.key: n for n in g.nodes}
    # (A node may stand in several groups: an inlined producer is recomputed in each reader.)
    if g.groups is not None and {k for grp in g.groups for k in grp} == set(by_key):
        return [[by_key[k] for k in grp] for grp in g.groups]
    return [[n] for n in g.nodes]
