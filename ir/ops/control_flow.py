"""Control flow: If, Loop and Scan, expanded by type inference into the graph around them.

- If whose condition is known at compile time (a constant, or folded from shapes) is its
  taken branch, inlined. Otherwise both branches are inlined with a *guard* on each node
  (`Node.guard`: the condition tensor and the value it must have); fusion keeps guards
  apart, each kernel call carries its guard, and the generated entry function tests it
  before the call. Each output is then `kiln.IfMerge(cond, then_value, else_value)`, a kernel
  that copies the taken branch's value into the If's output, so later kernels have one
  buffer to read. Both branches' outputs must have the same element type and rank; where
  their sizes differ, the output's are the taken branch's, read once the condition is known
  (a count of one, ir/value_symbols.py), and sizes counted in a branch are read where it ran.
- Loop whose trip count is known only at run time (a graph input, `for _ in range(n)`) or
  that has none (a while loop): one `kiln.Loop` node too; the entry function reads the count
  from its tensor and stops after an iteration whose condition output is false (`count`,
  `until` in its attributes). Its scan outputs are as long as the iterations it ran: a size
  the entry counts (an int64 output of the node, `iterations`) within the trip count's
  bounds; where the count has none (a while loop without one), it is refused by name.
- Loop with a trip count known at compile time whose condition stays true (none, a true
  constant, or the body handing its condition back) and more than UNROLLED_ITERATIONS
  iterations becomes one `kiln.Loop` node: its body is compiled once, as a graph of its own,
  and the entry function runs it in a C loop (ir/lower/loops.py). Shorter loops, and loops
  whose condition is computed at run time, are unrolled one iteration at a time: each
  iteration's body is inlined, and a Loop node for the rest follows it, so by the time the
  rest expands the iteration's condition has been inferred and folded where it can be. A
  condition computed at run time guards the remaining iterations (and each carried value
  merges the new and the old); with scan outputs, or too many iterations to unroll, the
  remaining iterations run as a kiln.Loop that counts them, as above (`_rest_in_entry_loop`).
- Scan over axis 0 with more than UNROLLED_ITERATIONS steps becomes a `kiln.Loop` too (the
  entry copies a row of each scanned tensor in and of each scan output out per iteration),
  and so does one over a symbolic length, and a Loop whose trip count is a size (`for i in
  range(x.shape[0])`): their `trip` is a Dim, their scan outputs that long.
  Other Scans are unrolled over their (static) scan axis: Gather one slice per iteration,
  run the body, stack each scan output with Unsqueeze and Concat.
- A carried value the body only appends to (`res = torch.cat((res, x))`) becomes a scan
  output, joined after the initial value once the loop is done (`_appends_as_scan_outputs`).
- A kiln.Loop's body may read sizes from each iteration's data (kiln.ReadSizes): they become
  the model's symbols, bound in the loop each iteration (`_claim_own_symbols`), and its scan
  outputs keep one shape (kiln.FixedShape: such a size is its greatest, checked).

Unrolled iterations lower to kernels with equal bytes, so each kernel compiles once.
"""
from __future__ import annotations

import math

import numpy as np

from ..dtypes import DTYPES
from ..graph import Graph, KilnError, Node, ShapeError, Subgraph, TensorType, UnsupportedError, captured
from ..loop import Const, For, If, Load, Store, Var
from ..symbolic import (COUNTED, Dim, greatest, is_symbolic, late_symbols, late_symbols_in,
                        least, require_equal)
from ..value_symbols import Computed, at_greatest, bounds_hint, counted, define, select
from .elementwise import ADD, AND, CAST, GREATER, GREATER_OR_EQUAL, LESS, LESS_OR_EQUAL
from .inference import resolve
from .registry import OPAQUE, OpDef, expanded_only, register
from .sequences import SEQUENCE_INSERT, Rows, rows_joined
from .shape import CONCAT, GATHER, IDENTITY, UNSQUEEZE, view_def
from .value_ranges import unbounded_origin, unbounded_source, value_ranges

IF, LOOP, SCAN, IF_MERGE, ENTRY_LOOP = "If", "Loop", "Scan", "kiln.IfMerge", "kiln.Loop"
FIXED_SHAPE = "kiln.FixedShape"  # a loop body's scan output with the sizes of every iteration (a view)
MAX_UNROLLED_NODES = 50_000  # nodes one Loop or Scan may unroll to
UNROLLED_ITERATIONS = 16  # a Loop this short is unrolled; a longer one runs in the entry function
MAX_ITERATIONS_COUNTED = 1 << 24  # iterations a Loop stopping on a run-time condition may run with scan outputs


def inline(g: Graph, sub: Subgraph, prefix: str, bindings: dict, guard: tuple, owner: Node) -> tuple[list, list]:
    """`sub`'s nodes with its formal inputs bound to `bindings` (formal name -> tensor), its
    own tensors and constants renamed under `prefix`, every node guarded by `guard`.
    Returns (nodes, the tensors its outputs are)."""
    own = {o for n in sub.nodes for o in n.outputs if o} | set(sub.constants)
    rename = {name: prefix + name for name in own}
    rename.update(bindings)
    for name, value in sub.constants.items():
        g.add_constant(rename[name], value)
    nodes, known = [], set(bindings.values()) | set(rename.values())  # (bound: the caller's to vouch for)
    for n in sub.nodes:
        inputs = [rename.get(i, i) for i in n.inputs]
        for i in inputs:
            if i and i not in g.types and i not in known and i not in g.sequences:
                raise KilnError(f"{owner.describe()}: its subgraph '{sub.name}' reads '{i}', which no node, input "
                                "or initializer defines")
        attrs = {k: _renamed(v, rename) if isinstance(v, Subgraph) else v for k, v in n.attrs.items()}
        nodes.append(Node(n.op, inputs, [rename.get(o, o) if o else "" for o in n.outputs], attrs,
                          f"{prefix}{n.name}", guard))
    missing = [o for o in sub.outputs if o not in rename and o not in g.types]
    if missing:
        raise KilnError(f"{owner.describe()}: its subgraph '{sub.name}' outputs {missing}, which it never computes")
    return nodes, [rename.get(o, o) for o in sub.outputs]


