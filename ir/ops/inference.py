"""Type inference over a graph: each node's output types and canonical parameters, in
topological order, folding on constants what may be folded (`resolve`). The passes
infer_types and fold_constants (ir/passes/infer_types.py) run it over the model; Loop runs
it over its body (ir/ops/control_flow.py), which is why it lives beside the op registry.
"""
from __future__ import annotations

import collections

import numpy as np

from ..attrs import NotConstant
from ..dtypes import DTYPES, is_float, numpy_dtype
from ..float_sizes import as_float_size, combine, is_float_size, to_size
from ..graph import Graph, KilnError, Node, ShapeError, UnsupportedError, as_kiln_array
from ..symbolic import (Dim, SymbolError, at_most, collecting_checks, deriving_symbols, greatest, late_symbols_in,
                        least)
from ..validate import check_tensor_size
from ..value_symbols import bind_fed_values, define, drop_dangling, forget_counts
from .compile_time import SYMBOLIC_VALUE, symbolic_value_node, symbolic_values_of
from .elementwise import ADD, CAST, CEIL, COMPARISONS, DIV, FLOOR, MAX, MIN, MUL, NEG, RECIPROCAL, SUB
from .reduce import REDUCE_MAX, REDUCE_MIN
from .registry import op_def
from .sequences import sequence_passed_on
from .shape import GATHER
from .size_elements import gathered_size
from .value_ranges import producing_nodes

# Do not materialize folded tensors larger than this (e.g. an Expand of a constant).
MAX_FOLDED_ELEMENTS = 1 << 24
MAX_SYMBOLIC_ELEMENTS = 64  # sizes computed on the symbols: shape vectors, not data


def infer(g: Graph, node: Node) -> tuple[list, dict]:
    """(output types, canonical parameters) of one node, from its op's definition."""
    definition = op_def(node.op)
    if definition is None:
        raise UnsupportedError(f"{node.describe()}: op {node.op} is not supported")
    params: dict = {}
    out = definition.infer(g, node, params)
    return (out if isinstance(out, list) else [out]), params


def fold(g: Graph, node: Node, values: list) -> list | None:
    """The node's outputs evaluated on constant inputs, or None where its op does not fold."""
    evaluate = op_def(node.op).evaluate
    if evaluate is None:
        return None
    with np.errstate(all="ignore"):  # IEEE results (log(0) = -inf, 0/0 = NaN) are the folded values
        out = evaluate({**node.attrs, **g.params.get(node.key, {})}, values, g, node)
    # numpy may promote (an int8 mean, a float16 times a Python float): the inferred type rules.
    return [as_kiln_array(np.asarray(v).astype(numpy_dtype(g.types[name].dtype), copy=False)) if name else None
            for name, v in zip(node.outputs, out)]


def _fold_producers(g: Graph, tensors: list, producer: dict, folded: set) -> bool:
    """Make `tensors` constants by folding the kept nodes that compute them, back to the graph's
    constants: what an op needs at compile time and is computed only from weights and static
    shapes (an LSTM's W as torch's exporter slices and concatenates it, a Range over a Cast
    of a Shape). Its outputs become weights, data like initializers. False where a tensor
    depends on a graph input or on an op that does not fold."""
    needed, seen, stack = [], set(), list(tensors)
    while stack:  # (explicit stack: a chain thousands of nodes long is fine)
        name = stack.pop()
        if name in g.constants or name in seen:
            continue
        node = producer.get(name)
        if node is None or op_def(node.op).evaluate is None:
            return False
        seen.update(o for o in node.outputs if o)
        needed.append(node)
        stack += [i for i in node.inputs if i]
    left = [n for n in needed if id(n) not in folded]
    while left:  # each round folds every node whose inputs are constants by now
        ready = [n for n in left if all(not i or i in g.constants for i in n.inputs)]
        if not ready or not all(_fold_into_constants(g, n, folded) for n in ready):
            return False
        left = [n for n in left if id(n) not in folded]
    return True


