"""Ops ONNX renamed, as the models of older opsets spell them: Upsample (Resize before opset
10) and Scatter (ScatterElements before 11). Each becomes the op it was renamed to."""
from __future__ import annotations

import numpy as np

from ..graph import Node, UnsupportedError
from .indexing import SCATTER_ELEMENTS
from .node_builder import NodeBuilder
from .registry import INJECTIVE, OPAQUE, OpDef, expanded_only, register
from .shape import RESIZE


def _expand_upsample(g, node):
    """Upsample (opsets 7-9) is Resize as opset 10 defined it: asymmetric coordinates, the
    nearest pixel by floor; its scales an attribute (7) or an input (9)."""
    mode = {"nearest": "nearest", "linear": "linear", "bilinear": "linear"}.get(node.attrs.get("mode", "nearest"))
    if mode is None:
        raise UnsupportedError(f"{node.describe()}: Upsample mode {node.attrs.get('mode')!r}")
    nb = NodeBuilder(g, node)
    scales = nb.const(np.array(node.attrs["scales"], np.float32)) if "scales" in node.attrs else node.inputs[1]
    nb.add(RESIZE, [node.inputs[0], "", scales], node.outputs[0], mode=mode,
           coordinate_transformation_mode="asymmetric", nearest_mode="floor")
    return nb.nodes


def _expand_scatter(g, node):
    return [Node(SCATTER_ELEMENTS, list(node.inputs), list(node.outputs), dict(node.attrs), node.name)]


register(
    OpDef("Upsample", INJECTIVE, expanded_only, expand=_expand_upsample),
    OpDef("Scatter", OPAQUE, expanded_only, expand=_expand_scatter),
)
