"""The time loop of LSTM, GRU and RNN: one kernel per node, the state kept in workspaces.

The input projection of every step (X W^T + biases) was computed before, by one GEMM
(ir/ops/recurrent.py). Each step of each direction then runs, for all batch rows:

  acc = xw[t]                               the step's projected input
  acc += h_prev R^T                         k outer, 4 rows of R^T per pass, gate columns
                                            vectorized: each R^T row streams once per step
                                            for the whole batch
  gates, cell and hidden update             vectorized over hidden units; Y[t] written

GRU with linear_before_reset=0 multiplies R_h by (r * h_prev), so it takes the reset gate
first and runs a second product for the h columns. A quantized LSTM (onnxruntime's
DynamicQuantizeLSTM, attribute `quantized`) quantizes h_prev to uint8 each step and sums
its products with R's 8-bit values in int32 (`_quantized_recurrent_product`). Steps past a
row's sequence_lens leave its state alone and its Y at zero; reverse directions walk each
row from its own last step.
"""
from __future__ import annotations

from ..graph import Node
from ..loop import Assign, Cast, Const, For, If, Let, Load, Local, Store, Var, add, call, cmp, fbin, mul, select, sub
from ..symbolic import greatest
from .builder import KernelBuilder
from .elementwise import as_index


def _f(v):
    return Const(float(v), "f32")


UNROLL = 4  # rows of R^T per pass of the recurrent product


def lower_recurrence(b: KernelBuilder, node: Node, activation) -> tuple:
    """activation(name, x, alpha, beta): the expression of one of the node's activations."""
    a = node.attrs
    cell, hidden = a["kind"], a["hidden"]  # kind: lstm, gru or rnn
    # seq and batch as the kernel computes them (ints, or run-time sizes); workspaces hold the
    # most rows the bounds allow
    seq, batch, rows = b.dim(a["seq"]), b.dim(a["batch"]), greatest(a["batch"])
    dirs = len(a["reverse"])
    gh = a["gates"] * hidden
    n_act = len(a["activations"]) // dirs
    name = lambda i: node.inputs[i] if i < len(node.inputs) and node.inputs[i] else ""  # noqa: E731
    xw, rt, rec_bias = b.in_param(node.inputs[0]), b.in_param(node.inputs[1]), b.in_param(node.inputs[2])
    lens = b.in_param(name(3)) if name(3) else None
    init = [b.in_param(name(i)) if name(i) else None for i in (4, 5)]
    peep = b.in_param(name(6)) if name(6) else None
    outs = [b.out_param(o) if o else None for o in node.outputs]
    y_out, h_out = outs[0], outs[1] if len(outs) > 1 else None
    c_out = outs[2] if len(outs) > 2 else None
    h_ws = b.workspace(dirs * rows * hidden)
    c_ws = b.workspace(dirs * rows * hidden) if cell == "lstm" else None
    # Scratch of one direction's step: each direction has its own, so both run at once.
    accs = [b.workspace(rows * gh) for _ in range(dirs)]
    rhs = [b.workspace(rows * hidden) if cell == "gru" and not a["linear_before_reset"] else None
           for _ in range(dirs)]
    quantized = a.get("quantized", False)
    if quantized:  # per direction: h_prev quantized, and the int32 sums
        r_scale = b.in_param(node.inputs[7])
        q_scratch = [(b.workspace(rows * hidden, "i32"), b.workspace(rows * gh, "i32")) for _ in range(dirs)]
    clip = a["clip"]

    def clipped(x):
        return x if clip is None else fbin("min", fbin("max", x, _f(-clip)), _f(clip))

    def loop(extent, fn, kind="serial"):
        v = b.fresh("i")
        return For(v, extent, tuple(fn(Var(v))), kind)

    body = []
    # Initial state; Y starts at zero where sequence_lens leaves steps out.
    for ws, src in ((h_ws, init[0]), (c_ws, init[1])):
        if ws is not None:
            body.append(loop(dirs * batch * hidden, lambda i, ws=ws, src=src: [
                Store(ws, i, Load(src, i) if src else _f(0))], "vectorize"))
    if lens is not None and y_out is not None:
        body.append(loop(seq * dirs * batch * hidden, lambda i: [Store(y_out, i, _f(0))], "vectorize"))

    time_loops = []
    for d in range(dirs):
        acc, rh = accs[d], rhs[d]
        mine = slice(d * n_act, (d + 1) * n_act)
        act = [lambda x, n=n, al=al, be=be: activation(n, x, al, be)
               for n, al, be in zip(a["activations"][mine], a["alphas"][mine], a["betas"][mine])]
        reverse = a["reverse"][d]
        state = lambda bb, j, d=d: add(mul(add(mul(Const(d), batch), bb), hidden), j)  # noqa: E731

        def length(bb):
            return Cast("i64", Load(lens, bb)) if lens is not None else as_index(seq)

        def time_of(s, bb, reverse=reverse):
            if not reverse:
                return s
            t = sub(sub(length(bb), Const(1)), s)
            return fbin("max", t, Const(0))  # (inactive rows compute on step 0, and discard it)

        def step(s, d=d, act=act, reverse=reverse, state=state, time_of=time_of, length=length, acc=acc, rh=rh):
            stmts = []
            # acc <- the step's projected input (GRU with linear_before_reset: its h part
            # holds the recurrent product alone, the input part is read again in the gates).
            keep = 2 * hidden if cell == "gru" and a["linear_before_reset"] else gh

            def load_input(bb):
                row = add(mul(add(mul(time_of(s, bb), batch), bb), dirs * gh), d * gh)
                return [loop(gh, lambda j: [Store(acc, add(mul(bb, gh), j), select(
                    cmp("lt", j, Const(keep)), Load(xw, add(row, fbin("min", j, Const(keep - 1)))), _f(0))
                    if keep < gh else Load(xw, add(row, j)))], "vectorize")]
            stmts.append(loop(batch, load_input))
            first = 2 * hidden if rh is not None else gh
            if quantized:
                def active(bb):  # the rows whose h_prev onnxruntime quantizes: see below
                    return cmp("le", s, length(bb)) if lens is not None else None
                stmts += _quantized_recurrent_product(b, loop, rt, r_scale, d, hidden, gh, batch, acc, h_ws, state,
                                                      active, *q_scratch[d])
            else:
                stmts += _recurrent_product(loop, rt, d, hidden, gh, batch, acc, h_ws, state, 0, first)
            if rh is not None:  # GRU: (r * h_prev) R_h^T
                def reset_times_state(bb):
                    return [loop(hidden, lambda k: [Store(rh, add(mul(bb, hidden), k), fbin(
                        "mul", act[0](clipped(Load(acc, add(mul(bb, gh), add(k, hidden))))), Load(h_ws, state(bb, k))))],
                        "vectorize")]
                stmts.append(loop(batch, reset_times_state))
                stmts += _recurrent_product(loop, rt, d, hidden, gh, batch, acc, rh,
                                            lambda bb, k: add(mul(bb, hidden), k), 2 * hidden, gh)

            def gates(bb):
                t = time_of(s, bb)
                g = lambda k, j: Load(acc, add(mul(bb, gh), add(j, k * hidden)))  # noqa: E731
                y_at = lambda j: add(mul(add(mul(add(mul(t, dirs), d), batch), bb), hidden), j)  # noqa: E731
                point = _cell_update(b, cell, a, act, clipped, g, lambda j: state(bb, j), h_ws, c_ws, peep, rec_bias, d,
                                     hidden, xw, lambda j: add(add(mul(add(mul(t, batch), bb), dirs * gh), d * gh), j),
                                     y_out, y_at)
                update = [loop(hidden, point, "vectorize")]
                if lens is None:
                    return update
                return [If(cmp("lt", s, length(bb)), tuple(update), ())]
            stmts.append(loop(batch, gates))
            return stmts
        time_loops.append(loop(seq, step))
    if dirs == 1:
        body += time_loops
    else:  # the directions share nothing but their inputs: one thread each
        dv = b.fresh("dir")
        body.append(For(dv, dirs, (If(cmp("eq", Var(dv), Const(0)), (time_loops[0],), (time_loops[1],)),),
                        parallel=True))

    for ws, out in ((h_ws, h_out), (c_ws, c_out)):
        if ws is not None and out is not None:
            body.append(loop(dirs * batch * hidden, lambda i, ws=ws, out=out: [Store(out, i, Load(ws, i))],
                             "vectorize"))
    return tuple(body)