def _with_constants(g: Graph, step, producer: dict, folded: set, kept: list):
    """step(), again each time it asks for a tensor as a constant that can be folded (each
    round folds another: an LSTM asks for W, then R, then B), or else read while the model runs
    as sizes within bounds (`_read_at_run_time`)."""
    while True:
        try:
            return step()
        except NotConstant as e:  # (none named: a subgraph's own tensor, which folding here cannot give)
            if not e.tensors:
                raise
            if not _fold_producers(g, e.tensors, producer, folded):
                unread = _read_at_run_time(g, e.tensors, producer, kept)
                if unread is not None:
                    raise NotConstant(f"{e}{unread}", e.tensors) from None


def _read_at_run_time(g: Graph, tensors: list, producer: dict, kept: list) -> str | None:
    """Make `tensors`, computed from the model's data, sizes the module reads once they are
    computed (a kiln.ReadSizes node after each: ir/ops/counted_sizes.py). None where it did,
    else why it could not, for the error (the empty string: not a small integer tensor)."""
    from .value_ranges import unbounded_origin
    from .counted_sizes import read_sizes_node, readable
    nodes = []
    for name in tensors:
        outer = g.inputs_from_around and name in g.inputs  # (a loop body's: computed around it)
        if name in g.symbolic_values or name not in producer and not outer or not readable(g, name):
            return ""
        node = read_sizes_node(g, name, () if outer else producer[name].guard)
        if node is None:
            return f"; Kiln reads a size computed from data while the model runs where it can bound its values, " \
                   f"and {unbounded_origin(g, name)}"
        nodes.append(node)
    for node in nodes:
        types, g.params[node.key] = infer(g, node)
        g.types.update(zip(node.outputs, types))
        kept.append(node)
        producer.update((o, node) for o in node.outputs)
    return None


def _fold_into_constants(g: Graph, node: Node, folded: set) -> bool:
    if sum(g.types[o].size for o in node.outputs if o) > MAX_FOLDED_ELEMENTS:
        return False
    outs = fold(g, node, [g.constants.get(i) if i else None for i in node.inputs])
    if outs is None:
        return False
    for name, value in zip(node.outputs, outs):
        if name:
            g.add_constant(name, value)
    folded.add(id(node))
    return True


def _symbolic_unsupported(g: Graph, node: Node, why) -> UnsupportedError:
    shapes = ", ".join(f"{i}: {g.types[i]}" if i not in g.symbolic_values else f"{i} = {g.symbolic_values[i].tolist()}"
                       for i in node.inputs if i and (not g.types[i].is_static or i in g.symbolic_values))
    late = sorted({s for i in node.inputs if i for d in g.types[i].shape for s in late_symbols_in(d)})
    fix = (f"{', '.join(late)} depend{'s' * (len(late) == 1)} on what a kernel counts while the model runs "
           "(NonZero's, Unique's, ...): no build option fixes them") if late else \
        "Fix those dims with --shape to build this model"
    return UnsupportedError(f"{node.describe()}: {node.op} with symbolic dimensions is not supported yet ({shapes}; "
                            f"{why}). {fix}")


def _has_dims(value) -> bool:
    return np.asarray(value).dtype == object and any(isinstance(v, Dim) for v in np.asarray(value).reshape(-1))


def _fold_symbolic(g: Graph, node: Node, definition, types: list) -> list | None:
    """The node's outputs computed on sizes: where it reads a symbolic value (and constants)
    or takes the Shape or Size of a symbolic tensor. Arrays of ints and Dims; None where the
    op cannot compute on them (then it runs at run time, on the values' tensors)."""
    ins = [i for i in node.inputs if i]
    of_shape = definition.shape_only and any(not g.types[i].is_static for i in ins)
    reads = any(i in g.symbolic_values for i in ins) and all(i in g.constants or i in g.symbolic_values for i in ins)
    if definition.evaluate is None or not (of_shape or reads):
        return None
    values = [g.symbolic_values.get(i, g.constants.get(i)) if i else None for i in node.inputs]
    if node.op in COMPARISONS and reads and all(t.is_static and t.size <= MAX_SYMBOLIC_ELEMENTS for t in types):
        decided = np.vectorize(lambda a, b: _decide(node.op, a, b), otypes=[object])(*values)
        return None if any(v is None for v in decided.reshape(-1)) else [decided.astype(bool)]
    if not all(t.is_static and t.size <= MAX_SYMBOLIC_ELEMENTS and t.dtype != "bool" for t in types):
        return None  # (whether a size equals 0 is a run-time question: comparisons run then)
    # (float steps: an image's resize computed in float32, where the ops cannot give sizes)
    in_floats = node.op in _FLOAT_STEPS and (is_float(types[0].dtype) or any(_has_float_sizes(v) for v in values))
    if in_floats and any(_has_float_sizes(v) for v in values):
        return _float_steps(node, values, types[0].dtype)
    if node.op in (MIN, MAX) and reads:  # (min(1000, n): a value symbol where the bounds do not decide it)
        return [_extremes(node, values)]
    if node.op in (REDUCE_MIN, REDUCE_MAX) and reads:  # (torchvision's min(k, n): a ReduceMin of a Concat)
        return [_reduced_extremes(node, values[0], g.params[node.key])]
    try:
        with np.errstate(all="ignore"):
            out = definition.evaluate({**node.attrs, **g.params.get(node.key, {})}, values, g, node)
    except (TypeError, SymbolError, ValueError, ArithmeticError, AttributeError):
        return _float_steps(node, values, types[0].dtype) if in_floats else None
    return [np.asarray(v, dtype=object if _has_dims(v) else None) for v in out]


