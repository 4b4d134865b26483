"""Recurrent nets: LSTM, GRU and RNN (forward, reverse, bidirectional; activations, clip,
sequence_lens, initial states, peepholes, layout, input_forget, linear_before_reset).

Type inference replaces each node by
  1. one MatMul for the input projection of every step and both directions at once,
     X[seq*batch, input] x W^T[input, dirs*gates*hidden], with the biases that add linearly
     folded in (its bias add fuses into the GEMM), and
  2. one `kiln.Recurrence` node: the time loop. Per step, the recurrent product (the
     previous hidden state times R^T) and the gates are one fused loop nest
     (ir/lower/recurrent.py), so the state never leaves the kernel between steps.
layout=1 (batch first) is a Transpose on the way in and out.
"""
from __future__ import annotations

import numpy as np

from ..attrs import check_attrs, const_input
from ..graph import Node, ShapeError, TensorType, UnsupportedError
from ..loop import Const, call, fbin
from ..lower.recurrent import lower_recurrence
from .conv_gemm import MATMUL
from .elementwise import ADD, SIGMOID, TANH, UNARY, unary_expression
from .node_builder import NodeBuilder
from .registry import OPAQUE, OpDef, expanded_only, register
from .shape import TRANSPOSE

RECURRENCE = "kiln.Recurrence"
LSTM, GRU, RNN = "LSTM", "GRU", "RNN"
CELLS = {  # kind: what the recurrence kernel calls the cell; default activations per direction
    LSTM: {"kind": "lstm", "gates": 4, "default": (SIGMOID, TANH, TANH), "outputs": 3},
    GRU: {"kind": "gru", "gates": 3, "default": (SIGMOID, TANH), "outputs": 2},
    RNN: {"kind": "rnn", "gates": 1, "default": (TANH,), "outputs": 2},
}

# Activations the recurrent ops name that are no ONNX ops (any more): (expression, attributes).
_FORMER_OPS = {
    "Affine": (lambda x, a: fbin("add", fbin("mul", x, Const(a.get("alpha", 1.0), "f32")),
                                 Const(a.get("beta", 0.0), "f32")), ("alpha", "beta")),
    "ScaledTanh": (lambda x, a: fbin("mul", Const(a.get("alpha", 1.0), "f32"),
                                     call("tanh", fbin("mul", x, Const(a.get("beta", 1.0), "f32")))), ("alpha", "beta")),
}


def _activation_params(name: str) -> tuple | None:
    """The attributes an activation takes, or None if Kiln does not know it."""
    if name in _FORMER_OPS:
        return _FORMER_OPS[name][1]
    return UNARY[name][1] if name in UNARY else None


def activation(name: str, x, alpha, beta):
    """An activation of a recurrent op: an elementwise op's own expression, by its name."""
    attrs = {k: v for k, v in (("alpha", alpha), ("beta", beta)) if v is not None}
    return _FORMER_OPS[name][0](x, attrs) if name in _FORMER_OPS else unary_expression(name, x, **attrs)


def _input(node: Node, index: int) -> str:
    return node.inputs[index] if index < len(node.inputs) and node.inputs[index] else ""


def _activations(node: Node, cell: str, dirs: int) -> tuple[list, list, list]:
    """Each direction's activation names with their alpha and beta, defaults filled in as
    onnxruntime does: each function that takes an alpha (beta) consumes the next one given."""
    count = len(CELLS[cell]["default"])
    names = [a.decode() if isinstance(a, bytes) else a for a in node.attrs.get("activations", [])]
    names = names or list(CELLS[cell]["default"]) * dirs
    if len(names) == count and dirs == 2:
        names = names * 2
    if len(names) != count * dirs:
        raise ShapeError(f"{node.describe()}: {len(names)} activations for {dirs} direction(s) of a {cell} "
                         f"({count} each)")
    alphas, betas = list(node.attrs.get("activation_alpha", [])), list(node.attrs.get("activation_beta", []))
    out_a, out_b = [], []
    for name in names:
        params = _activation_params(name)
        if params is None:
            raise UnsupportedError(f"{node.describe()}: activation {name} is not supported (an elementwise op's name, "
                                   "Affine or ScaledTanh)")
        out_a.append(float(alphas.pop(0)) if "alpha" in params and alphas else None)  # (None: the default)
        out_b.append(float(betas.pop(0)) if "beta" in params and betas else None)
    return names, out_a, out_b