def _renamed(sub: Subgraph, rename: dict) -> Subgraph:
    """A nested subgraph reading the renamed tensors of the scope it is inlined into."""
    outer = {k: v for k, v in rename.items() if k not in sub.defined()}
    nodes = [Node(n.op, [outer.get(i, i) for i in n.inputs], list(n.outputs),
                  {k: _renamed(v, outer) if isinstance(v, Subgraph) else v for k, v in n.attrs.items()}, n.name,
                  n.guard) for n in sub.nodes]
    return Subgraph(sub.name, list(sub.inputs), [outer.get(o, o) for o in sub.outputs], nodes, dict(sub.constants))


def _scalar_constant(g: Graph, name: str):
    return g.constants[name].reshape(-1)[0] if name in g.constants else None


# ---- If ---------------------------------------------------------------------------------------

def expand_if(g: Graph, node: Node) -> list[Node]:
    cond = node.inputs[0]
    branches = {True: node.attrs["then_branch"], False: node.attrs["else_branch"]}
    for taken, sub in branches.items():
        if len(sub.outputs) != len(node.outputs):
            raise ShapeError(f"{node.describe()}: its {'then' if taken else 'else'} branch has {len(sub.outputs)} "
                             f"outputs, the node {len(node.outputs)}")
    if g.types[cond].size != 1 or g.types[cond].dtype != "bool":
        raise ShapeError(f"{node.describe()}: the condition is {g.types[cond]}, not one bool")
    known = _scalar_constant(g, cond)
    if known is not None:  # decided at compile time: the taken branch is the graph
        taken = bool(known)
        nodes, outs = inline(g, branches[taken], f"{node.key}/{'then' if taken else 'else'}/", {}, node.guard, node)
        return nodes + [Node(IDENTITY, [o], [name], {}, f"{node.name}/out{i}", node.guard)
                        for i, (o, name) in enumerate(zip(outs, node.outputs)) if name]
    nodes, outs = [], {}
    for taken, sub in branches.items():
        part, outs[taken] = inline(g, sub, f"{node.key}/{'then' if taken else 'else'}/", {},
                                   node.guard + ((cond, taken),), node)
        nodes += part
    return nodes + [Node(IF_MERGE, [cond, t, e], [name], {"owner": node.describe(), "index": i},
                         f"{node.name}/merge{i}", node.guard)
                    for i, (t, e, name) in enumerate(zip(outs[True], outs[False], node.outputs)) if name]


def _if_merge_expand(g: Graph, node: Node) -> list[Node] | None:
    """Where the branches' sizes differ (torchvision's batched NMS: an empty result if there
    are no boxes, else NonMaxSuppression's selection), the merge also takes the condition as
    an int64 scalar: the module reads it once computed, as it reads a count, and sizes the
    output by it (_if_merge_infer). Not where the condition is a model input and the sizes
    differ only by symbols the caller gives: those are checked equal instead."""
    cond, then_, else_ = node.inputs[:3]
    if then_ in g.sequences or else_ in g.sequences:
        raise UnsupportedError(f"{node.attrs['owner']}: output {node.attrs['index']} is a sequence chosen at run "
                               "time; Kiln compiles sequences whose elements it knows when it builds")
    t, e = g.types[then_], g.types[else_]
    differ = [(a, b) for a, b in zip(t.shape, e.shape) if a != b]
    if len(node.inputs) > 3 or not differ or t.dtype != e.dtype or len(t.shape) != len(e.shape):
        return None
    if cond in g.inputs and all((is_symbolic(a) or is_symbolic(b)) and not late_symbols_in(a) + late_symbols_in(b)
                                for a, b in differ):
        return None  # (checked equal before the call where the else branch is taken: _if_merge_infer)
    taken = f"{node.key}/taken"
    return [Node(CAST, [cond], [taken], {"to": DTYPES["int64"].onnx}, f"{node.name}/taken", node.guard),
            Node(IF_MERGE, [*node.inputs, taken], list(node.outputs), dict(node.attrs), node.name, node.guard)]


def _if_merge_infer(g, node, p):
    """The then branch's type, but where the branches' sizes differ: with the condition's int64
    copy as a fourth input (_if_merge_expand), each such size is the taken branch's, known
    once the condition is computed; else (a model input as the condition, sizes the caller
    gives: optimum's merged decoder, past + seq with the cache, seq without) they must agree
    whenever the else branch is taken, a check the module makes before it runs."""
    t, e = g.types[node.inputs[1]], g.types[node.inputs[2]]
    cond = node.inputs[0]
    differ = [(a, b) for a, b in zip(t.shape, e.shape) if a != b]
    if t.dtype != e.dtype or len(t.shape) != len(e.shape):
        raise ShapeError(f"{node.attrs['owner']}: output {node.attrs['index']} is {t} in the then branch and {e} in "
                         "the else branch; Kiln compiles one element type and rank per output")
    if len(node.inputs) > 3:
        taken = counted(f"taken({cond})", node.inputs[3], 1, f"{node.attrs['owner']}: whether its condition holds")
        # (named by what it picks: the outputs of one If picking alike share the size, as
        # Phi-3's cos and sin caches, each its own merge, must)
        shape = tuple(a if a == b else define(f"{taken} ? {a} : {b}", select(taken, a, b),
                                              min(least(a), least(b)), max(greatest(a), greatest(b)),
                                              f"{node.attrs['owner']}: output {node.attrs['index']}'s axis {i}, "
                                              "the taken branch's")
                      for i, (a, b) in enumerate(zip(t.shape, e.shape)))
        return TensorType(shape, t.dtype)
    for a, b in differ:
        require_equal(a, b, f"{node.attrs['owner']}: output {node.attrs['index']} when '{cond}' is false",
                      unless=(cond, True))
    return t


def _if_merge_kernel(b, node):
    """Copy the taken branch's value: the condition is tested once, outside the loops."""
    out = b.out_param(node.outputs[0])
    cond, then_, else_ = (b.in_param(i) for i in node.inputs[:3])
    n = b.dim(b.type(node.outputs[0]).size)

    def copy(src):
        i = b.fresh("i")
        return (For(i, n, (Store(out, Var(i), Load(src, Var(i))),), "vectorize"),)
    return (If(Load(cond, Const(0)), copy(then_), copy(else_)),)


