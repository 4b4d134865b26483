"""3x3 convolutions by Winograd's minimal filtering F(2x2, 3x3): 16 multiplies per 2x2 outputs
and input channel where the direct conv needs 36.

Each 4x4 tile of the (zero-bordered) input, 2 apart, becomes V = B^T d B; each 3x3 filter
becomes U = G g G^T (at build time, in float64); the 16 positions of the tiles are 16
independent GEMMs, M[xi] = V[xi] (tiles x cin) x U[xi] (cin x cout), and each tile's 2x2
outputs are Y = A^T M A, with the group's epilogue applied as they are stored. The GEMMs do
2.25x fewer multiply-adds than the conv's; the transforms cost a pass over the input and
one over the output, so it pays where channels are many and the picture small (ResNet's
later stages). It is a conv path the tuner may choose (`conv_path` = "winograd"), never the
rule: its sums are rounded in another order (errors of a few ulps of the largest term, well
within float32 reassociation's bounds).
"""
from __future__ import annotations

import numpy as np

from ..graph import Node
from ..loop import Const, For, Let, Load, Store, Var, add, fbin, loop, mul
from .builder import KernelBuilder
from .gemm import deferred_panels, gemm_stmt
from .planes import padded_copy

# F(2x2, 3x3)'s matrices (Lavin and Gray, 2015).
_BT = np.array([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], np.float64)
_G = np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]], np.float64)
_AT = np.array([[1, 1, 1, 0], [0, 1, -1, -1]], np.float64)


def winograd_fits(b: KernelBuilder, node: Node) -> bool:
    """A 2-D 3x3 conv, stride and dilation 1, one group, constant float32 weights, static sizes."""
    a = b.attrs(node)
    xs = b.type(node.inputs[0]).shape
    return (len(xs) == 4 and list(a["kernel_shape"]) == [3, 3] and list(a["strides"]) == [1, 1]
            and list(a["dilations"]) == [1, 1] and a.get("group", 1) == 1 and node.inputs[1] in b.g.constants
            and b.type(node.inputs[0]).dtype == "float32" and all(isinstance(d, int) for d in xs[2:])
            and all(d >= 2 for d in b.type(node.outputs[0]).shape[2:]))


def filter_transform(w: np.ndarray) -> np.ndarray:
    """[cout, cin, 3, 3] -> U as [16, cin, cout] float32: U[4r+s][c][o] = (G w[o,c] G^T)[r][s]."""
    u = np.einsum("ij,ocjk,lk->ilco", _G, w.astype(np.float64), _G)  # [4, 4, cin, cout]
    return np.ascontiguousarray(u.reshape(16, w.shape[1], w.shape[0]), dtype=np.float32)


def _combine(rows, matrix) -> list:
    """matrix (with entries 0, 1, -1) times the list of row expressions."""
    out = []
    for coefs in matrix:
        total = None
        for c, r in zip(coefs, rows):
            if c == 0:
                continue
            if total is None:
                total = r if c == 1 else fbin("sub", Const(0.0, "f32"), r)
            else:
                total = fbin("add" if c == 1 else "sub", total, r)
        out.append(total)
    return out