def _constant(g, node: Node, index: int, what: str) -> np.ndarray:
    """A weight input: the recurrent kernels are built around its values."""
    return const_input(g, node, index, what, required=True).astype(np.float32)


def recurrent_geometry(g, node: Node, cell: str) -> dict:
    """What every recurrent op's attributes and X say: direction, dirs, layout, seq, batch,
    width (the input size)."""
    x = g.types[node.inputs[0]]
    if x.dtype != "float32":
        raise UnsupportedError(f"{node.describe()}: {cell} of {x.dtype} is not supported (float32)")
    check_attrs(node, {"direction": ("forward", "reverse", "bidirectional", b"forward", b"reverse",
                                     b"bidirectional"), "layout": (0, 1)})
    direction = node.attrs.get("direction", "forward")
    direction = direction.decode() if isinstance(direction, bytes) else direction
    layout = node.attrs.get("layout", 0)
    if len(x.shape) != 3:
        raise ShapeError(f"{node.describe()}: X is {x}, not [seq, batch, input] (or [batch, seq, input])")
    seq, batch, width = (x.shape[1], x.shape[0], x.shape[2]) if layout else x.shape
    return {"direction": direction, "dirs": 2 if direction == "bidirectional" else 1, "layout": layout,
            "seq": seq, "batch": batch, "width": width}


def check_hidden_size(node: Node, hidden: int, r_shape) -> None:
    if "hidden_size" in node.attrs and node.attrs["hidden_size"] != hidden:
        raise ShapeError(f"{node.describe()}: hidden_size={node.attrs['hidden_size']} but R is {list(r_shape)}")


def recurrent_bias(g, node: Node, dirs: int, gates: int, hidden: int) -> np.ndarray:
    """B as [dirs, 2 * gates * hidden] (Wb then Rb), zeros if omitted."""
    if not _input(node, 3):
        return np.zeros((dirs, 2 * gates * hidden), np.float32)
    bias = _constant(g, node, 3, "B")
    if bias.shape != (dirs, 2 * gates * hidden):
        raise ShapeError(f"{node.describe()}: B is {list(bias.shape)}, expected {[dirs, 2 * gates * hidden]}")
    return bias


def steps_by_rows(body: NodeBuilder, node: Node, geo: dict) -> str:
    """X as [seq, batch, input] (batch-first layout transposed)."""
    return body.add(TRANSPOSE, [node.inputs[0]], perm=[1, 0, 2]) if geo["layout"] else node.inputs[0]


def expand_recurrent(g, node: Node) -> list[Node]:
    cell = node.op
    spec = CELLS[cell]
    geo = recurrent_geometry(g, node, cell)
    dirs, width, gates = geo["dirs"], geo["width"], spec["gates"]
    w, r = _constant(g, node, 1, "W"), _constant(g, node, 2, "R")
    hidden = r.shape[-1]
    check_hidden_size(node, hidden, r.shape)
    if w.shape != (dirs, gates * hidden, width) or r.shape != (dirs, gates * hidden, hidden):
        raise ShapeError(f"{node.describe()}: W {list(w.shape)} and R {list(r.shape)} do not fit {dirs} direction(s) "
                         f"of {gates} gates x hidden {hidden} over input {width}")
    bias = recurrent_bias(g, node, dirs, gates, hidden)
    wb, rb = bias[:, :gates * hidden], bias[:, gates * hidden:]
    # Biases that add linearly go into the projection; GRU's recurrent h-gate bias is inside
    # the reset gate's product (or added after it), so it stays with the recurrence.
    proj_bias, rec_bias = wb + rb, np.zeros((dirs, hidden), np.float32)
    if cell == GRU:
        proj_bias[:, 2 * hidden:] = wb[:, 2 * hidden:]
        rec_bias = np.ascontiguousarray(rb[:, 2 * hidden:])

    body = NodeBuilder(g, node)
    flat = body.reshaped(steps_by_rows(body, node, geo), [-1, width])  # (seq * batch rows, run-time sizes too)
    w_all = np.ascontiguousarray(np.concatenate([w[d].T for d in range(dirs)], axis=1))
    xw = body.add(ADD, [body.add(MATMUL, [flat, body.const(w_all)]), body.const(proj_bias.reshape(-1))])
    rt = np.ascontiguousarray(r.transpose(0, 2, 1))
    return add_recurrence(body, node, cell, geo, hidden, xw, [body.const(rt), body.const(rec_bias)])