# ---- Loop -------------------------------------------------------------------------------------

def expand_loop(g: Graph, node: Node) -> list[Node]:
    body: Subgraph = node.attrs["body"]
    trip, cond = (list(node.inputs) + ["", ""])[:2]
    carried = list(node.inputs[2:])
    n_carried = len(carried)
    n_scan = len(body.outputs) - 1 - n_carried
    if len(body.inputs) != 2 + n_carried or n_scan < 0 or len(node.outputs) != n_carried + n_scan:
        raise ShapeError(f"{node.describe()}: its body takes {len(body.inputs)} inputs and gives {len(body.outputs)} "
                         f"outputs for {n_carried} carried values")
    count = _scalar_constant(g, trip) if trip else None
    size = g.symbolic_values[trip].reshape(-1)[0] if trip in g.symbolic_values else None
    appended = None if node.attrs.get("_start") else _sequence_appends(g, node) or _appends_as_scan_outputs(g, node)
    if appended:
        return appended
    if is_symbolic(size) and (not cond or _scalar_constant(g, cond)) and _keeps_going(g, body):
        return [_entry_loop(node, body, size, carried, [], [], [0] * n_scan)]  # (a size: scan outputs that long)
    if count is None:  # (a count read at run time, or none: a while loop)
        if n_scan and not trip:
            raise UnsupportedError(f"{node.describe()}: it has no trip count (a while loop) and it has scan outputs, "
                                   "whose length nothing then bounds: Kiln plans their memory at their greatest "
                                   "length, so such a Loop needs a trip count")
        return [_entry_loop(node, body, 0, carried, [], [], [0] * n_scan, count=trip, start_if=cond, until=True)]
    start = node.attrs.get("_start", 0)
    slices = node.attrs.get("_slices") or [[] for _ in range(n_scan)]
    known = True if not cond else _scalar_constant(g, cond)
    if start == 0 and int(count) > UNROLLED_ITERATIONS and known is not None and known and _keeps_going(g, body):
        return [_entry_loop(node, body, int(count), carried, [], [], [0] * n_scan)]
    if start >= int(count) or (known is not None and not known):
        return _loop_results(g, node, carried, slices)
    too_many = (int(count) - start) * max(len(body.nodes), 1) > MAX_UNROLLED_NODES
    if known is None and n_scan or too_many and not _keeps_going(g, body):
        # (a condition computed at run time: the rest runs in the entry function, as long as it holds)
        return _rest_in_entry_loop(g, node, body, int(count) - start, start, cond, carried, slices)
    if too_many:
        raise UnsupportedError(f"{node.describe()}: {int(count)} iterations of a {len(body.nodes)}-node body unroll to "
                               f"more than {MAX_UNROLLED_NODES} nodes")
    guard = node.guard if known is not None else node.guard + ((cond, True),)
    prefix = f"{node.key}/it{start}/"
    iteration = g.add_constant(prefix + "iter", np.array(start, np.int64))
    cond_in = cond or g.add_constant(prefix + "true", np.array(True))
    nodes, outs = inline(g, body, prefix, dict(zip(body.inputs, [iteration, cond_in] + carried)), guard, node)
    cond_out, new = outs[0], outs[1:1 + n_carried]
    if known is None:  # run time: an iteration not taken keeps the old values
        merged = []
        for i, (v_new, v_old) in enumerate(zip(new, carried)):
            merged.append(f"{prefix}carried{i}")
            nodes.append(Node(IF_MERGE, [cond, v_new, v_old], [merged[-1]], {"owner": node.describe(), "index": i},
                              f"{prefix}merge{i}", node.guard))
        new = merged
        still = f"{prefix}cond"
        nodes.append(Node(AND, [cond, cond_out], [still], {}, f"{prefix}and", node.guard))
        cond_out = still
    rest = Node(LOOP, [trip, cond_out] + new, list(node.outputs),
                {**node.attrs, "_start": start + 1, "_slices": [s + [o] for s, o in zip(slices, outs[1 + n_carried:])]},
                node.name, node.guard)
    return nodes + [rest]


def _rest_in_entry_loop(g: Graph, node: Node, body: Subgraph, trip: int, start: int, cond: str, carried: list,
                        slices: list) -> list[Node]:
    """The iterations of a Loop from `start` on as a kiln.Loop that runs while its condition
    holds (computed at run time): its body's iteration number counted from `start`, and each
    scan output the rows of the iterations unrolled before it (`slices`) then the loop's."""
    n_carried = len(carried)
    if start:
        body = _iterations_from(g, body, start)
    scans = list(node.outputs[n_carried:])
    rest = [f"{node.key}/rest_scan{k}" if parts and out else out for k, (parts, out) in enumerate(zip(slices, scans))]
    loop = Node(node.op, list(node.inputs[:2]), list(node.outputs[:n_carried]) + rest, {}, node.name, node.guard)
    nodes = [_entry_loop(loop, body, trip, carried, [], [], [0] * len(scans), start_if=cond or _true(g, node),
                         until=True)]
    for k, (parts, whole, tail) in enumerate(zip(slices, scans, rest)):
        if parts and whole:
            head = f"{node.key}/unrolled_scan{k}"
            nodes += _stack(g, node, parts, 0, head, f"unrolled_scan{k}")
            nodes.append(Node(CONCAT, [head, tail], [whole], {"axis": 0}, f"{node.name}/scan{k}_joined", node.guard))
    return nodes


def _true(g: Graph, node: Node) -> str:
    return g.add_constant(f"{node.key}/true", np.array(True))


def _iterations_from(g: Graph, body: Subgraph, start: int) -> Subgraph:
    """`body` reading its iteration number as `start` more than the loop running it counts."""
    counted_from_0 = f"{body.name}/iteration_from_0"
    offset = f"{body.name}/first_iteration"
    constants = {**body.constants, offset: np.array(start, np.int64)}
    add = Node(ADD, [counted_from_0, offset], [body.inputs[0]], {}, f"{body.name}/iteration")
    return Subgraph(body.name, [counted_from_0] + body.inputs[1:], list(body.outputs), [add] + list(body.nodes),
                    constants)