def lower_winograd(b: KernelBuilder, node: Node, store) -> tuple:
    x_name, w_name = node.inputs[0], node.inputs[1]
    batch, cin, h, w_ = b.type(x_name).shape
    batch = b.dim(batch)
    cout = b.type(w_name).shape[0]
    pt, pl, _, _ = b.attrs(node)["pads"]
    oh, ow = b.type(node.outputs[0]).shape[2:]
    th, tw = -(-oh // 2), -(-ow // 2)
    tiles = th * tw
    hp, wp = 2 * th + 2, 2 * tw + 2  # (the border past the last whole tile is zeros too)
    bias = b.reader(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else None
    xparam = b.in_param(x_name)
    nr = b.tile(cout)[1]
    u = filter_transform(b.g.constants[w_name])
    uparam = b.constant_param(f"{w_name}_winograd", deferred_panels(u, nr))
    panel_stride = -(-cout // nr) * cin * nr
    xp = b.workspace(cin * hp * wp)
    v_ws = b.workspace(16 * cin * tiles)
    m_ws = b.workspace(16 * cout * tiles)
    bv = b.fresh("b")

    copy = padded_copy(b, xparam, mul(Var(bv), cin * h * w_), cin, [h, w_], [pt, pl, hp - h - pt, wp - w_ - pl], xp)

    # V[xi][c][t] = (B^T d B)[xi] for the tile t = (ti, tj) of channel c.
    c, ti, tj = b.fresh("c"), b.fresh("ti"), b.fresh("tj")
    d = [[Load(xp, add(mul(Var(c), hp * wp), add(mul(add(mul(Var(ti), 2), r), wp), add(mul(Var(tj), 2), s))))
          for s in range(4)] for r in range(4)]
    cols = [_combine([d[r][s] for r in range(4)], _BT) for s in range(4)]  # B^T d, by column
    names = [[b.fresh("bt") for _ in range(4)] for _ in range(4)]
    lets = [Let(names[r][s], cols[s][r]) for r in range(4) for s in range(4)]
    rows = [_combine([Var(names[r][s], "f32") for s in range(4)], _BT) for r in range(4)]  # (B^T d) B, by row
    tile = add(mul(Var(ti), tw), Var(tj))
    stores = [Store(v_ws, add(mul(add(mul(Const(4 * r + s), cin), Var(c)), tiles), tile), rows[r][s])
              for r in range(4) for s in range(4)]
    inputs = For(c, cin, (For(ti, th, (For(tj, tw, (*lets, *stores), "vectorize"),)),), parallel=True)

    # M[xi][o][t] = sum_c V[xi][c][t] U[xi][c][o]: 16 GEMMs, threads dividing the positions.
    xi = b.fresh("xi")
    products = For(xi, 16, (gemm_stmt(
        b, v_ws, mul(Var(xi), cin * tiles), 1, tiles, uparam, mul(Var(xi), panel_stride), tiles, cout, cin,
        lambda mm, nn, acc: [Store(m_ws, add(mul(add(mul(Var(xi), cout), nn), tiles), mm), acc)],
        stores_along="m", split="m"),), parallel=True)

    # Y = A^T M A per tile, the epilogue applied to each output.
    o, oi, oj = b.fresh("o"), b.fresh("oi"), b.fresh("oj")

    def outputs(row, col, out_rows: int, out_cols: int) -> list:
        at = add(mul(row, tw), col)
        m = [[Load(m_ws, add(mul(add(mul(Const(4 * r + s), cout), Var(o)), tiles), at)) for s in range(4)]
             for r in range(4)]
        names_ = [[b.fresh("at") for _ in range(4)] for _ in range(2)]
        cols_ = [_combine([m[r][s] for r in range(4)], _AT) for s in range(4)]  # A^T M, by column
        out = [Let(names_[r][s], cols_[s][r]) for r in range(2) for s in range(4)]
        for r in range(out_rows):
            ys = _combine([Var(names_[r][s], "f32") for s in range(4)], _AT)
            for s in range(out_cols):
                value = ys[s] if bias is None else fbin("add", ys[s], bias([Var(o)]))
                y, x = add(mul(row, 2), r), add(mul(col, 2), s)
                idx = [add(mul(y, ow), x)] if b.conv_collapsed else [y, x]
                out += store([Var(bv), Var(o)] + idx, value)
        return out

    full_rows, full_cols = oh // 2, ow // 2

    def tile_row(row, out_rows: int) -> list:
        body = [For(oj, full_cols, tuple(outputs(row, Var(oj), out_rows, 2)), "vectorize")]
        if ow % 2:  # (the last tile column holds one output column)
            body += outputs(row, Const(full_cols), out_rows, 1)
        return body

    per_channel = [For(oi, full_rows, tuple(tile_row(Var(oi), 2)))]
    if oh % 2:
        per_channel += tile_row(Const(full_rows), 1)
    results = For(o, cout, tuple(per_channel), parallel=True)
    return loop(bv, batch, (copy, inputs, products, results))