def add_recurrence(body: NodeBuilder, node: Node, cell: str, geo: dict, hidden: int, xw: str,
                   recurrent: list[str], extra: list[str] = (), **attrs) -> list[Node]:
    """The kiln.Recurrence node of a recurrent op (and the layout's transposes around it).
    xw: the projected input [seq * batch, dirs * gates * hidden], biases included;
    recurrent: R^T and GRU's recurrent h bias; extra: inputs after P that `attrs` explain."""
    g, spec, dirs, layout = body.g, CELLS[cell], geo["dirs"], geo["layout"]
    names, alphas, betas = _activations(node, cell, dirs)
    states = []
    for index in (5, 6):
        s = _input(node, index)
        states.append(body.add(TRANSPOSE, [s], perm=[1, 0, 2]) if s and layout else s)
    peep = _input(node, 7)
    inputs = [xw, *recurrent, _input(node, 4), states[0], states[1] if cell == LSTM else "",
              body.const(_constant(g, node, 7, "P")) if peep else "", *extra]
    outs = [n for n in node.outputs] + [""] * (3 - len(node.outputs))
    inner = [f"{node.key}/{k}" if o and layout else o for o, k in zip(outs, ("y", "y_h", "y_c"))]
    body.nodes.append(Node(RECURRENCE, inputs, inner[:spec["outputs"]], {
        "kind": spec["kind"], "gates": spec["gates"], "hidden": hidden, "seq": geo["seq"], "batch": geo["batch"],
        "reverse": [d == 1 or geo["direction"] == "reverse" for d in range(dirs)],
        "activations": names, "alphas": alphas, "betas": betas,
        "clip": float(node.attrs["clip"]) if "clip" in node.attrs else None,
        "input_forget": int(node.attrs.get("input_forget", 0)),
        "linear_before_reset": int(node.attrs.get("linear_before_reset", 0)), **attrs,
    }, f"{node.name}/recurrence"))
    if layout:
        if outs[0]:
            body.add(TRANSPOSE, [inner[0]], outs[0], perm=[2, 0, 1, 3])
        for o, i in zip(outs[1:spec["outputs"]], inner[1:spec["outputs"]]):
            if o:
                body.add(TRANSPOSE, [i], o, perm=[1, 0, 2])
    return body.nodes


def _recurrence_infer(g, node, p):
    a = node.attrs
    dirs, h = len(a["reverse"]), a["hidden"]
    # Inputs: projected X, R^T, GRU's recurrent h bias, sequence_lens, initial_h, initial_c, P.
    for index, what in ((3, "sequence_lens"), (4, "initial_h"), (5, "initial_c")):
        name = _input(node, index)
        want = (a["batch"],) if index == 3 else (dirs, a["batch"], h)
        if name and g.types[name].shape != want:
            raise ShapeError(f"{node.describe()}: {what} is {g.types[name]}, expected shape {list(want)}")
    if _input(node, 3) and g.types[node.inputs[3]].dtype != "int32":
        raise ShapeError(f"{node.describe()}: sequence_lens is {g.types[node.inputs[3]].dtype}, not int32")
    state = TensorType((dirs, a["batch"], h), "float32")
    return [TensorType((a["seq"], dirs, a["batch"], h), "float32"), state, state][:len(node.outputs)]


register(
    *(OpDef(cell, OPAQUE, expanded_only, expand=expand_recurrent) for cell in CELLS),
    OpDef(RECURRENCE, OPAQUE, _recurrence_infer, alone=lambda b, node: lower_recurrence(b, node, activation)),
)