def _sequence_appends(g: Graph, node: Node) -> list[Node] | None:
    """torch.jit.script's `outs.append(y)` in a loop: a carried sequence (ir/ops/sequences.py)
    the body only appends to (SequenceInsert at its end, the carried value read by nothing
    else) becomes a scan output of what it appends, and the Loop's sequence its initial items
    then those rows. Returns the rewritten Loop, or None where no carried value is a sequence;
    any other use of a carried sequence is refused."""
    body: Subgraph = node.attrs["body"]
    n_carried = len(node.inputs) - 2
    sequences = [k for k in range(n_carried) if node.inputs[2 + k] in g.sequences]
    if not sequences:
        return None
    producer = {o: n for n in body.nodes for o in n.outputs if o}
    readers = {}
    for n in body.nodes:
        for i in set(n.inputs) | captured(n):
            readers.setdefault(i, []).append(n)
    inserts = {}
    for k in sequences:
        state, new = body.inputs[2 + k], body.outputs[1 + k]
        insert = producer.get(new)
        appends = insert is not None and insert.op == SEQUENCE_INSERT and insert.inputs[0] == state and \
            (len(insert.inputs) < 3 or not insert.inputs[2])  # (at the end: no position)
        if not appends or readers.get(state) != [insert] or readers.get(new) or body.outputs.count(new) != 1:
            raise UnsupportedError(f"{node.describe()}: carried value {k} is a sequence that the body does more with "
                                   "than append to (SequenceInsert at its end, nothing else reading it); Kiln compiles "
                                   "such a loop's appends only")
        inserts[k] = insert
    kept = [k for k in range(n_carried) if k not in inserts]
    parts, stacked = [], []
    nodes = [n for n in body.nodes if all(n is not i for i in inserts.values())]
    for k, insert in inserts.items():
        parts.append(f"{body.name}/sequence{k}")
        nodes.append(Node(IDENTITY, [insert.inputs[1]], [parts[-1]], {}, f"{insert.name}/row"))
        stacked.append(f"{node.key}/sequence{k}_rows")
        if node.outputs[k]:
            g.sequences[node.outputs[k]] = list(g.sequences[node.inputs[2 + k]]) + [Rows(stacked[-1])]
    loop_body = Subgraph(body.name, body.inputs[:2] + [body.inputs[2 + k] for k in kept],
                         body.outputs[:1] + [body.outputs[1 + k] for k in kept] + body.outputs[1 + n_carried:] + parts,
                         nodes, dict(body.constants))
    return [Node(LOOP, node.inputs[:2] + [node.inputs[2 + k] for k in kept],
                 [node.outputs[k] for k in kept] + list(node.outputs[n_carried:]) + stacked,
                 {**node.attrs, "body": loop_body}, node.name, node.guard)]


def _appends_as_scan_outputs(g: Graph, node: Node) -> list[Node] | None:
    """torch.jit.script's `acc = torch.cat((acc, x))` in a loop: a carried value the body only
    ever appends to grows each iteration, which one static type per value cannot hold. Where
    the body reads the carried value in nothing but that Concat, and hands back nothing but
    its result, the appended parts are a scan output: stacked by the loop, then joined along
    the Concat's axis (Transpose, Reshape) after the initial value. Returns the rewritten Loop
    and the nodes after it, or None where no carried value is such."""
    body: Subgraph = node.attrs["body"]
    n_carried = len(node.inputs) - 2
    producer = {o: n for n in body.nodes for o in n.outputs if o}
    readers = {}
    for n in body.nodes:
        for i in set(n.inputs) | captured(n):
            readers.setdefault(i, []).append(n)
    appends, dropped = {}, []
    for k in range(n_carried):
        state, new = body.inputs[2 + k], body.outputs[1 + k]
        if node.inputs[2 + k] == "" or state in body.outputs:
            continue
        passed, read = _unchanged(state, readers, g.types[node.inputs[2 + k]].dtype)
        cat = producer.get(new)
        if (cat is None or cat.op != CONCAT or len(cat.inputs) != 2 or cat.inputs[0] != read
                or cat.inputs[1] == read or readers.get(read) != [cat] or readers.get(new)
                or body.outputs.count(new) != 1):
            continue
        appends[k] = cat
        dropped += passed + [cat]
    if not appends:
        return None
    kept = [k for k in range(n_carried) if k not in appends]
    parts, outputs, after = [], [], []
    nodes = [n for n in body.nodes if all(n is not d for d in dropped)]
    for k, cat in appends.items():
        part = f"{body.name}/appended{k}"  # (a name of its own: the part may be read elsewhere too)
        nodes.append(Node(IDENTITY, [cat.inputs[1]], [part], {}, f"{cat.name}/part"))
        parts.append(part)
        stacked = f"{node.key}/appended{k}"
        outputs.append(stacked)
        if node.outputs[k]:
            after += _joined(g, node, k, stacked, cat.attrs.get("axis"))
    loop_body = Subgraph(body.name, body.inputs[:2] + [body.inputs[2 + k] for k in kept],
                         body.outputs[:1] + [body.outputs[1 + k] for k in kept] + body.outputs[1 + n_carried:] + parts,
                         nodes, dict(body.constants))
    loop = Node(LOOP, node.inputs[:2] + [node.inputs[2 + k] for k in kept],
                [node.outputs[k] for k in kept] + list(node.outputs[n_carried:]) + outputs,
                {**node.attrs, "body": loop_body}, node.name, node.guard)
    return [loop] + after


def _unchanged(state: str, readers: dict, dtype: str) -> tuple[list, str]:
    """(the nodes that pass `state` on unchanged, the tensor they end in): its only reader an
    Identity or a Cast to its own type (Keypoint R-CNN's loop casts its float32 keypoints to
    float32 before appending), and so on."""
    passed, current = [], state
    while len(readers.get(current, [])) == 1:
        n = readers[current][0]
        if not (n.op == IDENTITY or n.op == CAST and n.attrs.get("to") == DTYPES[dtype].onnx):
            break
        passed.append(n)
        current = n.outputs[0]
    return passed, current


