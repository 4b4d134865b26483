"""com.microsoft.MatMulNBits with its 4-bit codes kept as codes (ir/ops/matmul_nbits.py).

The codes are repacked when the model is built into panels of P = 2 vectors of columns, two
to a byte: byte t of a panel's row k holds column t in its low nibble and column t + P/2 in
its high one ([panels][K][P/2] bytes), so one vector load gives half a panel's row twice,
a mask or a shift apart. Each block of K has a scale and scale * zero point per column
([panels][blocks][P] floats). The weights file holds a byte per two weights, as the model
file does.

A call's rows are computed one of two ways:
  - few rows (a decoding step, FEW_ROWS or fewer): per panel and block, each row's partial
    sums sum_k a[k] * code[k][j] over the panel's columns (the block unrolled, a vector of
    P/2 columns a half, each code loaded once for all the rows), then acc[j] += scale[j] *
    partial[j] - (scale * zero point)[j] * (the row's sum of a over the block). Each weight
    streams as half a byte, 8 times fewer bytes than float32 panels: a decoding step is
    bound by those bytes. A row count known at run time has a variant per count.
  - more rows (a prompt): CHUNK_COLUMNS columns at a time (fewer where K is large: at most
    CHUNK_BYTES of floats) dequantized into the float GEMM's panels in a workspace, then that
    GEMM over all the rows.
Rows known only at run time choose at each call (guarded phases, ir/loop.py).
"""
from __future__ import annotations

import math

import numpy as np

from ..graph import Node
from ..loop import (Assign, Cast, Const, Expr, For, If, Let, Load, Local, Store, Var, add, cmp, div, fbin,
                    fold_balanced, mul, unflatten)
from ..symbolic import greatest
from .builder import KernelBuilder
from .gemm import gemm_stmt

FEW_ROWS = 4
# Columns dequantized per GEMM: 1024, whole code panels (2 vectors: 64 columns at most), and
# no more than 16 MiB of floats: K = 11008's 45 MiB for 1024 columns ran a prompt's layer
# 9% slower (128 rows, 56.0 -> 50.9 ms) than 352 columns a chunk.
CHUNK_COLUMNS = 1024
CHUNK_BYTES = 16 << 20


