"""Ops ONNX defines as functions of other ops, which Kiln builds from that definition:
Attention and RotaryEmbedding (opset 23), SwiGLU (28), LinearAttention and CausalConvWithState
(27), AffineGrid, CenterCropPad, the losses NegativeLogLikelihoodLoss and
SoftmaxCrossEntropyLoss, and the window functions. Type inference replaces such a node by the body
onnx gives for it, specialized to the node's attributes and its inputs' types (a context-
dependent function), so what the spec says the op computes is exactly what is compiled;
the body's ops then infer, fold and fuse like any others.
"""
from __future__ import annotations

from ..dtypes import DTYPES
from ..graph import Graph, Node, Subgraph, UnsupportedError, as_kiln_array
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


def _resolved(attributes, node: Node, schema) -> list:
    """A body node's attribute protos, those that refer to an attribute of the function's node
    (ref_attr_name) given that node's value, else the op's default, else left out (the body
    op's own default then holds)."""
    from onnx import AttributeProto, helper
    given, out = _proto_attributes(node), []
    for a in attributes:
        if not a.ref_attr_name:
            out.append(a)
        elif a.ref_attr_name in given:
            out.append(helper.make_attribute(a.name, given[a.ref_attr_name]))
        elif a.ref_attr_name in schema.attributes and schema.attributes[a.ref_attr_name].default_value.type:
            default = AttributeProto()
            default.CopyFrom(schema.attributes[a.ref_attr_name].default_value)
            default.name = a.name
            out.append(default)
    return out


def _renamed_subgraph(gp, rename, node: Node, schema):
    """A copy of a body node's subgraph (an If's branch, a Loop's body) whose every tensor name,
    nested subgraphs' too, goes through `rename` as the body's own do, references resolved."""
    from onnx import GraphProto
    out = GraphProto()
    out.CopyFrom(gp)

    def walk(graph):
        for vi in (*graph.input, *graph.output, *graph.value_info):
            vi.name = rename(vi.name)
        for init in graph.initializer:
            init.name = rename(init.name)
        for n in graph.node:
            n.input[:] = [rename(x) for x in n.input]
            n.output[:] = [rename(x) for x in n.output]
            attributes = _resolved(n.attribute, node, schema)
            del n.attribute[:]
            n.attribute.extend(attributes)
            for a in n.attribute:
                for sub in ([a.g] if a.type == a.GRAPH else list(a.graphs)):
                    walk(sub)
    walk(out)
    return out


def _body_subgraph(gp, owner: str) -> Subgraph:
    """A subgraph of a body (renamed, its references resolved) as Kiln keeps one: a function
    body is onnx's own, in order and checked, so it is read as it is, Constants as constants."""
    from onnx import numpy_helper
    constants = {init.name: as_kiln_array(numpy_helper.to_array(init)) for init in gp.initializer}
    nodes = []
    for i, n in enumerate(gp.node):
        name = f"{owner}/{n.op_type}_{i}"
        inner = Node(n.op_type, list(n.input), list(n.output), _attributes(n.attribute, name), name)
        if inner.op == CONSTANT:
            constants[inner.outputs[0]] = constant_value(inner)
            continue
        nodes.append(inner)
    return Subgraph(gp.name or owner, [vi.name for vi in gp.input], [o.name for o in gp.output], nodes, constants)


def _attributes(attributes, owner: str) -> dict:
    return {a.name: _body_subgraph(a.g, f"{owner}.{a.name}") if a.type == a.GRAPH else attr_value(a)
            for a in attributes}


def _body_attributes(body_node, node: Node, schema, rename, owner: str) -> dict:
    """A body node's attributes as Kiln keeps them, references resolved and subgraphs renamed."""
    attributes = _resolved(body_node.attribute, node, schema)
    return {a.name: _body_subgraph(_renamed_subgraph(a.g, rename, node, schema), f"{owner}.{a.name}")
            if a.type == a.GRAPH else attr_value(a) for a in attributes}


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
        name = f"{node.name}/{n.op_type}_{i}"
        inner = Node(n.op_type, [rename(x) for x in n.input], [rename(x) for x in n.output],
                     _body_attributes(n, node, schema, rename, name), name)
        if inner.op == CONSTANT:
            g.add_constant(inner.outputs[0], constant_value(inner))
            continue
        nodes.append(inner)
    return nodes


# (onnxruntime's com.microsoft ops of these names, ir/ops/bert_fusions.py and rotary.py, are named after these)
ATTENTION, ROTARY_EMBEDDING = "Attention", "RotaryEmbedding"
register(*(OpDef(name, OPAQUE, expanded_only, expand=expand_function) for name in (
    ATTENTION, ROTARY_EMBEDDING, "SwiGLU", "CausalConvWithState", "CenterCropPad", "NegativeLogLikelihoodLoss",
    "SoftmaxCrossEntropyLoss", "BlackmanWindow", "HammingWindow", "HannWindow", "AffineGrid", "LinearAttention")))