def _joined(g: Graph, node: Node, k: int, stacked: str, axis) -> list[Node]:
    """Carried value k's final value from its appended parts stacked along a new axis 0:
    that axis moved beside the Concat's and merged into it, after the initial value."""
    initial, out = node.inputs[2 + k], node.outputs[k]
    rank = len(g.types[initial].shape)
    if axis is None or not -rank <= axis < rank:
        raise ShapeError(f"{node.describe()}: carried value {k} is appended to along axis {axis} of a rank-{rank} "
                         "tensor")
    axis %= rank
    tag = f"{node.key}/appended{k}"
    joined = out if g.types[initial].shape[axis] == 0 else f"{tag}/joined"
    nodes = rows_joined(g, stacked, rank, axis, False, joined, tag, node.name, node.guard)
    if joined != out:
        nodes.append(Node(CONCAT, [initial, joined], [out], {"axis": axis}, f"{node.name}/{tag}/after_initial",
                          node.guard))
    return nodes


def _keeps_going(g: Graph, body: Subgraph) -> bool:
    """Does the body hand back a true condition whenever it gets one (its condition output is
    its condition input, or a true constant, the body's or the graph's, or an Identity of one)?"""
    out, given = body.outputs[0], body.inputs[1]
    producer = next((n for n in body.nodes if out in n.outputs), None)
    if producer is not None and producer.op == IDENTITY:
        out = producer.inputs[0]
    if out == given:
        return True
    constant = body.constants.get(out, g.constants.get(out))
    return constant is not None and bool(np.asarray(constant).reshape(-1)[0])


def _entry_loop(node: Node, body: Subgraph, trip: int, state: list, scanned: list, in_dirs: list,
                out_dirs: list, count: str = "", start_if: str = "", until: bool = False) -> Node:
    """A kiln.Loop node: a Loop (the body takes the iteration number and the condition first)
    or a Scan (its scan inputs sliced along axis 0 each iteration), run by the entry function.
    Its inputs are the initial state, the scanned tensors and everything the body reads from
    around it, so those stay alive and in order; then the int64 scalar giving its trip count
    at run time (`count`, else `trip` or, with neither, no limit) and the bool it runs only
    if (`start_if`). With `until`, it stops after an iteration whose condition output is false.
    With `until` and scan outputs, the number of iterations run is a size known once the loop
    is done: its last output, an int64 the entry writes, is counted (value_symbols.counted),
    and the scan outputs are that long."""
    body = _scans_of_one_shape(body, 1 + len(state) if node.op == LOOP else len(state))
    captured = sorted(body.free_names())
    extra = [t for t in (count, start_if) if t]
    iterations = [f"{node.key}/iterations"] if until and out_dirs else []
    return Node(ENTRY_LOOP, state + scanned + captured + extra, list(node.outputs) + iterations,
                {"body": body, "trip": trip, "captured": captured, "n_state": len(state), "n_scanned": len(scanned),
                 "counted": node.op == LOOP, "in_dirs": in_dirs, "out_dirs": out_dirs, "count": count,
                 "start_if": start_if, "until": until, "iterations": bool(iterations)}, node.name, node.guard)


def _scans_of_one_shape(body: Subgraph, first: int) -> Subgraph:
    """The body with each scan output (its outputs from `first` on) passed through a
    kiln.FixedShape, so that sizes it computes from each iteration's data stack as one."""
    scans = body.outputs[first:]
    if not scans:
        return body
    fixed = [f"{s}/one_shape" for s in scans]
    nodes = list(body.nodes) + [Node(FIXED_SHAPE, [s], [f], {}, f"{s}/one_shape") for s, f in zip(scans, fixed)]
    return Subgraph(body.name, list(body.inputs), body.outputs[:first] + fixed, nodes, dict(body.constants))


def _fixed_shape_infer(g, node, p):
    """Each dim that a size read from this iteration's data decides (late, and not the
    graph's around the loop) is one size, which the module checks it equals: a scan output's
    rows are all one shape. That size is the one the graph around the loop gives it where
    the data make it largest (x[:, :w] of a longer row is w), else its greatest. Its buffer
    then holds that shape as it is (a view)."""
    x = g.types[node.inputs[0]]
    own = set(late_symbols(g.derived)) - g.outer_symbols
    shape = []
    for i, d in enumerate(x.shape):
        if isinstance(d, Dim) and own & set(d.symbols):
            fixed = at_greatest(d, own, g.derived)
            if not isinstance(fixed, Dim) or own & set(fixed.symbols):
                fixed = greatest(d)
            require_equal(d, fixed, f"{node.describe()}: dim {i} of '{node.inputs[0]}', a size computed in a loop "
                                    "from each iteration's data, must be the same in every iteration ("
                                    f"{'its greatest' if isinstance(fixed, int) else fixed})")
            d = fixed
        shape.append(d)
    return TensorType(tuple(shape), x.dtype)