def pack_codes(codes: np.ndarray, width: int) -> np.ndarray:
    """uint8 codes [N, K] (0..15) as [ceil(N/width), K, width/2] bytes: byte t of a panel's
    row holds column t in its low nibble and column t + width/2 in its high one; zero past N."""
    n, k = codes.shape
    panels, half = -(-n // width), width // 2
    padded = np.zeros((panels * width, k), np.uint8)
    padded[:n] = codes
    rows = padded.reshape(panels, width, k).transpose(0, 2, 1)  # [panels, K, width]
    return np.ascontiguousarray(rows[:, :, :half] | (rows[:, :, half:] << 4))


def per_panel(values: np.ndarray, width: int) -> np.ndarray:
    """float32 [N, blocks] as [ceil(N/width), blocks, width], zero past N."""
    n, blocks = values.shape
    panels = -(-n // width)
    padded = np.zeros((panels * width, blocks), np.float32)
    padded[:n] = values
    return np.ascontiguousarray(padded.reshape(panels, width, blocks).transpose(0, 2, 1))


def _greatest_rows(b: KernelBuilder, out: str) -> int:
    return math.prod(greatest(d) for d in b.type(out).shape[:-1])


def lower_matmul_nbits(b: KernelBuilder, node: Node, store, blocks) -> tuple:
    """The kernel of a MatMulNBits node whose codes `blocks` (ir/ops/matmul_nbits.Blocks)
    are 4-bit and fill whole blocks of K; `store` writes an output element (the epilogue)."""
    out = node.outputs[0]
    n, k = blocks.codes.shape
    bs, nb = blocks.block_size, blocks.scales.shape[1]
    lead = list(b.shape(out)[:-1])
    rows = math.prod(lead)  # (an Expr where a leading dim is known at run time only)
    a = b.in_param(node.inputs[0])
    bias = node.inputs[5] if len(node.inputs) > 5 and node.inputs[5] else ""
    bias_of = b.reader(bias) if bias else None
    width = 2 * b.config.vector_width
    half = width // 2
    codes = b.constant_param(f"{out}_codes", pack_codes(blocks.codes, width))
    scales = b.constant_param(f"{out}_scales", per_panel(blocks.scales, width))
    offsets = b.constant_param(f"{out}_offsets", per_panel(blocks.scales * blocks.zero_points, width))

    def finish(row, col, value) -> list:
        value = fbin("add", value, bias_of([col])) if bias else value
        return list(store(unflatten(row, lead) + [col], value))

    def a_at(row, blk, t):
        return Load(a, add(mul(row, k), add(mul(blk, bs), t)))

    def few_rows() -> tuple[list, list]:
        """(A's block sums, the products): all of a call's rows at once, so each code loads
        once for them all (a variant per count, guarded, where the count is known at run
        time only)."""
        panels, most = -(-n // width), min(FEW_ROWS, _greatest_rows(b, out))
        sums, acc = b.workspace(most * nb), b.workspace(panels * most * width)
        r, blk, kk, s = b.fresh("r"), b.fresh("blk"), b.fresh("kk"), b.fresh("s")
        block_sums = For(r, rows, (For(blk, nb, (
            Local(s, "f32", Const(0.0, "f32")),
            For(kk, bs, (Assign(s, fbin("add", Var(s, "f32"), a_at(Var(r), Var(blk), Var(kk)))),)),
            Store(sums, add(mul(Var(r), nb), Var(blk)), Var(s, "f32")))),))

        def products(count: int) -> For:
            p, blk, j, jo = b.fresh("p"), b.fresh("blk"), b.fresh("j"), b.fresh("jo")
            lets, low, high = [], [[] for _ in range(count)], [[] for _ in range(count)]
            for t in range(bs):  # the block unrolled: its column sums are the vectors of P/2 columns
                c, lo, hi = b.fresh("c"), b.fresh("lo"), b.fresh("hi")
                lets += [Let(c, Load(codes, add(mul(add(mul(Var(p), k), add(mul(Var(blk), bs), Const(t))), half),
                                                Var(j)))),
                         Let(lo, Cast("f32", fbin("and", Var(c, "u8"), Const(15)))),
                         Let(hi, Cast("f32", fbin("shr", Var(c, "u8"), Const(4))))]
                for row in range(count):
                    x = a_at(Const(row), Var(blk), Const(t))
                    low[row].append(fbin("mul", x, Var(lo, "f32")))
                    high[row].append(fbin("mul", x, Var(hi, "f32")))

            def accumulate(row: int, column, partial):
                at = add(mul(add(mul(Var(p), count), row), width), column)
                table = add(mul(add(mul(Var(p), nb), Var(blk)), width), column)
                block_sum = Load(sums, add(Const(row * nb), Var(blk)))
                scaled = fbin("sub", fbin("mul", Load(scales, table), partial),
                              fbin("mul", Load(offsets, table), block_sum))
                return Store(acc, at, fbin("add", Load(acc, at), scaled))
            halves = [(row, Var(j), low[row]) for row in range(count)] + \
                [(row, add(Var(j), half), high[row]) for row in range(count)]
            block = For(j, half, (*lets, *[accumulate(row, column, fold_balanced("add", partial))
                                           for row, column, partial in halves]), "vectorize")
            zero = For(jo, count * width, (Store(acc, add(mul(Var(p), count * width), Var(jo)), Const(0.0, "f32")),),
                       "vectorize")
            col = add(mul(Var(p), width), Var(jo))
            writes = []
            for row in range(count):
                write = finish(Const(row), col, Load(acc, add(mul(add(mul(Var(p), count), row), width), Var(jo))))
                if n % width:
                    write = [If(cmp("lt", col, Const(n)), tuple(write))]
                writes.append(For(jo, width, tuple(write), "vectorize"))
            return For(p, panels, (zero, For(blk, nb, (block,)), *writes), parallel=True)
        if isinstance(rows, Expr):
            return [block_sums], [If(cmp("eq", rows, Const(count)), (products(count),)) for count in range(1, most + 1)]
        return [block_sums], [products(rows)]

    def more_rows() -> list:
        # The GEMM's panels are the code panels (the target's default tile), so each half of a
        # panel's row dequantizes as one vector.
        tile = (b.config.mr, width)
        chunk = max(width, min(CHUNK_COLUMNS, CHUNK_BYTES // (4 * k) // width * width))
        ws = b.workspace(-(-min(n, chunk) // width) * k * width)
        phases = []
        for c0 in range(0, n, chunk):
            cn = min(chunk, n - c0)
            gp, kk, j, c = b.fresh("gp"), b.fresh("kk"), b.fresh("j"), b.fresh("c")
            panel, row = add(Const(c0 // width), Var(gp)), add(mul(Var(gp), k), Var(kk))
            table = add(mul(add(mul(panel, nb), div(Var(kk), Const(bs))), width), Var(j))

            def dequantized(code, at):  # (past N the codes and tables are zero, so are the weights)
                return fbin("sub", fbin("mul", Cast("f32", code), Load(scales, at)), Load(offsets, at))
            body = (Let(c, Load(codes, add(mul(add(mul(panel, k), Var(kk)), half), Var(j)))),
                    Store(ws, add(mul(row, width), Var(j)), dequantized(fbin("and", Var(c, "u8"), Const(15)), table)),
                    Store(ws, add(mul(row, width), add(Var(j), half)),
                          dequantized(fbin("shr", Var(c, "u8"), Const(4)), add(table, half))))
            phases.append(For(gp, -(-cn // width), (For(kk, k, (For(j, half, body, "vectorize"),)),), parallel=True))
            phases.append(gemm_stmt(b, a, Const(0), k, 1, ws, Const(0), rows, cn, k,
                                    lambda mm, nn, acc, c0=c0: finish(mm, add(nn, Const(c0)), acc), tile=tile,
                                    split="n" if isinstance(rows, Expr) else ""))
        return phases

    if not isinstance(rows, Expr):
        return tuple(sum(few_rows(), []) if rows <= FEW_ROWS else more_rows())
    sums, products = few_rows()
    few, more = cmp("le", rows, Const(FEW_ROWS)), cmp("gt", rows, Const(FEW_ROWS))
    return tuple([If(few, (phase,)) for phase in sums] + products + [If(more, (phase,)) for phase in more_rows()])
