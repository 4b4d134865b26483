"""The op registry: one OpDef per ONNX op, everything Kiln knows about it in one place.

An OpDef says how the op fuses (its pattern kind, as in TVM), how its output types and
canonical parameters follow from its inputs (inference), how to evaluate it on constants
(folding), and how it lowers: as a *reader* (elementwise and injective ops inline into
whatever reads them) or as an *anchor* (reductions, convolutions and matmuls write a loop
nest of their own, with the rest of their group as an epilogue). The family modules beside
this one define the ops; an op's ONNX name appears in its family module only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

# Op pattern kinds, ordered as in TVM: a lower kind is easier to fuse.
ELEMWISE, BROADCAST, INJECTIVE, REDUCTION, OUT_EWISE_FUSABLE, OPAQUE = 0, 1, 2, 3, 4, 8


@dataclass(frozen=True)
class OpDef:
    name: str
    kind: int
    # (g, node, params) -> TensorType or [TensorType]; fills `params` with the op's
    # canonical parameters (normalized axes, explicit pads, ...). Never trusts declared shapes.
    infer: Callable
    # (attrs, values, g, node) -> [array]: evaluation on constants, attrs being the node's
    # attributes with its parameters over them. None: never folded (heavy ops).
    evaluate: Callable | None = None
    # (b, node) -> {output name: reader}: how an elementwise/injective op inlines.
    reader: Callable | None = None
    # (b, node, store, out_param) -> statements: an anchor's own loop nest.
    anchor: Callable | None = None
    # (b, node) -> statements: a better loop nest when the op is alone in its group.
    alone: Callable | None = None
    # (b, node, names) -> None: runs before the epilogue's readers are built (shape collapsing).
    prepare_epilogue: Callable | None = None
    view: bool = False  # a reshape: an alias of its input's buffer, no kernel of its own
    compile_time: bool = False  # evaluated at compile time only: its outputs are always constants
    shape_only: bool = False  # its value depends on its input's shape only (folded even from a variable)
    # (g, node) -> [Node]: an op built from other ops; type inference puts these in its place
    # (or None: this node is computed as it is).
    expand: Callable | None = None
    # Its element calls a math function (exp, erf, tanh, ...): fusion recomputes it in at most
    # one reading kernel instead of in each.
    costly: bool = False
    # Attributes ONNX added after the opset Kiln implements in full (frontend_onnx.FULL_OPSET)
    # that this definition implements: a model that uses them is not refused.
    later_attributes: frozenset = frozenset()


REGISTRY: dict[str, OpDef] = {}


def register(*defs: OpDef) -> None:
    for d in defs:
        if d.name in REGISTRY:
            raise ValueError(f"op {d.name} is defined twice")
        REGISTRY[d.name] = d


def op_def(name: str) -> OpDef | None:
    return REGISTRY.get(name)


def expanded_only(g, node, params):
    """The inference of an op that type inference replaces by other ops (OpDef.expand): never
    reached, unless something built such a node after inference."""
    from ..graph import UnsupportedError
    raise UnsupportedError(f"{node.describe()}: {node.op} is built from other ops by type inference, which did "
                           "not run on it")


def one_output(reader):
    """An OpDef reader from a function (b, node) -> the reader of the node's only output."""
    return lambda b, node: {node.outputs[0]: reader(b, node)}