def loop_body_graph(g: Graph, node: Node) -> tuple:
    """A kiln.Loop's body as a graph of its own: inputs the iteration number (a Loop's), the
    carried state, one slice of each scanned tensor (a Scan's) and the run-time tensors it
    reads from around it; the outer constants it reads and a Loop's (always true) condition
    as constants. Returns (graph, iteration or "", state inputs, slice inputs, state
    outputs, scan outputs)."""
    a = node.attrs
    body: Subgraph = a["body"]
    n, k = a["n_state"], a["n_scanned"]
    first = 2 if a["counted"] else 0
    iteration = body.inputs[0] if a["counted"] else ""
    state, slices = list(body.inputs[first:first + n]), list(body.inputs[first + n:first + n + k])
    outer = captured_inputs(node)
    # (a pass may have renamed what the body reads from around it, in the node's inputs: CSE
    # merging two equal constants)
    moved = {old: new for old, new in zip(a["captured"], outer) if old != new}
    runtime = [name for name in outer if name not in g.constants]
    nodes = [Node(m.op, [moved.get(i, i) for i in m.inputs], list(m.outputs),
                  {k: _renamed(v, moved) if isinstance(v, Subgraph) else v for k, v in m.attrs.items()}, m.name)
             for m in body.nodes]
    graph = Graph(inputs=([iteration] if iteration else []) + state + slices + runtime,
                  outputs=[moved.get(o, o) for o in body.outputs], nodes=nodes, opset=g.opset,
                  name=f"{g.name}/{node.name}", symbols=dict(g.symbols), derived=dict(g.derived))
    if iteration:
        graph.types[iteration] = TensorType((), "int64")
        graph.add_constant(body.inputs[1], np.array(True))
    for name, initial in zip(state + runtime, list(node.inputs[:n]) + runtime):
        graph.types[name] = g.types[initial]
    for name, whole in zip(slices, node.inputs[n:n + k]):
        graph.types[name] = TensorType(g.types[whole].shape[1:], g.types[whole].dtype)
    for name, value in body.constants.items():
        graph.add_constant(name, value)
    for name in outer:
        if name in g.constants:
            graph.add_constant(name, g.constants[name])
    graph.outer_symbols = frozenset(set(g.derived) - set(_own_symbols(g, node)))
    graph.value_ranges = _ranges_given(g, node, iteration, runtime, slices)
    # (a size from around it stays one: x[:, :w] of the image's width w has its length)
    graph.given_values = {name: g.symbolic_values[name] for name in runtime if name in g.symbolic_values}
    graph.inputs_from_around = True
    if iteration and iteration not in graph.value_ranges:
        graph.unbounded_why[iteration] = _why_unbounded(g, node)
    outs = body.outputs[1:] if a["counted"] else body.outputs
    return graph, iteration, state, slices, list(outs[:n]), list(outs[n:])


def captured_inputs(node: Node) -> list:
    """The tensors a kiln.Loop's body reads from around it, as the node's inputs name them."""
    a = node.attrs
    first = a["n_state"] + a["n_scanned"]
    return list(node.inputs[first:first + len(a["captured"])])


def body_prefix(node: Node) -> str:
    """What a kiln.Loop's body tensors are renamed under in the model (ir/lower/loops.py)."""
    return f"{node.key}/body/"


def _own_symbols(g: Graph, node: Node) -> list:
    """The symbols of g that the loop's body reads while it runs (a size computed from each
    iteration's data) and those computed from them (`_claim_own_symbols` names them)."""
    return [s for s in node.attrs.get("own_symbols", ()) if s in g.derived]


def _why_unbounded(g: Graph, node: Node) -> str:
    """Why a kiln.Loop's iteration numbers have no bounds, and how to give them: for errors."""
    count = node.attrs.get("count")
    if not count:
        return f"the iteration number of {node.describe()}, a while loop, has no bounds"
    source = unbounded_source(g, count)[0]
    return f"the iteration number of {node.describe()} is bounded by its trip count '{count}' only, and " \
           f"{unbounded_origin(g, count)}{bounds_hint(g, [source])}"


def _ranges_given(g: Graph, node: Node, iteration: str, runtime: list, slices: list) -> dict:
    """Bounds of the values the body reads from around it (ir/ops/value_ranges.py): of the
    run-time tensors it captures, each scanned tensor's slices, and the iteration number."""
    a = node.attrs
    wholes = list(node.inputs[a["n_state"]:a["n_state"] + len(slices)])
    found = value_ranges(g, runtime + wholes + ([a["count"]] if a.get("count") else []))
    ranges = {name: found[name] for name in runtime if found[name] is not None}
    for name, whole in zip(slices, wholes):
        if found[whole] is not None:
            ranges[name] = (np.array(found[whole][0].min()), np.array(found[whole][1].max()))
    most = most_iterations(g, node) if iteration or a["n_state"] else None
    if iteration and most is not None:
        ranges[iteration] = (np.array(0.0), np.array(max(float(most) - 1, 0.0)))
    if most is not None:  # (torch.jit.script's `x[:k]` with `k += 1`: k's first value plus each step so far)
        for name, (lo, hi, step) in _stepped_state(g, node).items():
            ranges[name] = (np.array(min(lo, lo + step * (most - 1))), np.array(max(hi, hi + step * (most - 1))))
    return ranges


def _stepped_state(g: Graph, node: Node) -> dict:
    """{the body's input of a carried integer: (least and greatest of its first value, the
    constant the body adds to it each iteration)}, for each carried value the body hands back
    as itself plus a constant."""
    a = node.attrs
    body: Subgraph = a["body"]
    first = 2 if a["counted"] else 0
    outs = body.outputs[1:] if a["counted"] else body.outputs
    producer = {o: n for n in body.nodes for o in n.outputs if o}
    outer = dict(zip(a["captured"], captured_inputs(node)))
    found = {}
    for k, (state, out) in enumerate(zip(body.inputs[first:first + a["n_state"]], outs)):
        update = producer.get(out)
        while update is not None and update.op == IDENTITY:
            update = producer.get(update.inputs[0])
        if update is None or update.op != ADD or state not in update.inputs:
            continue
        other = update.inputs[1 - update.inputs.index(state)]
        step = body.constants.get(other, g.constants.get(outer.get(other, other)))
        if step is None or np.asarray(step).size != 1 or np.asarray(step).dtype.kind not in "iu":
            continue  # (before walking back for its first value: a float state's is the whole graph)
        initial = value_ranges(g, [node.inputs[k]])[node.inputs[k]]
        if initial is not None:
            found[state] = (float(initial[0].min()), float(initial[1].max()), int(np.asarray(step).reshape(-1)[0]))
    return found


def most_iterations(g: Graph, node: Node) -> int | None:
    """The most iterations a kiln.Loop may run, or None where nothing bounds them: its trip
    count (a number, a size, or the greatest value of the tensor read at run time), and where
    the body stops once a counter reaches a limit (`_counter_bound`), that bound too."""
    a = node.attrs
    if a.get("count"):  # (read at run time: bounded where its values are)
        found = value_ranges(g, [a["count"]])[a["count"]]
        most = int(found[1].max()) if found is not None else None
    else:  # (a size, or a number; 0 with no count is a while loop's: no bound)
        most = greatest(a["trip"]) if is_symbolic(a["trip"]) or a["trip"] else None
    counter = _counter_bound(g, node) if a.get("until") else None
    return min(m for m in (most, counter) if m is not None) if (most, counter) != (None, None) else None


