"""ONNX -> ir.Graph. The only module that knows protobuf.

Input shapes come from the model where they are concrete, or from the user's `shapes`
where the model's are symbolic, zero or wrong. A symbolic dim (the model's dim_param, or a
name the user writes in `shapes`) stays symbolic where the user bounds it in `dims`
(ir/symbolic.py). Output shapes declared in the model are ignored: inference computes them.
"""
from __future__ import annotations

import io
import math
import os
import sys

import numpy as np

from . import external_data, onnx_file
from .graph import Graph, KilnError, Node, Subgraph, TensorType, UnsupportedError, as_kiln_array, captured
from .onnx_attrs import attr_value, constant_value
from .onnx_dtypes import onnx_to_dtype
from .symbolic import Dim, greatest, symbols_of
from .validate import check_constants_size, check_names_defined_once, check_node, check_tensor_size
from .value_symbols import value_bounds
from .ops import op_def
from .ops.registry import expanded_only
from .ops.compile_time import CONSTANT

MIN_OPSET, FULL_OPSET = 11, 21


def _max_opset() -> int:
    import onnx.defs
    return onnx.defs.onnx_opset_version()


def _check_node_opset(node: Node, opset: int) -> None:
    """Outside opsets 11-21, a node is accepted where its op means what it means there:
    below 11 the op must be unchanged up to opset 11; past 21 its interface must be
    unchanged since 21 (opsets 22-28 mostly widened type lists)."""
    import onnx.defs
    if opset < MIN_OPSET:
        then, now = onnx.defs.get_schema(node.op, opset), onnx.defs.get_schema(node.op, MIN_OPSET)
        if then.since_version != now.since_version:
            raise UnsupportedError(f"{node.describe()}: op {node.op} at opset {opset} is version "
                                   f"{then.since_version}, older than Kiln supports (version {now.since_version}, "
                                   f"opset {MIN_OPSET}+)")
        return
    new = onnx.defs.get_schema(node.op, opset)
    if new.since_version <= FULL_OPSET:
        return
    try:
        old = onnx.defs.get_schema(node.op, FULL_OPSET)
    except onnx.defs.SchemaError:  # an op younger than opset 21: Kiln implements its first version
        try:
            old = onnx.defs.get_schema(node.op, new.since_version - 1)
        except onnx.defs.SchemaError:
            return  # this is its first version
    implemented = op_def(node.op).later_attributes if op_def(node.op) else frozenset()
    added = sorted(set(node.attrs) & (set(new.attributes) - set(old.attributes)) - implemented)
    if added or [i.name for i in new.inputs] != [i.name for i in old.inputs]:
        what = f"attribute(s) {', '.join(added)}" if added else "its changed inputs"
        raise UnsupportedError(f"{node.describe()}: op {node.op} at opset {opset} uses {what}, "
                               f"which Kiln does not support (it implements {node.op} as of opset {FULL_OPSET})")


def load_model(model):
    """(ModelProto, {main-graph initializer name: its raw bytes}): from a path or bytes, the
    large initializers' bytes are read into arrays of their own and left out of the message
    (ir/onnx_file.py), so that a model's weights are held once."""
    import onnx
    from google.protobuf.message import DecodeError

    if isinstance(model, onnx.ModelProto):
        _load_external_data(model, None, "the model", {})
        return model, {}
    model_dir = None
    if isinstance(model, (bytes, bytearray)):
        where = "model bytes"
        data, payloads = onnx_file.split_weights(io.BytesIO(model), len(model), where)
    else:
        path = os.fspath(model)
        if not os.path.exists(path):
            raise KilnError(f"model file '{path}' does not exist")
        where = f"model file '{path}'"
        model_dir = os.path.dirname(os.path.abspath(path))
        with open(path, "rb") as f:
            data, payloads = onnx_file.split_weights(f, os.fstat(f.fileno()).st_size, where)
    try:
        proto = onnx.ModelProto.FromString(data)
    except (DecodeError, ValueError, RuntimeError) as e:
        raise KilnError(f"{where} is not a valid ONNX model (truncated or corrupt?): {e}") from None
    if not proto.graph.node and not proto.graph.output:
        raise KilnError(f"{where} is not a valid ONNX model: it has no graph")
    _load_external_data(proto, model_dir, where, payloads)
    return proto, payloads


