"""The normalizations onnxruntime's transformer optimizer and onnxruntime-genai's model
builder write: SimplifiedLayerNormalization (RMS normalization, which onnxruntime registers
in the default domain), and com.microsoft.SkipLayerNormalization and
SkipSimplifiedLayerNormalization, which add a residual (and a bias) first and can return
that sum for the next layer's residual. Each is built from ONNX's own ops: the sum is an
elementwise prologue of the normalization's kernel, and a sum that is also returned is
computed once, as any tensor two kernels read."""
from __future__ import annotations

import numpy as np

from ..dtypes import DTYPES
from ..graph import Node, UnsupportedError
from .elementwise import ADD, CAST, MUL, RECIPROCAL, SQRT
from .node_builder import NodeBuilder, input_at, output_at
from .quantize import CONTRIB
from .reduce import LAYER_NORMALIZATION, REDUCE_MEAN, RMS_NORMALIZATION
from .registry import OPAQUE, OpDef, expanded_only, register
from .shape import IDENTITY

SIMPLIFIED_LAYER_NORMALIZATION = "SimplifiedLayerNormalization"
SKIP_LAYER_NORMALIZATION = CONTRIB + "SkipLayerNormalization"
SKIP_SIMPLIFIED_LAYER_NORMALIZATION = CONTRIB + "SkipSimplifiedLayerNormalization"
SKIP_EPSILON = 1e-12  # onnxruntime's default for both Skip ops (the plain one's is 1e-5)


def _inverse_rms(body: NodeBuilder, x: str, like: str, axis: int, epsilon: float, out: str) -> None:
    """1 / sqrt(mean(x^2 over [axis, rank)) + epsilon), float32 with the reduced dims kept:
    the inv_std_var output onnxruntime gives beside an RMS normalization. x has the rank and
    type of `like`, a typed input (x may be the expansion's own, not typed yet)."""
    rank = len(body.g.types[like].shape)
    axis = axis % rank
    if body.g.types[like].dtype != "float32":
        x = body.add(CAST, [x], to=DTYPES["float32"].onnx)
    mean = body.add(REDUCE_MEAN, [body.add(MUL, [x, x]), body.const(np.arange(axis, rank, dtype=np.int64))],
                    keepdims=1)
    root = body.add(SQRT, [body.add(ADD, [mean, body.const(np.float32(epsilon))])])
    body.add(RECIPROCAL, [root], out)


def _expand_simplified(g, node: Node) -> list[Node]:
    """Y = X / sqrt(mean(X^2) + epsilon) * scale over [axis, rank): RMSNormalization."""
    body = NodeBuilder(g, node)
    axis, epsilon = int(node.attrs.get("axis", -1)), float(node.attrs.get("epsilon", 1e-5))
    body.add(RMS_NORMALIZATION, node.inputs[:2], node.outputs[0], axis=axis, epsilon=epsilon,
             stash_type=int(node.attrs.get("stash_type", 1)))
    if output_at(node, 1):
        _inverse_rms(body, node.inputs[0], node.inputs[0], axis, epsilon, node.outputs[1])
    return body.nodes


def _skip_sum(body: NodeBuilder, node: Node, bias_index: int) -> str:
    """input + skip (+ bias): returned as output 3 where the node names it."""
    total = body.add(ADD, [node.inputs[0], node.inputs[1]])
    if input_at(node, bias_index):
        total = body.add(ADD, [total, node.inputs[bias_index]])
    return body.add(IDENTITY, [total], output_at(node, 3)) if output_at(node, 3) else total


def _expand_skip_simplified(g, node: Node) -> list[Node]:
    """RMS normalization of input + skip (+ bias) over the last axis, times gamma."""
    if output_at(node, 1):
        raise UnsupportedError(f"{node.describe()}: its output 1 (mean) is not computed by an RMS normalization; "
                               "leave it unnamed")
    body = NodeBuilder(g, node)
    epsilon = float(node.attrs.get("epsilon", SKIP_EPSILON))
    total = _skip_sum(body, node, 3)
    if node.outputs[0]:
        body.add(RMS_NORMALIZATION, [total, node.inputs[2]], node.outputs[0], axis=-1, epsilon=epsilon)
    if output_at(node, 2):
        _inverse_rms(body, total, node.inputs[0], -1, epsilon, node.outputs[2])
    return body.nodes


def _expand_skip(g, node: Node) -> list[Node]:
    """LayerNormalization of input + skip (+ bias) over the last axis, with gamma and beta."""
    body = NodeBuilder(g, node)
    epsilon = float(node.attrs.get("epsilon", SKIP_EPSILON))
    total = _skip_sum(body, node, 4)
    scale_bias = [node.inputs[2]] + ([node.inputs[3]] if input_at(node, 3) else [])
    stats = [output_at(node, 1), output_at(node, 2)]
    while stats and not stats[-1]:
        stats.pop()
    if node.outputs[0] or stats:
        body.add_many(LAYER_NORMALIZATION, [total] + scale_bias, [node.outputs[0]] + stats, axis=-1, epsilon=epsilon)
    return body.nodes


register(
    OpDef(SIMPLIFIED_LAYER_NORMALIZATION, OPAQUE, expanded_only, expand=_expand_simplified),
    OpDef(SKIP_SIMPLIFIED_LAYER_NORMALIZATION, OPAQUE, expanded_only, expand=_expand_skip_simplified),
    OpDef(SKIP_LAYER_NORMALIZATION, OPAQUE, expanded_only, expand=_expand_skip),
)