_FLOAT_BINARY = {ADD: "fadd", SUB: "fsub", MUL: "fmul", DIV: "fdiv", MIN: "fmin", MAX: "fmax"}
_FLOAT_UNARY = {FLOOR: "floor", CEIL: "ceil", NEG: "fneg"}
_FLOAT_STEPS = {CAST, RECIPROCAL, *_FLOAT_BINARY, *_FLOAT_UNARY}


def _float_steps(node: Node, values: list, dtype: str) -> list | None:
    """A float32 op on sizes (Casts to and from float32 included), element by element, as
    FloatSizes (ir/float_sizes.py); a Cast of one to an integer is a value symbol. None
    where it is no such op, or the values' range has no bound (then it runs at run time)."""
    def each(fn, *arrays):
        out = np.vectorize(fn, otypes=[object])(*(np.asarray(a, dtype=object) for a in arrays))
        return None if any(v is None for v in out.reshape(-1)) else [out]

    if node.op == CAST:
        if dtype == "float32":
            return each(as_float_size, values[0])
        if dtype in ("int64", "int32") and _has_float_sizes(values[0]):
            what = f"{node.describe()}: a size computed in float32"
            flat = np.asarray(values[0], dtype=object).reshape(-1)
            sizes = [to_size(v, f"{node.outputs[0]}[{j}]", what) if is_float_size(v) else int(v)
                     for j, v in enumerate(flat)]
            return None if any(v is None for v in sizes) else \
                [np.array(sizes, dtype=object).reshape(np.shape(values[0]))]
        return None
    if dtype != "float32":
        return None
    if node.op == RECIPROCAL:
        return each(lambda a: combine("fdiv", 1.0, a), values[0])
    if node.op in _FLOAT_UNARY:
        return each(lambda a: combine(_FLOAT_UNARY[node.op], a), values[0])
    if node.op in _FLOAT_BINARY and len(node.inputs) == 2:
        return each(lambda a, b: combine(_FLOAT_BINARY[node.op], a, b), values[0], values[1])
    return None


def _exact_size_step(node: Node, types: list) -> bool:
    """A float32 op on a few constants that numpy computes exactly as the kernels (rounded
    once, IEEE): folded even where floats are not, since a size may be computed from it
    (torchvision pads a batch to ceil(max(h) / 32) * 32, max(h) a float)."""
    return node.op in _FLOAT_STEPS | {REDUCE_MIN, REDUCE_MAX} and \
        all(t.is_static and t.size <= MAX_SYMBOLIC_ELEMENTS for t in types)


def _has_float_sizes(value) -> bool:
    return value is not None and np.asarray(value).dtype == object and \
        any(is_float_size(v) for v in np.asarray(value).reshape(-1))


def _extremes(node: Node, values: list) -> np.ndarray:
    """Min or Max of sizes, element by element."""
    flat = [np.asarray(v, dtype=object) for v in values if v is not None]
    shape = np.broadcast_shapes(*(v.shape for v in flat))
    out = np.empty(shape, dtype=object)
    for j, parts in enumerate(zip(*(np.broadcast_to(v, shape).reshape(-1) for v in flat))):
        out.reshape(-1)[j] = _extreme(node, parts, node.op == MIN, j)
    return out