def _load_external_data(proto, model_dir: str | None, where: str, payloads: dict) -> None:
    """Read every external tensor's bytes from the model's folder (never the current one):
    the main graph's initializers into `payloads`, any other tensor into its message."""
    from onnx.external_data_helper import _get_all_tensors, load_external_data_for_tensor, uses_external_data

    if model_dir is not None:
        for init in proto.graph.initializer:
            if uses_external_data(init) and init.name not in payloads:
                payloads[init.name] = onnx_file.read_external(init, model_dir, where)
                del init.external_data[:]
                init.data_location = init.DEFAULT
    for tensor in _get_all_tensors(proto):
        if not uses_external_data(tensor):
            continue
        location = next((e.value for e in tensor.external_data if e.key == "location"), "")
        if model_dir is None:
            raise KilnError(f"{where}: tensor '{tensor.name}' keeps its data in external file '{location}'; "
                            "give Kiln the model's path so the file is found beside it")
        external_data.resolve(model_dir, tensor.name, location)
        try:
            load_external_data_for_tensor(tensor, model_dir)
        except (OSError, ValueError) as e:
            raise KilnError(f"{where}: cannot read tensor '{tensor.name}' from external file '{location}': {e}") \
                from None


def _opset(proto) -> int:
    version = None
    for imp in proto.opset_import:
        if imp.domain in ("", "ai.onnx"):
            version = imp.version
    if version is None:
        raise UnsupportedError("the model imports no ai.onnx opset")
    if not 1 <= version <= _max_opset():
        raise UnsupportedError(f"opset {version} is not supported (Kiln supports opsets {MIN_OPSET}-{FULL_OPSET}, "
                               f"and {FULL_OPSET + 1}-{_max_opset()} where an op is unchanged since {FULL_OPSET})")
    return version


def _declared_shape(value_info) -> list | None:
    """Each dim: its value, its symbol's name (dim_param), or None (unknown or not positive)."""
    t = value_info.type.tensor_type
    if not t.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else
            d.dim_param if d.HasField("dim_param") and d.dim_param.isidentifier() else None for d in t.shape.dim]


def _input_shapes(real_inputs, shapes: dict, dims: dict) -> dict:
    """Each input's shape: ints, and Dims where a symbol is bounded in `dims`."""
    unknown = set(shapes) - {vi.name for vi in real_inputs}
    if unknown:
        raise KilnError(f"--shape names {', '.join(sorted(unknown))}, which is not a model input "
                        f"(inputs: {', '.join(vi.name for vi in real_inputs)})")
    for name, (least, greatest_) in dims.items():
        if not 0 <= least <= greatest_:
            raise KilnError(f"--dim {name}={least}..{greatest_}: bounds must satisfy 0 <= least <= greatest")
    symbols = {name: Dim.symbol(name, *bounds) for name, bounds in dims.items()}
    out, unbounded = {}, {}
    for vi in real_inputs:
        declared = _declared_shape(vi)
        if vi.name in shapes:
            shape = shapes[vi.name]
            if declared is not None and len(declared) != len(shape):
                raise KilnError(f"--shape {vi.name}={'x'.join(map(str, shape))} has rank {len(shape)}, "
                                f"but the model declares rank {len(declared)}")
            if min((d for d in shape if isinstance(d, int)), default=1) <= 0:
                raise KilnError(f"--shape {vi.name}: every dimension must be positive, got {tuple(shape)} "
                                "(a size that may be 0 is a symbol bounded with --dim, e.g. past=0..1024)")
        elif declared is None or None in declared:
            raise KilnError(f"input '{vi.name}' has an unknown shape {declared}; give it with --shape {vi.name}=DIMS "
                            "(for example 1x3x224x224)")
        else:
            shape = declared
        for d in shape:
            if isinstance(d, str) and d not in symbols:
                unbounded.setdefault(d, []).append(vi.name)
        out[vi.name] = tuple(symbols.get(d, d) if isinstance(d, str) else int(d) for d in shape)
    if unbounded:
        named = "; ".join(f"'{s}' (in {', '.join(ins)})" for s, ins in sorted(unbounded.items()))
        example = next(iter(sorted(unbounded)))
        first_input = unbounded[example][0]
        raise KilnError(f"symbolic dims without bounds: {named}. Bound each with --dim NAME=LEAST..GREATEST "
                        f"(dims={{'{example}': (1, 512)}} in Python), or fix the dims with --shape "
                        f"{first_input}=DIMS (for example --shape {first_input}=1x...)")
    used = {s for shape in out.values() for s in symbols_of(shape)}
    inputs = {vi.name for vi in real_inputs}  # (`x` or `x[k]`: bounds of input x's values, ir/value_symbols.py)
    unused = {s for s in symbols if s not in used and s.partition("[")[0] not in inputs}
    if unused:
        raise KilnError(f"--dim names {', '.join(sorted(unused))}, which no input's shape has "
                        f"(symbols: {', '.join(sorted(used)) or 'none'})")
    return out


