"""A model's graph checked against ONNX's own op schemas before anything else runs, and the
resource budget every tensor must fit.

A malformed model (from a buggy exporter, a truncated download or a fuzzer) must end in an
error naming the node or tensor at fault, not in a traceback, an allocation of terabytes,
or a module that silently ignores what it was given (an extra input, a misspelled
attribute).
"""
from __future__ import annotations

import os

from .graph import KilnError, ShapeError

# Defaults generous for real models; override with these environment variables.
MAX_TENSOR_BYTES = int(os.environ.get("KILN_MAX_TENSOR_BYTES", 16 << 30))
MAX_ARENA_BYTES = int(os.environ.get("KILN_MAX_ARENA_BYTES", 64 << 30))
MAX_CONSTANTS_BYTES = int(os.environ.get("KILN_MAX_CONSTANTS_BYTES", 64 << 30))


def check_tensor_size(name: str, shape, itemsize: int, what: str = "tensor") -> None:
    """Before anything of this shape is allocated or planned."""
    n = 1
    for d in shape:
        n *= int(d)
    if n * itemsize > MAX_TENSOR_BYTES:
        raise ShapeError(f"{what} '{name}' of shape {list(shape)} would take {n * itemsize / 2**30:.1f} GiB, more "
                         f"than the {MAX_TENSOR_BYTES / 2**30:.0f} GiB a tensor may (KILN_MAX_TENSOR_BYTES)")


def check_constants_size(initializers) -> None:
    """All weights together, from their declared dims, before any is decoded."""
    total = 0
    for init in initializers:
        n = 1
        for d in init.dims:
            n *= max(int(d), 0)
        total += n
    if total > MAX_CONSTANTS_BYTES:  # counted as bytes of the smallest element type: a lower bound
        raise ShapeError(f"the model's initializers declare {total:,} elements, more than the "
                         f"{MAX_CONSTANTS_BYTES / 2**30:.0f} GiB constants may take (KILN_MAX_CONSTANTS_BYTES)")


def check_node(node_proto, opset: int, describe: str) -> None:
    """Input and output counts and attribute names and types, as the op's schema at this
    opset defines them."""
    import onnx.defs
    try:
        schema = onnx.defs.get_schema(node_proto.op_type, opset, node_proto.domain or "")
    except onnx.defs.SchemaError:
        return  # an op onnx does not know at this opset: the frontend names it as unsupported
    n_in = len(node_proto.input)
    while n_in and not node_proto.input[n_in - 1]:  # trailing "" are omitted optional inputs
        n_in -= 1
    if not schema.min_input <= n_in <= schema.max_input:
        raise KilnError(f"{describe}: {node_proto.op_type} takes {_range(schema.min_input, schema.max_input)} "
                        f"inputs, the node has {n_in}")
    n_out = len(node_proto.output)
    if not schema.min_output <= n_out <= schema.max_output:
        raise KilnError(f"{describe}: {node_proto.op_type} has {_range(schema.min_output, schema.max_output)} "
                        f"outputs, the node has {n_out}")
    optional_first = schema.outputs and schema.outputs[0].option == schema.outputs[0].option.Optional
    if not any(node_proto.output) or not (node_proto.output[0] or optional_first):
        raise KilnError(f"{describe}: its first output has no name")
    for attr in node_proto.attribute:
        spec = schema.attributes.get(attr.name)
        if spec is None:
            raise KilnError(f"{describe}: {node_proto.op_type} has no attribute '{attr.name}' (opset {opset})")
        if attr.type != spec.type:
            raise KilnError(f"{describe}: attribute '{attr.name}' has type {_type_name(attr.type)}, "
                            f"{node_proto.op_type} expects {_type_name(spec.type)}")


def check_names_defined_once(gp, where: str) -> None:
    """Every name of a graph (a GraphProto: the main graph or a subgraph) is defined once, as
    single assignment requires: a graph input, an initializer (which may share its name with
    the input it gives a default to) or a node's output, Constant nodes included."""
    seen: dict = {}

    def define(name: str, what: str) -> None:
        if name in seen:
            raise KilnError(f"{where}: '{name}' is defined twice, as {seen[name]} and as {what} "
                            "(every name is assigned once)")
        seen[name] = what
    initializers = {init.name for init in gp.initializer}
    for vi in gp.input:
        if vi.name not in initializers:
            define(vi.name, "a graph input")
    for init in gp.initializer:
        define(init.name, "an initializer")
    for node in gp.node:
        for o in node.output:
            if o:
                define(o, f"the output of node '{node.name}' ({node.op_type})")


def _range(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"{lo} to {hi}" if hi < 2**31 - 1 else f"at least {lo}"


def _type_name(t: int) -> str:
    from onnx import AttributeProto
    return AttributeProto.AttributeType.Name(t)
