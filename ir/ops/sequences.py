"""Sequences whose elements are known when the model is built: torch.jit.script's lists.

A scripted model builds a list (`outs: List[Tensor] = []`, `outs.append(y)` in a loop,
`torch.stack(outs)`) and the TorchScript exporter writes it as ONNX sequence ops:
SequenceEmpty, SequenceInsert, ConcatFromSequence. Kiln compiles tensors only, so type
inference expands each sequence op away: a sequence is a list of *items* kept beside the
graph (`Graph.sequences`, while inference runs), each item a tensor (one element) or
`Rows(stacked)` (one element per row of a tensor stacked along a new axis 0: what a loop
appended, ir/ops/control_flow.py's `_sequence_appends`). Ops that make sequences (Empty,
Construct, Insert, Erase, SplitToSequence) edit the list and compute nothing; ops that read
them (SequenceAt, SequenceLength, ConcatFromSequence) become the tensor ops giving their
result. What needs a sequence as a value (a model input or output, an If's branch, an
insert at a position computed at run time) is refused by name.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..graph import Graph, Node, ShapeError, UnsupportedError
from .compile_time import SHAPE
from .elementwise import SUM
from .registry import OPAQUE, OpDef, expanded_only, register
from .shape import CONCAT, GATHER, IDENTITY, RESHAPE, SLICE, SPLIT, SQUEEZE, TRANSPOSE, UNSQUEEZE

SEQUENCE_EMPTY, SEQUENCE_CONSTRUCT, SEQUENCE_INSERT = "SequenceEmpty", "SequenceConstruct", "SequenceInsert"
SEQUENCE_ERASE, SEQUENCE_AT, SEQUENCE_LENGTH = "SequenceErase", "SequenceAt", "SequenceLength"
CONCAT_FROM_SEQUENCE, SPLIT_TO_SEQUENCE = "ConcatFromSequence", "SplitToSequence"


@dataclass(frozen=True)
class Rows:
    """Elements of a sequence: the rows of `stacked` along its axis 0."""
    stacked: str


def items(g: Graph, node: Node, name: str) -> list:
    """The items of sequence `name`, read by `node`."""
    if name not in g.sequences:
        what = "a model input" if name in g.inputs else "a tensor" if name in g.types else "unknown here"
        raise UnsupportedError(f"{node.describe()}: its input '{name}' is not a sequence Kiln built from its ops "
                               f"({what}); Kiln compiles sequences whose elements it knows when it builds")
    return g.sequences[name]


def _position(g: Graph, node: Node, index: int, length: int, inserting: bool = False) -> int:
    """The constant position input `index` of `node` (ONNX: negative counts from the back) as
    0..length-1 (0..length where inserting)."""
    name = node.inputs[index]
    if name not in g.constants:
        raise UnsupportedError(f"{node.describe()}: its position '{name}' is computed at run time; Kiln needs a "
                               "sequence's positions when it builds")
    p = int(np.asarray(g.constants[name]).reshape(-1)[0])
    p += length if p < 0 else 0
    if not 0 <= p <= length - (not inserting):
        raise ShapeError(f"{node.describe()}: position {int(np.asarray(g.constants[name]).reshape(-1)[0])} is "
                         f"outside a sequence of {length}")
    return p


def _tensors(g: Graph, node: Node, name: str) -> list:
    """The items of `name` where each is one tensor (positions count elements), else refused."""
    found = items(g, node, name)
    if any(isinstance(i, Rows) for i in found):
        raise UnsupportedError(f"{node.describe()}: it indexes a sequence a loop appended to, whose length is the "
                               "loop's; Kiln supports reading such a sequence whole (ConcatFromSequence, "
                               "SequenceLength) or by a position within the loop's rows alone")
    return found


def _define(g: Graph, node: Node, found: list) -> list:
    """Sequence `node` makes is `found`; nothing to compute."""
    if node.outputs[0] in g.outputs:
        raise UnsupportedError(f"{node.describe()}: its output '{node.outputs[0]}' is a sequence and an output of the "
                               "model; Kiln's outputs are tensors (a ConcatFromSequence makes one)")
    g.sequences[node.outputs[0]] = found
    return []


def sequence_passed_on(g: Graph, node: Node) -> None:
    """An op that is not a sequence op, given a sequence: an Identity passes it on (the
    exporters write them where a list leaves a branch or a loop); any other is refused."""
    if node.op != IDENTITY:
        seq = next(i for i in node.inputs if i in g.sequences)
        raise UnsupportedError(f"{node.describe()}: its input '{seq}' is a sequence; {node.op} takes tensors")
    _define(g, node, g.sequences[node.inputs[0]])


def _empty(g, node):
    return _define(g, node, [])


def _construct(g, node):
    return _define(g, node, list(node.inputs))


def _insert(g, node):
    seq = items(g, node, node.inputs[0])
    if len(node.inputs) < 3 or not node.inputs[2]:
        return _define(g, node, seq + [node.inputs[1]])
    seq = _tensors(g, node, node.inputs[0])
    p = _position(g, node, 2, len(seq), inserting=True)
    return _define(g, node, seq[:p] + [node.inputs[1]] + seq[p:])


def _erase(g, node):
    seq = _tensors(g, node, node.inputs[0])
    if not seq:
        raise ShapeError(f"{node.describe()}: it erases from an empty sequence")
    p = _position(g, node, 1, len(seq)) if len(node.inputs) > 1 and node.inputs[1] else len(seq) - 1
    return _define(g, node, seq[:p] + seq[p + 1:])


def _at(g, node):
    seq = items(g, node, node.inputs[0])
    if len(seq) == 1 and isinstance(seq[0], Rows):  # (a loop's rows alone: a Gather, any position)
        return [Node(GATHER, [seq[0].stacked, node.inputs[1]], list(node.outputs), {"axis": 0}, node.name,
                     node.guard)]
    seq = _tensors(g, node, node.inputs[0])
    return [Node(IDENTITY, [seq[_position(g, node, 1, len(seq))]], list(node.outputs), {}, node.name, node.guard)]


def _length(g, node):
    seq = items(g, node, node.inputs[0])
    ones = sum(not isinstance(i, Rows) for i in seq)
    tag = f"{node.key}/length"
    parts, nodes = [], []
    zero = g.add_constant(f"{tag}/zero", np.array([0], np.int64))
    for k, item in enumerate(i for i in seq if isinstance(i, Rows)):
        parts.append(f"{tag}/rows{k}")
        nodes += [Node(SHAPE, [item.stacked], [f"{tag}/shape{k}"], {}, f"{node.name}/shape{k}", node.guard),
                  Node(GATHER, [f"{tag}/shape{k}", zero], [parts[-1]], {"axis": 0}, f"{node.name}/rows{k}",
                       node.guard)]
    if not parts:
        g.add_constant(node.outputs[0], np.array(ones, np.int64))
        return []
    parts.append(g.add_constant(f"{tag}/ones", np.array([ones], np.int64)))
    axes = g.add_constant(f"{tag}/axes", np.array([0], np.int64))
    nodes += [Node(SUM, parts, [f"{tag}/sum"], {}, f"{node.name}/sum", node.guard),
              Node(SQUEEZE, [f"{tag}/sum", axes], list(node.outputs), {}, node.name, node.guard)]
    return nodes


def _concat(g, node):
    """ConcatFromSequence: the elements joined along `axis`, or stacked along a new one."""
    seq = items(g, node, node.inputs[0])
    if not seq:
        raise ShapeError(f"{node.describe()}: it concatenates an empty sequence")
    new_axis, axis = int(node.attrs.get("new_axis", 0)), int(node.attrs["axis"])
    first = seq[0].stacked if isinstance(seq[0], Rows) else seq[0]
    rank = len(g.types[first].shape) - isinstance(seq[0], Rows)
    if not -(rank + new_axis) <= axis < rank + new_axis:
        raise ShapeError(f"{node.describe()}: axis {axis} of elements of rank {rank}"
                         f"{' stacked' if new_axis else ''}")
    axis %= rank + new_axis
    tag, nodes, parts = f"{node.key}/concat", [], []
    axes = g.add_constant(f"{tag}/axes", np.array([axis], np.int64))
    for k, item in enumerate(seq):
        parts.append(f"{tag}/part{k}")
        if isinstance(item, Rows):
            nodes += rows_joined(g, item.stacked, rank, axis, new_axis, parts[-1], f"{tag}/rows{k}", node.name,
                                 node.guard)
        elif new_axis:
            nodes.append(Node(UNSQUEEZE, [item, axes], [parts[-1]], {}, f"{node.name}/unsqueeze{k}", node.guard))
        else:
            parts[-1] = item
    nodes.append(Node(CONCAT, parts, list(node.outputs), {"axis": axis}, node.name, node.guard))
    return nodes


def _split(g, node):
    """SplitToSequence: a Split into constant sizes (or one element per index along `axis`,
    squeezed unless keepdims), each part an element."""
    x = node.inputs[0]
    t = g.types[x]
    axis = int(node.attrs.get("axis", 0)) % len(t.shape)
    split = node.inputs[1] if len(node.inputs) > 1 and node.inputs[1] else ""
    if split and split not in g.constants:
        raise UnsupportedError(f"{node.describe()}: its split '{split}' is computed at run time; Kiln needs the "
                               "number of elements when it builds")
    length = t.shape[axis]
    if not isinstance(length, int):
        raise UnsupportedError(f"{node.describe()}: it splits along a dim known at run time only ({length}); Kiln "
                               "needs the number of elements when it builds")
    sizes = np.asarray(g.constants[split]).reshape(-1) if split else None
    if sizes is not None and np.asarray(g.constants[split]).ndim == 0:  # (one size: chunks of it, the last shorter)
        chunk = int(sizes[0])
        sizes = np.array([chunk] * (length // chunk) + ([length % chunk] if length % chunk else []), np.int64)
    count = len(sizes) if sizes is not None else length
    tag = f"{node.key}/split"
    parts = [f"{tag}/{k}" for k in range(count)]
    sizes = sizes if sizes is not None else np.ones(count, np.int64)
    nodes = [Node(SPLIT, [x, g.add_constant(f"{tag}/sizes", sizes.astype(np.int64))], parts, {"axis": axis},
                  f"{node.name}/split", node.guard)]
    if not split and not int(node.attrs.get("keepdims", 1)):
        axes = g.add_constant(f"{tag}/axes", np.array([axis], np.int64))
        nodes += [Node(SQUEEZE, [p, axes], [f"{p}/squeezed"], {}, f"{node.name}/squeeze{k}", node.guard)
                  for k, p in enumerate(parts)]
        parts = [f"{p}/squeezed" for p in parts]
    return nodes + _define(g, node, parts)


def rows_joined(g: Graph, stacked: str, rank: int, axis: int, new_axis: bool, out: str, tag: str, name: str,
                guard: tuple) -> list[Node]:
    """`out` from `stacked`, rank-`rank` rows stacked along a new axis 0: the rows stacked
    along `axis` instead (`new_axis`), or joined along it (axis 0 moved beside it and merged
    into it: Transpose, Shape/Slice/Concat of the sizes, Reshape)."""
    nodes, moved = [], stacked if new_axis or not axis else f"{tag}/moved"
    if axis:
        perm = list(range(1, axis + 1)) + [0] + list(range(axis + 1, rank + 1))
        moved = out if new_axis else moved
        nodes.append(Node(TRANSPOSE, [stacked], [moved], {"perm": perm}, f"{name}/{tag}/move", guard))
    if new_axis:
        return nodes or [Node(IDENTITY, [stacked], [out], {}, f"{name}/{tag}/rows", guard)]
    shape, sizes = f"{tag}/shape", f"{tag}/sizes"
    const = {c: g.add_constant(f"{tag}/{c}", np.array(v, np.int64))
             for c, v in (("before", [0] * axis), ("merged", [-1]), ("rest", [axis + 2]), ("end", [rank + 1]))}
    kept = [const["before"]] if axis else []  # (0: the dims before the axis as they are)
    return nodes + [
        Node(SHAPE, [moved], [shape], {}, f"{name}/{tag}/shape", guard),
        Node(SLICE, [shape, const["rest"], const["end"]], [f"{tag}/after"], {}, f"{name}/{tag}/after", guard),
        Node(CONCAT, kept + [const["merged"], f"{tag}/after"], [sizes], {"axis": 0}, f"{name}/{tag}/sizes", guard),
        Node(RESHAPE, [moved, sizes], [out], {}, f"{name}/{tag}/merge", guard)]


register(*(OpDef(name, OPAQUE, expanded_only, expand=expand) for name, expand in (
    (SEQUENCE_EMPTY, _empty), (SEQUENCE_CONSTRUCT, _construct), (SEQUENCE_INSERT, _insert),
    (SEQUENCE_ERASE, _erase), (SEQUENCE_AT, _at), (SEQUENCE_LENGTH, _length), (CONCAT_FROM_SEQUENCE, _concat),
    (SPLIT_TO_SEQUENCE, _split))))