def _topological(nodes: list[Node], available: set[str]) -> list[Node]:
    """Order nodes so every input is produced first; a cycle or a dangling input is an error."""
    produced_by = {o: n for n in nodes for o in n.outputs if o}
    # A node with subgraphs also depends on what they read from the graph around them.
    deps = {id(n): list(n.inputs) + sorted(captured(n)) for n in nodes}
    for n in nodes:
        for i in deps[id(n)]:
            if i and i not in available and i not in produced_by:
                raise KilnError(f"{n.describe()}: input '{i}' is produced by no node, initializer or graph input")
    order, state = [], {}  # state: 1 on the current path, 2 done
    for root in nodes:  # depth-first with an explicit stack: a graph thousands of nodes deep is fine
        if state.get(id(root)) == 2:
            continue
        path = [root]
        pending = [iter([produced_by[i] for i in deps[id(root)] if i in produced_by and i not in available])]
        state[id(root)] = 1
        while pending:
            nxt = next(pending[-1], None)
            if nxt is None:
                done = path.pop()
                pending.pop()
                state[id(done)] = 2
                order.append(done)
            elif state.get(id(nxt)) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                raise KilnError("the graph has a cycle: " + " -> ".join(m.name or m.outputs[0] for m in cycle))
            elif state.get(id(nxt)) != 2:
                state[id(nxt)] = 1
                path.append(nxt)
                pending.append(iter([produced_by[i] for i in deps[id(nxt)] if i in produced_by and i not in available]))
    return order


def from_onnx(model, shapes: dict | None = None, dims: dict | None = None) -> Graph:
    """Build a Graph from a path, bytes or ModelProto. `shapes` maps input name -> dims (ints,
    or symbol names); `dims` symbol -> (least, greatest)."""
    proto, payloads = load_model(model)
    opset = _opset(proto)
    gp = proto.graph
    g = Graph(inputs=[], outputs=[o.name for o in gp.output], nodes=[], opset=opset, name=gp.name or "model")
    check_names_defined_once(gp, "the graph")
    check_constants_size(gp.initializer)
    for init in gp.initializer:
        g.add_constant(init.name, _initializer(init, payloads.pop(init.name, None)))

    shapes = {k: tuple(d if isinstance(d, str) else int(d) for d in v) for k, v in (shapes or {}).items()}
    dims = {k: (int(lo), int(hi)) for k, (lo, hi) in (dims or {}).items()}
    real_inputs = [vi for vi in gp.input if vi.name not in g.constants]
    for vi in real_inputs:  # (before their shapes: a sequence has none to ask for)
        kind = vi.type.WhichOneof("value")
        if kind != "tensor_type":
            what = {"sequence_type": "a sequence", "optional_type": "an optional", "map_type": "a map",
                    "sparse_tensor_type": "a sparse tensor"}.get(kind, kind or "a value of no type")
            raise UnsupportedError(f"input '{vi.name}' is {what}, not a tensor (Kiln's inputs are tensors; a "
                                   "sequence works only inside the model, built from tensors)")
    input_shapes = _input_shapes(real_inputs, shapes, dims)
    g.symbols = {s: dims[s] for s in sorted({s for shape in input_shapes.values() for s in symbols_of(shape)})}
    for vi in real_inputs:
        dtype = onnx_to_dtype(vi.type.tensor_type.elem_type, f"input '{vi.name}'")
        shape = input_shapes[vi.name]
        check_tensor_size(vi.name, [greatest(d) for d in shape], 4, "input")
        g.inputs.append(vi.name)
        g.types[vi.name] = TensorType(tuple(shape), dtype)

    g.value_bounds = value_bounds(g, {k: v for k, v in dims.items() if k not in g.symbols})
    nodes = _nodes(gp.node, opset, g.add_constant)
    g.nodes = _topological(nodes, set(g.inputs) | set(g.constants))
    produced = {o for n in g.nodes for o in n.outputs} | set(g.inputs) | set(g.constants)
    for o in g.outputs:
        if o not in produced:
            raise KilnError(f"graph output '{o}' is produced by no node")
    return g


