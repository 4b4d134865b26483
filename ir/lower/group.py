"""Lowering a fused group to one Kernel.

A group without an anchor (elementwise, broadcast, injective ops) is one loop nest over
its output with every op inlined (each op's reader, from its definition in ir/ops). A
group with an anchor (conv, matmul, gemm, reduction, pooling, softmax, layernorm) is the
anchor's own loop nest; the ops before it inline into its reads and the ops after it
become its epilogue, applied to each value it produces. Views alone in a group become
aliases: no kernel, no copy.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from ..errors import InternalError
from ..graph import Graph, Node, UnsupportedError, storage_shape
from ..symbolic import SymbolError
from ..loop import Kernel, Let, Store, Var, flat_index
from ..schedule import ScheduleError
from ..ops import BROADCAST, OUT_EWISE_FUSABLE, REDUCTION, op_def
from ..ops.compile_time import SYMBOLIC_VALUE
from ..ops.control_flow import ENTRY_LOOP
from ..passes.fuse_ops import call_guard, groups_of, kind_of
from .builder import KernelBuilder, ScheduleConfig, collapse_shapes
from .loops import all_loops, flatten, lower_loop
from .transpose import lower_blocked_transpose


@dataclass
class KernelCall:
    kernel: Kernel
    outputs: list[str]
    inputs: list[str]
    workspaces: list  # sizes in float32 units (4 bytes) each: ints, or Dims of a run-time batch
    name: str
    ops: list[str]
    nodes: list[str]
    # Runs only where each (bool tensor, value) holds: a branch of an If taken at run time.
    guard: tuple = ()
    space: dict = field(default_factory=dict)  # knob -> (choices, default): what its code could vary
    tuned: dict | None = None  # the record whose schedule it follows, if any (orchestrator/tuning_records.py)
    default_digest: str = ""  # its kernel's digest under the rules: what a tuning record is keyed by
    node_keys: tuple = ()  # its nodes' keys (Node.key), to lower the group again (relower)
    precision: str = "fp32"  # "bf16" where a product of it computes in bf16 (precision="bf16")
    bf16_nodes: tuple = ()  # the keys of those products' nodes (what an accuracy budget keeps in float32)


@dataclass
class LoweredModel:
    """What lowering hands on: the steps in order (kernel calls, and loops the entry function
    runs, ir/lower/loops.py), and what the linker and the memory plan need to know about the
    tensors they use. No graph: nothing downstream reads one."""
    steps: list  # KernelCall | LoopCall
    inputs: list[str]  # the model's, in order
    outputs: list[str]
    types: dict  # tensor name -> TensorType, every tensor a call or the model's I/O names
    constants: dict  # name -> array: the weights the calls read (packed forms included)
    aliases: dict[str, str] = field(default_factory=dict)  # view -> tensor that holds its data
    symbols: dict = field(default_factory=dict)  # the graph's: symbol -> (least, greatest)
    checks: list = field(default_factory=list)  # the graph's: (size, size, where) equal at run time
    derived: dict = field(default_factory=dict)  # the graph's: symbol -> (numerator, divisor) or Computed
    caches: list = field(default_factory=list)  # the graph's: ir.graph.CachePair, inputs and outputs sharing a buffer

    def storage(self, name: str) -> str:
        while name in self.aliases:
            name = self.aliases[name]
        return name

    def cache_layout(self, name: str) -> tuple | None:
        """A KV cache tensor's layout (its capacity along the cache's axis), else None."""
        return storage_shape(self.caches, self.types, self.symbols, name)

    @property
    def calls(self) -> list[KernelCall]:
        """Every kernel call in run order (a loop's body once): what is compiled."""
        return flatten(self.steps)


def _inline(b: KernelBuilder, node: Node) -> None:
    reader = op_def(node.op).reader
    if reader is None:
        raise UnsupportedError(f"{node.describe()}: {node.op} cannot be computed inside a fused group")
    b.readers.update(reader(b, node))


def _lower_plain(b: KernelBuilder, members: list[Node]) -> tuple:
    root = members[-1]
    blocked = lower_blocked_transpose(b, members)
    if blocked is not None:
        return blocked
    alone = op_def(root.op).alone
    if alone is not None and len(members) == 1:
        return alone(b, root)  # its own loop nest over its inputs' buffers
    if all(kind_of(m) <= BROADCAST for m in members) and len(root.outputs) == 1:
        names = {i for m in members for i in m.inputs if i} | {root.outputs[0]}
        collapse_shapes(b, names, b.type(root.outputs[0]).shape)
    for m in members:
        _inline(b, m)
    body = []
    for out in root.outputs:
        if not out:
            continue
        reader, shape, param = b.readers[out], b.shape(out), b.out_param(out)
        body += b.loops(shape, lambda idx, r=reader, s=shape, p=param: [Store(p, flat_index(idx, s), r(idx))],
                        parallel=True)
    return tuple(body)


def _feeding(before: list[Node], anchor: Node) -> set[int]:
    """ids of the nodes in `before` (in node order) whose outputs the anchor reads, directly
    or through others in `before`."""
    needed = {i for i in anchor.inputs if i}
    feeding = set()
    for m in reversed(before):
        if needed.intersection(m.outputs):
            feeding.add(id(m))
            needed.update(i for i in m.inputs if i)
    return feeding


def _lower_anchored(b: KernelBuilder, members: list[Node], anchor: Node) -> tuple:
    root = members[-1]
    pos = members.index(anchor)
    # Members before the anchor either feed it (a reduction's inlined producers) or only its
    # epilogue (a residual branch's BatchNorm, inlined here): those are read at the epilogue's
    # points, so they take its (collapsed) shapes and are inlined after prepare_epilogue.
    feeding = _feeding(members[:pos], anchor)
    for m in members[:pos]:
        if id(m) in feeding:
            _inline(b, m)
    aout, rout = anchor.outputs[0], root.outputs[0]
    epilogue = [m for m in members[:pos] if id(m) not in feeding] + members[pos + 1:]
    definition = op_def(anchor.op)
    if definition.prepare_epilogue is not None:
        definition.prepare_epilogue(b, anchor, {i for m in epilogue for i in m.inputs if i} | {rout, aout})
    acc = b.fresh("anchor")
    b.readers[aout] = lambda idx: Var(acc, b.compute(aout))
    for m in epilogue:
        _inline(b, m)
    root_reader, rshape, param = b.readers[rout], b.shape(rout), b.out_param(rout)

    def store(idx, value):
        return [Let(acc, value), Store(param, flat_index(idx, rshape), root_reader(idx))]

    return definition.anchor(b, anchor, store, param)


def lower_group(g: Graph, members: list[Node], config: ScheduleConfig, tuning: dict | None = None) -> KernelCall:
    """The group's kernel under the rules, or under `tuning` (knob -> value, ir/schedule.py):
    a knob it names that the kernel never consults is a ScheduleError."""
    b = KernelBuilder(g, config, members=tuple(members), tuning=dict(tuning or {}))
    anchors = [m for m in members if op_def(m.op).kind in (REDUCTION, OUT_EWISE_FUSABLE)]
    try:
        body = _lower_anchored(b, members, anchors[0]) if anchors else _lower_plain(b, members)
        kernel = b.kernel(tuple(b.setup) + tuple(body))
        kernel.digest  # (encoded here: a symbolic dim left in it is this group's, named below)
    except (UnsupportedError, ScheduleError):
        raise
    except (TypeError, SymbolError) as e:  # (lowering that compares a run-time size with a number)
        if not g.symbols or all(g.types[t].is_static for m in members for t in m.inputs + m.outputs if t):
            raise InternalError(f"Kiln bug: cannot lower the fused group {', '.join(m.describe() for m in members)}: "
                                f"{e!r}") from e
        raise UnsupportedError(f"{members[0].describe()} and its fused group ({', '.join(m.op for m in members)}): "
                               f"lowering with symbolic dimensions is not supported yet ({e}). Fix those dims with "
                               "--shape to build this model") from e
    except Exception as e:  # a lowering bug: name the group so it can be reported
        raise InternalError(f"Kiln bug: cannot lower the fused group {', '.join(m.describe() for m in members)}: "
                            f"{e!r}") from e
    unused = sorted(set(b.tuning) - set(b.space))
    if unused:
        raise ScheduleError(f"knob(s) {', '.join(unused)} do not apply to "
                            f"{', '.join(m.describe() for m in members)}")
    ops = [m.op for m in members]
    name = "fused_" + "_".join(dict.fromkeys(o.lower() for o in ops))
    return KernelCall(kernel, list(b.outputs), list(b.inputs), list(b.workspaces), name[:60], ops,
                      [m.name for m in members], call_guard(members), b.space, None, kernel.digest,
                      tuple(m.key for m in members), "bf16" if b.reduced else "fp32",
                      (anchors[0].key,) if b.reduced else ())


def _tuned(g: Graph, members: list[Node], config: ScheduleConfig, schedules) -> KernelCall:
    """The group's kernel under the rules, or under the schedule `schedules` has for it: a
    callable from the rules' kernel to a tuning record (a dict with "schedule"), or None.
    A record whose schedule does not fit the kernel is warned about and left unused."""
    call = lower_group(g, members, config)
    record = schedules(call) if schedules is not None and call.space else None
    if not record or not record["schedule"]:  # (none, or the rules measured best)
        call.tuned = record
        return call
    try:
        tuned = lower_group(g, members, config, record["schedule"])
    except ScheduleError as e:
        warnings.warn(f"kiln: a tuning record for {call.name} does not fit its kernel ({e}); using the rules")
        return call
    tuned.tuned, tuned.default_digest = record, call.default_digest
    return tuned


def relower(g: Graph, call: KernelCall, config: ScheduleConfig, tuning: dict) -> KernelCall:
    """`call`'s group lowered again under `tuning` (a tuner's candidate). g: a working copy of
    the graph `call` was lowered from; it takes the packed weights the new kernel reads."""
    by_key = {n.key: n for n in g.nodes}
    if not all(k in by_key for k in call.node_keys):
        raise InternalError(f"the nodes of {call.name} are not in the graph given to relower")
    return lower_group(g, [by_key[k] for k in call.node_keys], config, tuning)


def _read(model: LoweredModel) -> set:
    """The storage of every tensor a kernel, a loop or the model's outputs read."""
    read = {model.storage(t) for c in model.calls for t in c.inputs} | {model.storage(o) for o in model.outputs}
    return read | {model.storage(t) for loop in all_loops(model.steps) for t in loop.tensors()}


def _without_unread_sizes(model: LoweredModel) -> list:
    """The steps but the kernels writing symbolic values (sizes) that nothing reads: the ops
    using them read them at build time (a Reshape's shape), not from a buffer."""
    read = _read(model)
    return [s for s in model.steps if not (isinstance(s, KernelCall) and s.ops == [SYMBOLIC_VALUE]
                                           and not any(model.storage(o) in read for o in s.outputs))]


def lower(graph: Graph, config: ScheduleConfig | None = None, schedules=None) -> LoweredModel:
    """The graph's fused groups as kernel calls. The graph itself is left as it was: packed
    weights go into a working copy, and out through the LoweredModel. `schedules` (see _tuned)
    gives tuned schedules; without it every kernel follows the rules."""
    config = config or ScheduleConfig()
    g = graph.copy()
    steps, aliases, types, body_constants = [], {}, dict(g.types), {}
    for members in groups_of(g):
        root = members[-1]
        if len(members) == 1 and op_def(root.op).view:
            aliases[root.outputs[0]] = root.inputs[0]
        elif root.op == ENTRY_LOOP:
            loop, body = lower_loop(g, root, config, lower)
            steps.append(loop)
            types.update(body.types)
            aliases.update(body.aliases)
            body_constants.update(body.constants)
            aliases.update({out: state for (_, state, _), out in zip(loop.state, root.outputs) if out})
        else:
            steps.append(_tuned(g, members, config, schedules))
    aliases.update({w: c.present for c in g.caches for w in c.writers})  # (written in the present's buffer)
    model = LoweredModel(steps, list(g.inputs), list(g.outputs), types, {}, aliases, dict(g.symbols), list(g.checks),
                         dict(g.derived), list(g.caches))
    model.steps = _without_unread_sizes(model)
    used = _read(model)
    model.constants = {name: value for name, value in {**g.constants, **body_constants}.items() if name in used}
    return model