_BEFORE = {LESS: (0, 1, True), LESS_OR_EQUAL: (0, 1, False), GREATER: (1, 0, True),
           GREATER_OR_EQUAL: (1, 0, False)}  # op: (the counter's input, the limit's, strictly less?)


def _counter_bound(g: Graph, node: Node, unbounded: list | None = None) -> int | None:
    """torch.jit.script's `for i in range(n): ... break` and `while i < n` export as a Loop with
    no useful trip count (the largest int64) whose body hands back `i + 1 < n and ...`. Where
    the body's condition output is such a conjunction, with a counter rising by a constant
    each iteration (the iteration number, or a carried integer the body adds a positive
    constant to) compared with a limit from around the loop that has bounds, the loop stops
    within a number of iterations those bounds give: returned, else None (the limits that
    would bound it but have no bounds themselves appended to `unbounded`)."""
    body: Subgraph = node.attrs["body"]
    producer = {o: n for n in body.nodes for o in n.outputs if o}
    outer = dict(zip(node.attrs["captured"], captured_inputs(node)))
    n_state = node.attrs["n_state"]
    stepped = _stepped_state(g, node)  # (the counters among its carried values, found once)

    def through(t):  # (an Identity passes its input on)
        while t in producer and producer[t].op == IDENTITY:
            t = producer[t].inputs[0]
        return t

    def constant(t):
        v = body.constants.get(t, g.constants.get(outer.get(t, t)))
        return int(np.asarray(v).reshape(-1)[0]) if v is not None and np.asarray(v).size == 1 and \
            np.asarray(v).dtype.kind in "iu" else None

    def affine(t, depth=0):
        """(least value in the first iteration, rise per iteration) of integer tensor t, or None."""
        t = through(t)
        if t == body.inputs[0]:
            return 0, 1
        if t in body.inputs[2:2 + n_state]:
            counter = stepped.get(t)
            return (int(counter[0]), counter[2]) if counter is not None and counter[2] > 0 else None
        n = producer.get(t)
        if n is not None and n.op == ADD and depth < 4:
            for x, y in (n.inputs, n.inputs[::-1]):
                k, base = constant(y), affine(x, depth + 1)
                if k is not None and base is not None:
                    return base[0] + k, base[1]
        return None

    bounds, pending = [], [through(body.outputs[0])]
    while pending:
        n = producer.get(pending.pop())
        if n is None:
            continue
        if n.op == AND:
            pending += [through(i) for i in n.inputs]
        elif n.op in _BEFORE:
            counter, limit, strict = _BEFORE[n.op]
            rise, name = affine(n.inputs[counter]), outer.get(n.inputs[limit], n.inputs[limit])
            invariant = name not in producer and name not in body.inputs and name in g.types  # (from around)
            found = value_ranges(g, [name])[name] if invariant else None
            if rise is not None and found is None and unbounded is not None and invariant:
                unbounded.append(name)
            if rise is not None and found is not None:
                # (iteration t goes on only if first + rise * t is below the limit: the last
                # that may run is t = N - 1 where t = N - 2 still went on)
                first, step, hi = rise[0], rise[1], float(found[1].max())
                gap = math.ceil((hi - first) / step) if strict else math.floor((hi - first) / step) + 1
                bounds.append(max(gap + 1, 1))
    return min(bounds) if bounds else None


def _entry_loop_infer(g, node, p):
    body, _, _, _, leaves, scans = loop_body_graph(g, node)
    resolve(body, fold_floats=False)
    own = _claim_own_symbols(g, node, body)
    for a, b, where, unless in body.checks:  # (the module checks them: before the loop, or in it once read)
        require_equal(a, b, where, unless)
    out = []
    for i, (initial, leave) in enumerate(zip(node.inputs, leaves)):
        if body.types[leave] != g.types[initial]:
            raise ShapeError(f"{node.describe()}: carried value {i} is {g.types[initial]} before the loop and "
                             f"{body.types[leave]} after an iteration; Kiln compiles one static type per value")
        out.append(g.types[initial])
    length = _iterations_run(g, node) if node.attrs.get("iterations") else \
        node.attrs["trip"]
    for i, s in enumerate(scans):
        t = body.types[s]
        varies = sorted({name for d in t.shape if isinstance(d, Dim) for name in d.symbols} & set(own))
        if varies:
            raise UnsupportedError(f"{node.describe()}: scan output {i} is {t}, whose size {', '.join(varies)} the "
                                   "body computes from each iteration's data; stacked, every iteration's must agree")
        out.append(TensorType((length,) + t.shape, t.dtype))
    return out + ([TensorType((), "int64")] if node.attrs.get("iterations") else [])


def _iterations_run(g, node):
    """How many iterations a kiln.Loop that stops on its condition runs: counted as it runs,
    within most_iterations."""
    most = most_iterations(g, node)
    if most is not None and most <= MAX_ITERATIONS_COUNTED:
        return counted(f"iterations({node.name})", node.outputs[-1], most,
                       f"{node.describe()}: the number of iterations it ran")
    limits = []
    _counter_bound(g, node, limits)
    if limits:  # (what would bound it, and how to bound that)
        why = f"its condition stops it once a counter reaches '{limits[0]}', but {unbounded_origin(g, limits[0])}" \
              f"{bounds_hint(g, [unbounded_source(g, limits[0])[0]])}"
    elif most is None:
        why = _why_unbounded(g, node)
    else:
        why = "its trip count bounds them: a Min or Clip on it bounds them tighter"
    most_text = "which nothing bounds" if most is None else f"{most}, more than the {MAX_ITERATIONS_COUNTED} it allows"
    raise UnsupportedError(f"{node.describe()}: its scan outputs are as long as the iterations it runs, known at run "
                           f"time only; Kiln plans their memory at the most it may run, {most_text}: {why}")


