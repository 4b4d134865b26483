"""Ops ONNX defines as functions of other ops, which Kiln builds from that definition:
Attention and RotaryEmbedding (opset 23), SwiGLU (28), CausalConvWithState (27), CenterCropPad,
the losses NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss, and the window functions. Type inference replaces such a node by the body
onnx gives for it, specialized to the node's attributes and its inputs' types (a context-
dependent function), so what the spec says the op computes is exactly what is compiled;
the body's ops then infer, fold and fuse like any others.
"""
from __future__ import annotations

from ..dtypes import DTYPES
from ..graph import Graph, Node, UnsupportedError
from ..onnx_attrs import attr_value, constant_value
from .compile_time import CONSTANT
from .registry import OPAQUE, OpDef, expanded_only, register


def _proto_attributes(node: Node) -> dict:
    """Kiln's attribute values back in the forms onnx.helper.make_node takes."""
    import numpy as np
    from onnx import numpy_helper
    return {k: numpy_helper.from_array(v) if isinstance(v, np.ndarray) else v for k, v in node.attrs.items()}


def _type_proto(g: Graph, name: str):
    from onnx import TypeProto, helper
    if not name:
        return TypeProto()  # an omitted optional input
    t = g.types[name]
    return helper.make_tensor_type_proto(DTYPES[t.dtype].onnx, list(t.shape))


def _body_attributes(body_node, node: Node, schema) -> dict:
    """A body node's attributes; one that refers to an attribute of the function's node takes
    that node's value, else the op's default, else is left out (the body op's own default)."""
    out = {}
    for a in body_node.attribute:
        if not a.ref_attr_name:
            out[a.name] = attr_value(a)
        elif a.ref_attr_name in node.attrs:
            out[a.name] = node.attrs[a.ref_attr_name]
        elif a.ref_attr_name in schema.attributes and schema.attributes[a.ref_attr_name].default_value.type:
            out[a.name] = attr_value(schema.attributes[a.ref_attr_name].default_value)
    return out


def expand_function(g: Graph, node: Node) -> list[Node]:
    """The nodes of `node`'s function body, its inputs and outputs wired to the node's;
    the body's own tensors are named after the node, so expansions never collide."""
    import onnx
    from onnx import helper

    schema = onnx.defs.get_schema(node.op, g.opset)
    proto = helper.make_node(node.op, node.inputs, node.outputs, **_proto_attributes(node))
    if schema.has_context_dependent_function:
        types = [_type_proto(g, i).SerializeToString() for i in node.inputs]
        body = onnx.FunctionProto()
        body.ParseFromString(schema.get_context_dependent_function(proto.SerializeToString(), types))
    elif schema.has_function:
        body = schema.function_body
    else:
        raise UnsupportedError(f"{node.describe()}: onnx gives no function body for {node.op} at opset {g.opset}")
    prefix = f"{node.key}/"
    names = {f: (node.inputs[i] if i < len(node.inputs) else "") for i, f in enumerate(body.input)}
    names.update({f: node.outputs[i] if i < len(node.outputs) and node.outputs[i] else prefix + f
                  for i, f in enumerate(body.output)})
    rename = lambda n: names.get(n, prefix + n) if n else ""  # noqa: E731
    nodes = []
    for i, n in enumerate(body.node):
        if n.domain not in ("", "ai.onnx"):
            raise UnsupportedError(f"{node.describe()}: its function body uses domain '{n.domain}'")
        inner = Node(n.op_type, [rename(x) for x in n.input], [rename(x) for x in n.output],
                     _body_attributes(n, node, schema), f"{node.name}/{n.op_type}_{i}")
        if inner.op == CONSTANT:
            g.add_constant(inner.outputs[0], constant_value(inner))
            continue
        nodes.append(inner)
    return nodes


# (AffineGrid's and LinearAttention's bodies hold subgraphs, an If's and a Loop's, whose names
# expand_function does not rename: not claimed.)
register(*(OpDef(name, OPAQUE, expanded_only, expand=expand_function) for name in (
    "Attention", "RotaryEmbedding", "SwiGLU", "CausalConvWithState", "CenterCropPad", "NegativeLogLikelihoodLoss",
    "SoftmaxCrossEntropyLoss", "BlackmanWindow", "HammingWindow", "HannWindow")))