def _reduced_extremes(node: Node, value, params: dict) -> np.ndarray:
    """ReduceMin or ReduceMax of sizes over params' axes."""
    value = np.asarray(value, dtype=object)
    axes, rank = params["axes"], value.ndim
    kept = [i for i in range(rank) if i not in axes]
    rows = value.transpose(kept + axes).reshape(-1, int(np.prod([value.shape[i] for i in axes], dtype=np.int64)))
    out = np.array([_extreme(node, row, node.op == REDUCE_MIN, j) for j, row in enumerate(rows)], dtype=object)
    shape = [1 if i in axes else n for i, n in enumerate(value.shape)] if params["keepdims"] else \
        [value.shape[i] for i in kept]
    return out.reshape(shape)


def _extreme(node: Node, parts, smallest: bool, j: int):
    """The least (greatest) of sizes: the one the bounds show is, else a value symbol the
    module computes, `out[j]`."""
    best = parts[0]
    for other in parts[1:]:
        if is_float_size(best) or is_float_size(other):
            best = combine("fmin" if smallest else "fmax", best, other)
            if best is None:
                raise TypeError(f"{node.describe()}: a float size without bounds")
            continue
        keep = _relation("le" if smallest else "ge", best, other)
        if keep is None:
            lo = (min if smallest else max)(least(best), least(other))
            hi = (min if smallest else max)(greatest(best), greatest(other))
            best = define(f"{node.outputs[0]}[{j}]", ("min" if smallest else "max", best, other), lo, hi,
                          f"element {j} of {node.describe()}")
        elif not keep:
            best = other
    return best


# Relations of two sizes, by what a - b is: True, False, or None where only the run time knows.
_RELATIONS = {
    "eq": lambda d: False if at_most(1, d) or at_most(d, -1) else None,
    "lt": lambda d: True if at_most(d, -1) else False if at_most(0, d) else None,
    "le": lambda d: True if at_most(d, 0) else False if at_most(1, d) else None,
    "gt": lambda d: True if at_most(1, d) else False if at_most(d, 0) else None,
    "ge": lambda d: True if at_most(0, d) else False if at_most(d, -1) else None,
}
_EXACT = {"eq": lambda d: d == 0, "lt": lambda d: d < 0, "le": lambda d: d <= 0, "gt": lambda d: d > 0,
          "ge": lambda d: d >= 0}


def _decide(op: str, a, b):
    """Comparison op of two sizes (ints or Dims) where their bounds decide it (a size compared
    with -1, as exporters test an Expand's shape): a bool, else None."""
    return _relation(COMPARISONS[op], a, b)


def _relation(relation: str, a, b):
    """Whether sizes a and b stand in `relation` ("le", ...) at every value of the symbols:
    a bool, else None."""
    d = (a if isinstance(a, Dim) else int(a)) - (b if isinstance(b, Dim) else int(b))
    return _RELATIONS[relation](d) if isinstance(d, Dim) else _EXACT[relation](d)


def _record_symbolic(g: Graph, node: Node, values: list) -> list[Node]:
    """Outputs that are sizes become symbolic values (each with a kiln.SymbolicValue node
    writing it, for whatever reads it at run time), the rest constants."""
    nodes = []
    for name, value in zip(node.outputs, values):
        if not name:
            continue
        if _has_float_sizes(value):  # (the node still computes the values, for what reads them as data)
            g.symbolic_values[name] = value
            nodes.append(node)
        elif _has_dims(value):
            g.symbolic_values[name] = value
            nodes.append(symbolic_value_node(name, value, g.types[name].dtype))
        else:
            g.add_constant(name, as_kiln_array(value.astype(numpy_dtype(g.types[name].dtype))))
    return nodes


def resolve(g: Graph, fold_floats: bool) -> Graph:
    """Types and canonical parameters of every node (anew: passes before may have rewritten
    nodes), folding what it may, and on demand what a node needs at compile time; the
    equalities of symbolic sizes the ops require go to `g.checks`."""
    g.checks = list(g.expansion_checks)
    producer = {}  # (tensor -> the kept node computing it, so far: also what value_range walks)
    with collecting_checks(g.checks), deriving_symbols(g.symbols, g.derived), producing_nodes(g, producer):
        return _resolve(g, fold_floats, producer)