# ONNX element types whose raw bytes are numpy's (little-endian) as they are.
_RAW_AS_NUMPY = {1: np.float32, 2: np.uint8, 3: np.int8, 4: np.uint16, 5: np.int16, 6: np.int32, 7: np.int64,
                 9: np.bool_, 10: np.float16, 11: np.float64, 12: np.uint32, 13: np.uint64}


def _initializer(init, payload=None):
    """An initializer's value, checked: its size, its data against its dims, its dtype.
    payload: its raw bytes read apart from the message (load_model), used in place."""
    from onnx import numpy_helper
    check_tensor_size(init.name, init.dims, 1, "initializer")
    if payload is not None:
        dtype, shape = _RAW_AS_NUMPY.get(init.data_type), tuple(int(d) for d in init.dims)
        fits = payload.nbytes == np.dtype(dtype or np.uint8).itemsize * math.prod(shape)
        if dtype is not None and sys.byteorder == "little" and fits:
            return as_kiln_array(payload.view(dtype).reshape(shape))
        init.raw_data = payload.tobytes()  # the rarer types, or data that disagrees: onnx decodes or names the fault
    try:
        value = numpy_helper.to_array(init)
    except Exception as e:  # noqa: BLE001 - whatever onnx raises on inconsistent protobuf data
        raise KilnError(f"initializer '{init.name}': its dims {list(init.dims)}, data type and data disagree "
                        f"({type(e).__name__}: {e})") from None
    try:
        return as_kiln_array(value)
    except UnsupportedError as e:
        raise UnsupportedError(f"initializer '{init.name}': {e}") from None


def _subgraph(gp, opset: int, owner: str) -> Subgraph:
    """A graph attribute (a branch or a loop body), its nodes and constants as the main graph's."""
    constants: dict = {}
    check_names_defined_once(gp, f"subgraph '{gp.name or owner}'")
    check_constants_size(gp.initializer)
    for init in gp.initializer:
        constants[init.name] = _initializer(init)

    def add_constant(name, value):
        constants[name] = value
    nodes = _nodes(gp.node, opset, add_constant)
    inputs = [vi.name for vi in gp.input]
    produced = {o for n in nodes for o in n.outputs if o}
    outer = ({i for n in nodes for i in n.inputs if i} | set().union(*map(captured, nodes))) - produced
    nodes = _topological(nodes, set(inputs) | set(constants) | outer)  # (what it reads from outside is there)
    return Subgraph(gp.name or owner, inputs, [o.name for o in gp.output], nodes, constants)


def _nodes(protos, opset: int, add_constant) -> list[Node]:
    """Kiln's nodes of a graph's NodeProtos: each checked against its schema, Constant nodes
    handed to add_constant(name, value) instead."""
    nodes = []
    for i, np_ in enumerate(protos):
        node = Node(np_.op_type, list(np_.input), list(np_.output), {}, np_.name or f"{np_.op_type}_{i}")
        if np_.domain not in ("", "ai.onnx"):
            # Another domain's op is known by its qualified name (onnxruntime's com.microsoft.QLinearAdd).
            node.op = f"{np_.domain}.{np_.op_type}"
            if op_def(node.op) is None:
                raise UnsupportedError(f"{node.describe()}: op {np_.op_type} of domain '{np_.domain}' is not "
                                       "supported (Kiln knows ai.onnx and the com.microsoft ops docs/operators.md "
                                       "lists)")
        elif op_def(np_.op_type) is None:
            raise UnsupportedError(f"{node.describe()}: op {np_.op_type} (opset {opset}) is not supported by Kiln")
        check_node(np_, opset, node.describe())
        try:
            node.attrs = {a.name: _subgraph(a.g, opset, f"{node.name}.{a.name}") if a.type == a.GRAPH
                          else attr_value(a) for a in np_.attribute}
        except UnsupportedError as e:
            msg = str(e)
            raise UnsupportedError(msg if msg.startswith("node ") else f"{node.describe()}: {msg}") from None
        # (An op built from its function body is built from the body of its own opset.)
        if not MIN_OPSET <= opset <= FULL_OPSET and op_def(node.op).infer is not expanded_only:
            _check_node_opset(node, opset)
        if node.op == CONSTANT:
            add_constant(node.outputs[0], as_kiln_array(constant_value(node)))
            continue
        nodes.append(node)
    return nodes
