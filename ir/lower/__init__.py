"""Lowering: each fused group of the graph becomes one loop-nest Kernel.

A group without an anchor (elementwise, broadcast, injective ops) is one loop nest over
its output with every op inlined. A group with an anchor (conv, matmul, gemm, reduction,
pooling, softmax, layernorm) is the anchor's own loop nest; the ops before it inline into
its reads and the ops after it become its epilogue, applied to each value it produces.
Views (Reshape and friends) alone in a group become aliases: no kernel, no copy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import InternalError
from ..graph import Graph, Node, UnsupportedError
from ..loop import Kernel, Let, Store, Var, flat_index
from ..op_types import BROADCAST, OP_KIND, OUT_EWISE_FUSABLE, REDUCTION
from ..passes.fuse_ops import VIEWS, groups_of, kind_of
from .builder import KernelBuilder, ScheduleConfig
from .elementwise import compute
from .gemm import is_depthwise, lower_conv, lower_conv_transpose, lower_gemm, lower_matmul
from .reduce import lower_layernorm, lower_pool, lower_reduce, lower_softmax

__all__ = ["lower", "LoweredModel", "KernelCall", "ScheduleConfig"]


@dataclass
class KernelCall:
    kernel: Kernel
    outputs: list[str]
    inputs: list[str]
    workspaces: list[int]  # float32 elements each
    name: str
    ops: list[str]
    nodes: list[str]


@dataclass
class LoweredModel:
    graph: Graph
    calls: list[KernelCall]
    aliases: dict[str, str] = field(default_factory=dict)  # view -> tensor that holds its data

    def storage(self, name: str) -> str:
        while name in self.aliases:
            name = self.aliases[name]
        return name


def _aligned(shape, rank):
    return (1,) * (rank - len(shape)) + tuple(shape)


def collapse_shapes(b: KernelBuilder, names, out_shape, fixed: int = 0) -> bool:
    """Merge adjacent dims of out_shape over which every tensor in `names` is uniformly
    full or broadcast, and give each tensor the merged shape: fewer loops, longer inner
    loops, no div/mod. The first `fixed` dims are kept as they are. Returns success."""
    rank = len(out_shape)
    aligned = {n: _aligned(b.shape(n), rank) for n in names}
    if any(len(s) != rank for s in aligned.values()):
        return False
    groups: list[list[int]] = [[d] for d in range(fixed)]
    last_pattern = None
    for d in range(fixed, rank):
        if out_shape[d] == 1 and d >= fixed:
            continue
        pattern = tuple(s[d] == out_shape[d] for s in aligned.values())
        if any(s[d] not in (1, out_shape[d]) for s in aligned.values()):
            return False
        if groups and len(groups) > fixed and pattern == last_pattern:
            groups[-1].append(d)
        else:
            groups.append([d])
        last_pattern = pattern
    for n, s in aligned.items():
        b.shapes[n] = tuple(math.prod(s[d] for d in grp) for grp in groups)
    return True


def _lower_plain(b: KernelBuilder, members: list[Node]) -> tuple:
    root = members[-1]
    if all(kind_of(m) <= BROADCAST for m in members) and len(root.outputs) == 1:
        names = {i for m in members for i in m.inputs if i} | {root.outputs[0]}
        collapse_shapes(b, names, b.type(root.outputs[0]).shape)
    for m in members:
        b.readers.update(compute(b, m))
    if root.op == "Concat" and len(members) == 1:
        return _lower_concat(b, root)
    body = []
    for out in root.outputs:
        if not out:
            continue
        reader, shape, param = b.readers[out], b.shape(out), b.out_param(out)
        body += b.loops(shape, lambda idx, r=reader, s=shape, p=param: [Store(p, flat_index(idx, s), r(idx))])
    return tuple(body)


def _lower_concat(b: KernelBuilder, node: Node) -> tuple:
    """One loop nest per input, each writing its slab: no selects, no wasted loads."""
    out, axis = node.outputs[0], b.attrs(node)["axis"]
    oshape, param = b.shape(out), b.out_param(out)
    body, off = [], 0
    for name in node.inputs:
        if not name:
            continue
        r, shape = b.reader(name), b.shape(name)

        def point(idx, r=r, off=off):
            dest = list(idx)
            dest[axis] = dest[axis] + off
            return [Store(param, flat_index(dest, oshape), r(idx))]
        body += b.loops(shape, point)
        off += shape[axis]
    return tuple(body)


_ANCHORS = {
    "ReduceSum": lower_reduce, "ReduceMean": lower_reduce, "ReduceMax": lower_reduce,
    "GlobalAveragePool": lower_reduce, "GlobalMaxPool": lower_reduce,
    "LayerNormalization": lower_layernorm, "MaxPool": lower_pool, "AveragePool": lower_pool,
    "Conv": lower_conv, "ConvTranspose": lower_conv_transpose, "MatMul": lower_matmul, "Gemm": lower_gemm,
}


def _lower_anchored(b: KernelBuilder, members: list[Node], anchor: Node) -> tuple:
    root = members[-1]
    pos = members.index(anchor)
    for m in members[:pos]:
        b.readers.update(compute(b, m))
    aout, rout = anchor.outputs[0], root.outputs[0]
    epilogue = members[pos + 1:]
    if anchor.op == "Conv" and not is_depthwise(b, anchor):
        names = {i for m in epilogue for i in m.inputs if i} | {rout, aout}
        b.conv_collapsed = collapse_shapes(b, names, b.type(aout).shape, fixed=2)
    acc = b.fresh("anchor")
    b.readers[aout] = lambda idx: Var(acc, "f32")
    for m in epilogue:
        b.readers.update(compute(b, m))
    root_reader, rshape, param = b.readers[rout], b.shape(rout), b.out_param(rout)

    def store(idx, value):
        return [Let(acc, value), Store(param, flat_index(idx, rshape), root_reader(idx))]

    if anchor.op == "Softmax":
        return lower_softmax(b, anchor, store, param)
    return _ANCHORS[anchor.op](b, anchor, store)


def lower_group(g: Graph, members: list[Node], config: ScheduleConfig) -> KernelCall:
    b = KernelBuilder(g, config)
    anchors = [m for m in members if OP_KIND[m.op] in (REDUCTION, OUT_EWISE_FUSABLE)]
    try:
        body = _lower_anchored(b, members, anchors[0]) if anchors else _lower_plain(b, members)
    except UnsupportedError:
        raise
    except Exception as e:  # a lowering bug: name the group so it can be reported
        raise InternalError(f"Kiln bug: cannot lower the fused group {', '.join(m.describe() for m in members)}: "
                            f"{e!r}") from e
    ops = [m.op for m in members]
    name = "fused_" + "_".join(dict.fromkeys(o.lower() for o in ops))
    return KernelCall(b.kernel(body), list(b.outputs), list(b.inputs), list(b.workspaces), name[:60], ops,
                      [m.name for m in members])


def lower(graph: Graph, config: ScheduleConfig | None = None) -> LoweredModel:
    config = config or ScheduleConfig()
    g = graph.copy()
    calls, aliases = [], {}
    for members in groups_of(g):
        root = members[-1]
        if len(members) == 1 and root.op in VIEWS:
            aliases[root.outputs[0]] = root.inputs[0]
            continue
        calls.append(lower_group(g, members, config))
    model = LoweredModel(g, calls, aliases)
    used = {model.storage(t) for c in calls for t in c.inputs} | {model.storage(o) for o in g.outputs}
    for name in [c for c in g.constants if c not in used]:
        del g.constants[name]
    return model