def _in_a_branch(guard: tuple) -> str:
    """Why a node of a branch taken at run time is being sized at all (a shape error there)."""
    cond, value = guard[-1]
    return (f" (the node is in the branch of an If taken when '{cond}' is {str(bool(value)).lower()}, decided only "
            "at run time: Kiln compiles both branches, and this one cannot run with these input sizes)")


def _resolve(g: Graph, fold_floats: bool, producer: dict) -> Graph:
    g.params, g.symbolic_values = {}, dict(g.given_values)
    forget_counts(g)  # (defined again by the nodes that count them: those a pass removed are gone)
    bind_fed_values(g)  # (integer inputs whose values the user bounded: sizes read at run time)
    kept, folded = [], set()
    pending = collections.deque(g.nodes)
    while pending:
        node = pending.popleft()
        definition = op_def(node.op)
        required = len(g.checks)
        try:
            body = None if definition is None or definition.expand is None else \
                _with_constants(g, lambda: definition.expand(g, node), producer, folded, kept)
        except ShapeError as e:
            if not node.guard:
                raise
            raise ShapeError(f"{e}{_in_a_branch(node.guard)}") from None
        if body is None and node.op == GATHER:  # (an element of a Range over sizes: a size)
            body = gathered_size(g, node)
        if body is not None:  # its body takes its place (None: this node is as it is)
            g.expansion_checks += g.checks[required:]
            for n in body:  # (a node in a branch decided at run time: so is what it expands to)
                n.guard = n.guard or node.guard
            pending.extendleft(reversed(body))
            continue
        if g.sequences and any(i in g.sequences for i in node.inputs):  # (an op with no expansion for one)
            sequence_passed_on(g, node)
            continue
        try:
            types, g.params[node.key] = _with_constants(g, lambda: infer(g, node), producer, folded, kept)
        except KilnError as e:
            msg = str(e)
            msg = msg if node.describe() in msg else f"{node.describe()}: {msg}"
            if node.guard and isinstance(e, ShapeError):
                msg += _in_a_branch(node.guard)
            raise type(e)(msg) from None
        except (TypeError, SymbolError) as e:  # (code comparing a run-time dim with a number)
            if all(g.types[i].is_static and i not in g.symbolic_values for i in node.inputs if i):
                raise
            raise _symbolic_unsupported(g, node, e) from None
        for name, t in zip(node.outputs, types):
            if name:
                check_tensor_size(name, [greatest(d) for d in t.shape], DTYPES[t.dtype].itemsize)
                g.types[name] = t
        definition = op_def(node.op)
        if node.op == SYMBOLIC_VALUE:
            g.symbolic_values[node.outputs[0]] = symbolic_values_of(g, node)
        elif (sizes := _fold_symbolic(g, node, definition, types)) is not None:
            for n in _record_symbolic(g, node, sizes):
                kept.append(n)
                producer[n.outputs[0]] = n
            continue
        elif definition.shape_only and any(not g.types[i].is_static for i in node.inputs if i):
            raise _symbolic_unsupported(g, node, "its sizes are not known at compile time")
        if definition.compile_time:  # (an op evaluated at compile time only: fold what feeds it)
            _fold_producers(g, [i for i in node.inputs if i], producer, folded)
        inputs_const = all(i in g.constants for i in node.inputs if i) or definition.shape_only
        wanted = definition.compile_time or (inputs_const and (
            fold_floats or not any(is_float(t.dtype) for t in types) or _exact_size_step(node, types)))
        if wanted and inputs_const and sum(greatest(t.size) for t in types) <= MAX_FOLDED_ELEMENTS:
            outs = fold(g, node, [g.constants.get(i) if i else None for i in node.inputs])
            if outs is not None:
                for name, value in zip(node.outputs, outs):
                    if name:
                        g.add_constant(name, value)
                continue
        if definition.compile_time and not g.params[node.key].get("at_run_time"):
            if any(i in g.symbolic_values for i in node.inputs):
                raise _symbolic_unsupported(g, node, "it would need its inputs' values at compile time")
            raise KilnError(f"{node.describe()}: its inputs must be known at compile time")
        kept.append(node)
        producer.update((o, node) for o in node.outputs if o)
    g.nodes = [n for n in kept if id(n) not in folded]
    drop_dangling(g)
    return g