def _claim_own_symbols(g: Graph, node: Node, body: Graph) -> list:
    """The sizes the body reads from each iteration's data (kiln.ReadSizes in it), and what is
    computed from them, become symbols of g too, after the others: the model's entry binds
    them in the loop, each iteration (their tensors named as the body's are once lowered)."""
    prefix, own = body_prefix(node), []
    for name, d in body.derived.items():
        if name in body.outer_symbols:
            continue
        expr = getattr(d, "expr", None)
        if expr and expr[0] == COUNTED:
            d = Computed((COUNTED, expr[1] if expr[1] in captured_inputs(node) else prefix + expr[1]), d.what)
        g.symbols.setdefault(name, body.symbols[name])
        g.derived[name] = d
        own.append(name)
    # (kept on the node: type inference forgets where a count comes from each time it runs)
    node.attrs["own_symbols"] = own
    return own


def _loop_results(g: Graph, node: Node, carried: list, slices: list) -> list[Node]:
    """The Loop's outputs once it is done: the carried values, and the scan outputs stacked."""
    nodes = [Node(IDENTITY, [v], [o], {}, f"{node.name}/out{i}", node.guard)
             for i, (v, o) in enumerate(zip(carried, node.outputs)) if o and v not in g.sequences]
    g.sequences.update({o: g.sequences[v] for v, o in zip(carried, node.outputs) if o and v in g.sequences})
    for k, (parts, out) in enumerate(zip(slices, node.outputs[len(carried):])):
        if not parts:
            raise UnsupportedError(f"{node.describe()}: scan output {k} has no iterations (an empty tensor)")
        if out:
            nodes += _stack(g, node, parts, 0, out, f"scan{k}")
    return nodes


def _stack(g: Graph, node: Node, parts: list, axis: int, out: str, tag: str) -> list[Node]:
    axes = g.add_constant(f"{node.key}/{tag}/axes", np.array([axis], np.int64))
    nodes, expanded = [], []
    for i, p in enumerate(parts):
        expanded.append(f"{node.key}/{tag}/{i}")
        nodes.append(Node(UNSQUEEZE, [p, axes], [expanded[-1]], {}, f"{node.name}/{tag}_unsqueeze{i}", node.guard))
    nodes.append(Node(CONCAT, expanded, [out], {"axis": axis}, f"{node.name}/{tag}_concat", node.guard))
    return nodes


# ---- Scan -------------------------------------------------------------------------------------

def expand_scan(g: Graph, node: Node) -> list[Node]:
    if g.opset < 9:
        raise UnsupportedError(f"{node.describe()}: Scan of opset {g.opset} (batched, with sequence_lens) is not "
                               "supported; Kiln implements Scan as of opset 9")
    body: Subgraph = node.attrs["body"]
    n_in = int(node.attrs["num_scan_inputs"])
    states, scanned = list(node.inputs[:len(node.inputs) - n_in]), list(node.inputs[len(node.inputs) - n_in:])
    n_out = len(body.outputs) - len(states)
    in_axes = list(node.attrs.get("scan_input_axes", [0] * n_in))
    in_dirs = list(node.attrs.get("scan_input_directions", [0] * n_in))
    out_axes = list(node.attrs.get("scan_output_axes", [0] * n_out))
    out_dirs = list(node.attrs.get("scan_output_directions", [0] * n_out))
    ranks = [len(g.types[x].shape) for x in scanned]
    in_axes = [a % r for a, r in zip(in_axes, ranks)]
    lengths = {g.types[x].shape[a] for x, a in zip(scanned, in_axes)}
    if len(lengths) != 1:
        raise ShapeError(f"{node.describe()}: its scan inputs have different lengths {sorted(lengths)}")
    steps = lengths.pop()
    if is_symbolic(steps) and (any(in_axes) or any(out_axes)):
        raise UnsupportedError(f"{node.describe()}: a Scan over a symbolic length ({steps}) along an axis other "
                               "than 0 is not supported yet")
    if (is_symbolic(steps) or steps > UNROLLED_ITERATIONS) and not any(in_axes) and not any(out_axes):
        return [_entry_loop(node, body, steps, states, scanned, in_dirs, out_dirs)]
    if steps * max(len(body.nodes), 1) > MAX_UNROLLED_NODES:
        raise UnsupportedError(f"{node.describe()}: {steps} iterations of a {len(body.nodes)}-node body unroll to more "
                               f"than {MAX_UNROLLED_NODES} nodes")
    if not steps:
        raise UnsupportedError(f"{node.describe()}: a scan over an empty axis gives empty tensors")
    nodes, outs = [], [[] for _ in range(n_out)]
    for t in range(steps):
        prefix = f"{node.key}/it{t}/"
        slices = []
        for j, (x, a, d) in enumerate(zip(scanned, in_axes, in_dirs)):
            index = g.add_constant(f"{prefix}index{j}", np.array(steps - 1 - t if d else t, np.int64))
            slices.append(f"{prefix}slice{j}")
            nodes.append(Node(GATHER, [x, index], [slices[-1]], {"axis": a}, f"{prefix}gather{j}", node.guard))
        part, results = inline(g, body, prefix, dict(zip(body.inputs, states + slices)), node.guard, node)
        nodes += part
        states = results[:len(states)]
        for k, r in enumerate(results[len(states):]):
            outs[k].append(r)
    nodes += [Node(IDENTITY, [s], [o], {}, f"{node.name}/state{i}", node.guard)
              for i, (s, o) in enumerate(zip(states, node.outputs)) if o]
    for k, (parts, out) in enumerate(zip(outs, node.outputs[len(states):])):
        if out:  # (a negative axis counts from the back of the stacked output, for Unsqueeze and Concat alike)
            nodes += _stack(g, node, parts[::-1] if out_dirs[k] else parts, out_axes[k], out, f"scan{k}")
    return nodes


register(
    OpDef(IF, OPAQUE, expanded_only, expand=expand_if),
    OpDef(LOOP, OPAQUE, expanded_only, expand=expand_loop),
    OpDef(SCAN, OPAQUE, expanded_only, expand=expand_scan),
    OpDef(IF_MERGE, OPAQUE, _if_merge_infer, alone=_if_merge_kernel, expand=_if_merge_expand),
    OpDef(ENTRY_LOOP, OPAQUE, _entry_loop_infer),  # lowered by ir/lower/loops.py
    view_def(FIXED_SHAPE, _fixed_shape_infer),
)