def _recurrent_product(loop, rt, d, hidden, gh, batch, acc, src, src_at, col0, col1) -> list:
    """acc[bb, col0:col1] += sum_k src[bb, k] * R^T[d][k][col]: UNROLL rows of R^T per pass,
    each streamed once for every batch row (float32, or int32 sums of a quantized LSTM)."""
    width = col1 - col0
    u = UNROLL if hidden % UNROLL == 0 else 1

    def rows(k0):
        def per_batch(bb):
            hs = [Load(src, src_at(bb, add(k0, i))) for i in range(u)]

            def column(j):
                col = add(j, col0)
                total = Load(acc, add(mul(bb, gh), col))
                for i in range(u):
                    total = fbin("add", total, fbin("mul", hs[i], Load(rt, add(mul(add(mul(Const(d), hidden),
                                                                                         add(k0, i)), gh), col))))
                return [Store(acc, add(mul(bb, gh), col), total)]
            return [loop(width, column, "vectorize")]
        return [loop(batch, per_batch)]
    return [loop(hidden // u, lambda k: rows(mul(k, u)))]


def _quantized_recurrent_product(b, loop, rt, r_scale, d, hidden, gh, batch, acc, h_src, src_at, active,
                                 q_h, sums) -> list:
    """acc[bb, :] += h_prev R^T as onnxruntime's DynamicQuantizeLSTM computes it.

    h_prev of all batch rows is one matrix quantized to uint8: its range, widened to hold 0,
    gives scale = range / 255 (1 if the range is empty) and zero point round(-min / scale).
    The products with R's 8-bit values (R^T here already less its zero points, as int32) sum
    exactly in int32; the sums are scaled by scale * R_scale[col]. onnxruntime zeroes the
    rows of Y (its h_prev) once a row is past its sequence length, and zero is in the range
    anyway, so a row counts while step <= its length (`active`; None: every row)."""
    lo, hi, scale, zero = b.fresh("lo"), b.fresh("hi"), b.fresh("scale"), b.fresh("zp")

    def h_at(bb, k):
        h = Load(h_src, src_at(bb, k))
        return h if active(bb) is None else select(active(bb), h, _f(0))

    def widen(bb, k):
        return [Assign(lo, fbin("min", Var(lo, "f32"), h_at(bb, k))),
                Assign(hi, fbin("max", Var(hi, "f32"), h_at(bb, k)))]

    def quantize(bb, k):
        q = fbin("min", fbin("max", fbin("add", call("round", fbin("div", h_at(bb, k), Var(scale, "f32"))),
                                         Var(zero, "f32")), _f(0)), _f(255))
        return [Store(q_h, add(mul(bb, hidden), k), fbin("sub", Cast("i32", q), Cast("i32", Var(zero, "f32"))))]

    def scaled(bb, j):
        at = add(mul(bb, gh), j)
        multiplier = fbin("mul", Var(scale, "f32"), Load(r_scale, add(Const(d * gh), j)))
        return [Store(acc, at, fbin("add", Load(acc, at), fbin("mul", Cast("f32", Load(sums, at)), multiplier)))]
    return [
        Local(lo, "f32", _f(0)), Local(hi, "f32", _f(0)),
        loop(batch, lambda bb: [loop(hidden, lambda k: widen(bb, k))]),
        Let(scale, select(cmp("eq", Var(hi, "f32"), Var(lo, "f32")), _f(1),
                          fbin("div", fbin("sub", Var(hi, "f32"), Var(lo, "f32")), _f(255)))),
        Let(zero, call("round", fbin("min", fbin("max", fbin("sub", _f(0), fbin("div", Var(lo, "f32"),
                                                                                Var(scale, "f32"))), _f(0)), _f(255)))),
        loop(batch, lambda bb: [loop(hidden, lambda k: quantize(bb, k), "vectorize")]),
        loop(batch * gh, lambda i: [Store(sums, i, Const(0, "i32"))], "vectorize"),
        *_recurrent_product(loop, rt, d, hidden, gh, batch, sums, q_h, lambda bb, k: add(mul(bb, hidden), k), 0, gh),
        loop(batch, lambda bb: [loop(gh, lambda j: scaled(bb, j), "vectorize")]),
    ]


def _cell_update(b, cell, a, act, clipped, g, at, h_ws, c_ws, peep, rec_bias, d, hidden, xw, xw_at, y_out, y_at):
    """The per-unit update of one step: returns point(j) -> statements."""
    def point(j):
        stmts = []
        h_prev = Load(h_ws, at(j))
        if cell == "lstm":
            c_prev = Load(c_ws, at(j))
            pi, po, pf = ((Load(peep, add(Const(d * 3 * hidden + k * hidden), j)) for k in range(3)) if peep
                          else (None, None, None))
            gi, go, gf, gc = g(0, j), g(1, j), g(2, j), g(3, j)
            if peep:
                gi, gf = fbin("add", gi, fbin("mul", pi, c_prev)), fbin("add", gf, fbin("mul", pf, c_prev))
            i = act[0](clipped(gi))
            f = fbin("sub", _f(1), i) if a["input_forget"] else act[0](clipped(gf))
            c_new, h_new = b.fresh("c"), b.fresh("h")
            stmts.append(Let(c_new, fbin("add", fbin("mul", f, c_prev), fbin("mul", i, act[1](clipped(gc))))))
            c = Var(c_new, "f32")
            if peep:
                go = fbin("add", go, fbin("mul", po, c))
            stmts += [Let(h_new, fbin("mul", act[0](clipped(go)), act[2](c))), Store(c_ws, at(j), c)]
        elif cell == "gru":
            z, r = act[0](clipped(g(0, j))), act[0](clipped(g(1, j)))
            rb = Load(rec_bias, add(Const(d * hidden), j))
            if a["linear_before_reset"]:
                pre = fbin("add", Load(xw, xw_at(add(j, 2 * hidden))), fbin("mul", r, fbin("add", g(2, j), rb)))
            else:
                pre = fbin("add", g(2, j), rb)
            h_new = b.fresh("h")
            stmts.append(Let(h_new, fbin("add", fbin("mul", fbin("sub", _f(1), z), act[1](clipped(pre))),
                                         fbin("mul", z, h_prev))))
        else:
            h_new = b.fresh("h")
            stmts.append(Let(h_new, act[0](clipped(g(0, j)))))
        h = Var(h_new, "f32")
        stmts.append(Store(h_ws, at(j), h))
        if y_out is not None:
            stmts.append(Store(y_out, y_at(j), h))
        return stmts
    return point

