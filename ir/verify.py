"""The kernel IR's contract, checked before a kernel leaves the driver.

An ill-typed kernel would otherwise surface as an LLVM parse error in a forked child,
retried three times. Here it is one InternalError naming the kernel, the ops it computes
and the first thing wrong: an unbound or mistyped variable, operands of different types,
a buffer that does not exist, a constant index outside its buffer, an Assign to something
that is not an accumulator.
"""
from __future__ import annotations

from math import prod

from .errors import InternalError
from .schedule import CODEGEN_OPTIONS
from .loop import (COMPUTE_TYPES, FLOAT_CALLS, FLOAT_GEMM_KINDS, FLOAT_TYPES, GEMM_KINDS, GEMM_SPLITS, INT_TYPES, STORAGE_TYPES,
                   TRANSPOSE_LANES, Assign, Bin, Buffer, Call, Cast, Cmp, Const, Deinterleave, Expr, For, Gemm, If, Kernel,
                   Let, Load, Local, Select, Store, TransposeBlock, Var, WindowDot, compute_type, operand_type,
                   window_dot_fits)

_FLOAT_OPS = {"add", "sub", "mul", "div", "rem", "max", "min", "pow"}
_INT_OPS = {"add", "sub", "mul", "div", "rem", "max", "min", "and", "or", "xor", "shl", "shr"}
_BIN_OPS = {**{t: _FLOAT_OPS for t in FLOAT_TYPES}, **{t: _INT_OPS for t in INT_TYPES}, "i1": {"and", "or", "xor"}}
_CMP_OPS = {"lt", "le", "gt", "ge", "eq", "ne"}
_F32_ONLY_CALLS = {"round_f16", "round_bf16"}
_GEMM_A_TYPES = {"f32", "f16", "bf16"}
_LOOP_KINDS = {"serial", "scalar", "vectorize", "masked", "forced_vector", "reduce", "unroll", "vector_masked", "rolled",
               "independent"}


class _Problem(Exception):
    pass


# Kernel.schedule: the options codegen reads, and what each accepts.
_SCHEDULE_OPTIONS = {"vector_width": (4, 8, 16), "vectorize": (True, False), "reassociate": (True, False),
                     **CODEGEN_OPTIONS}


def _check_schedule(kernel: Kernel) -> None:
    for key, value in kernel.schedule:
        if key not in _SCHEDULE_OPTIONS:
            raise _Problem(f"schedule option {key!r} is not one codegen reads ({', '.join(_SCHEDULE_OPTIONS)})")
        if value not in _SCHEDULE_OPTIONS[key]:
            raise _Problem(f"schedule option {key}={value!r} (accepted: {_SCHEDULE_OPTIONS[key]})")


class _Checker:
    def __init__(self, kernel: Kernel):
        self.vector_width = kernel.option("vector_width", 8)
        self.buffers: dict[str, Buffer] = {}
        for b in kernel.buffers:
            if b.name in self.buffers:
                raise _Problem(f"buffer {b.name} is declared twice")
            if b.dtype not in STORAGE_TYPES:
                raise _Problem(f"buffer {b.name} has element type {b.dtype!r}")
            self.buffers[b.name] = b
        self.scopes: list[dict[str, tuple[str, bool]]] = [{}]  # name -> (dtype, is an accumulator)

    # -- scopes --------------------------------------------------------------------------
    def bind(self, name: str, dtype: str, mutable: bool = False) -> None:
        self.scopes[-1][name] = (dtype, mutable)

    def lookup(self, name: str) -> tuple[str, bool]:
        for scope in reversed(self.scopes):
            if name in scope:
                return scope[name]
        raise _Problem(f"variable {name} is used outside the scope that binds it")

    def block(self, body, bound: dict | None = None) -> None:
        self.scopes.append(dict(bound or {}))
        for s in body:
            self.stmt(s)
        self.scopes.pop()

    def buffer(self, name: str, index: Expr) -> Buffer:
        if name not in self.buffers:
            raise _Problem(f"buffer {name} does not exist")
        if self.expr(index) != "i64":
            raise _Problem(f"index into {name} is not an i64")
        b = self.buffers[name]
        if isinstance(index, Const) and not 0 <= index.value < max(b.size, 1):
            raise _Problem(f"constant index {index.value} outside {name} ({b.size} elements)")
        return b

    # -- expressions ---------------------------------------------------------------------
    def operands(self, what: str, *es) -> str:
        """The type operands share (a literal takes its siblings' type): all the same."""
        types = [None if isinstance(e, Const) else self.expr(e) for e in es]  # each subtree checked once
        want = next((t for t in types if t is not None), None) or operand_type(es, self.expr)
        for e, t in zip(es, types):
            got = self.literal(e, want) if t is None else t
            if got != want:
                raise _Problem(f"{what} of {want} and {got}")
        return want

    def literal(self, e: Const, want: str) -> str:
        if e.dtype not in COMPUTE_TYPES:
            raise _Problem(f"constant {e.value!r} has type {e.dtype!r}")
        if want not in FLOAT_TYPES and want != e.dtype and float(e.value) != int(e.value):
            raise _Problem(f"literal {e.value!r} used as {want}")
        return want

    def expr(self, e) -> str:
        if isinstance(e, Const):
            return self.literal(e, e.dtype)
        if isinstance(e, Var):
            dtype, _ = self.lookup(e.name)
            if e.dtype != dtype:
                raise _Problem(f"variable {e.name} is used as {e.dtype} but bound as {dtype}")
            return dtype
        if isinstance(e, Load):
            return compute_type(self.buffer(e.buf, e.index).dtype)
        if isinstance(e, Bin):
            t = self.operands(e.op, e.a, e.b)
            if e.op not in _BIN_OPS.get(t, ()):
                raise _Problem(f"{e.op} is not defined on {t}")
            return t
        if isinstance(e, Cmp):
            if e.op not in _CMP_OPS:
                raise _Problem(f"comparison {e.op}")
            self.operands(f"comparison {e.op}", e.a, e.b)
            return "i1"
        if isinstance(e, Select):
            if self.expr(e.cond) != "i1":
                raise _Problem("select on a condition that is not i1")
            return self.operands("select", e.a, e.b)
        if isinstance(e, Cast):
            self.expr(e.a)
            if e.dtype not in COMPUTE_TYPES:
                raise _Problem(f"cast to {e.dtype}")
            return e.dtype
        if isinstance(e, Call):
            if not e.args:
                raise _Problem(f"{e.fn} of nothing")
            t = self.operands(e.fn, *e.args)
            if e.fn == "not":
                if t != "i1":
                    raise _Problem(f"not of {t}")
                return t
            if e.fn not in FLOAT_CALLS:
                raise _Problem(f"unknown function {e.fn}")
            if t not in FLOAT_TYPES and not (e.fn == "neg" and t in INT_TYPES):
                raise _Problem(f"{e.fn} of {t}")
            if e.fn in _F32_ONLY_CALLS and t != "f32":
                raise _Problem(f"{e.fn} of {t}")
            return t
        raise _Problem(f"{type(e).__name__} is not an expression")

    # -- statements ----------------------------------------------------------------------
    def stmt(self, s) -> None:
        if isinstance(s, For):
            runtime = isinstance(s.extent, Expr) and self.expr(s.extent) == "i64"
            if not (runtime or isinstance(s.extent, int) and s.extent >= 0) or s.kind not in _LOOP_KINDS:
                raise _Problem(f"loop {s.var}: extent {s.extent!r}, kind {s.kind!r}")  # (0: no iterations)
            if not isinstance(s.parallel, bool):
                raise _Problem(f"loop {s.var}: parallel is {s.parallel!r}")
            self.block(s.body, {s.var: ("i64", False)})
        elif isinstance(s, Store):
            storage = self.buffer(s.buf, s.index).dtype
            want = compute_type(storage)
            value = self.literal(s.value, want) if isinstance(s.value, Const) else self.expr(s.value)
            if value != want:
                raise _Problem(f"store of {value} into {s.buf} ({storage})")
        elif isinstance(s, Let):
            self.bind(s.var, self.expr(s.value))
        elif isinstance(s, Local):
            if s.dtype not in COMPUTE_TYPES:
                raise _Problem(f"accumulator {s.var} has type {s.dtype!r}")
            init = self.literal(s.init, s.dtype) if isinstance(s.init, Const) else self.expr(s.init)
            if init != s.dtype:
                raise _Problem(f"accumulator {s.var} ({s.dtype}) starts from a {init}")
            self.bind(s.var, s.dtype, mutable=True)
        elif isinstance(s, Assign):
            dtype, mutable = self.lookup(s.var)
            if not mutable:
                raise _Problem(f"assignment to {s.var}, which is not an accumulator")
            value = self.literal(s.value, dtype) if isinstance(s.value, Const) else self.expr(s.value)
            if value != dtype:
                raise _Problem(f"assignment of a {value} to {s.var} ({dtype})")
        elif isinstance(s, If):
            if self.expr(s.cond) != "i1":
                raise _Problem("if on a condition that is not i1")
            self.block(s.then)
            self.block(s.orelse)
        elif isinstance(s, Gemm):
            a_type = self.buffers.get(s.a_buf, Buffer("", "", 0)).dtype
            b_type = self.buffers.get(s.b_buf, Buffer("", "", 0)).dtype
            if s.kind not in GEMM_KINDS:
                raise _Problem(f"gemm of unknown kind {s.kind!r}")
            if s.split not in GEMM_SPLITS:
                raise _Problem(f"gemm split {s.split!r}")
            if s.stores_along not in ("m", "n"):
                raise _Problem(f"gemm stores along {s.stores_along!r}")
            if isinstance(s.b_sk, Expr) or isinstance(s.n, Expr):  # (a run-time count of columns read in place)
                in_place = isinstance(s.b_sk, Expr) and self.expr(s.b_sk) == "i64" or s.b_ktab and not s.b_sk
                if not (in_place and s.kind == "f32" and isinstance(s.n, Expr) and self.expr(s.n) == "i64"
                        and s.split == "n" and isinstance(s.m, int)):
                    raise _Problem(f"gemm of {s.n} columns read in place with row stride {s.b_sk} or table "
                                   f"{s.b_ktab!r}: float32, a run-time n and stride (or a table), split n, a static m")
            elif s.b_sk and (s.kind not in ("f32", "bf16") or s.b_sk < 0 or s.kind == "bf16" and s.a_kruns):
                raise _Problem(f"{s.kind} gemm reads B in place with row stride {s.b_sk} (float32, or bf16 on tiles "
                               "without runs of k)")
            if s.n_bound < 0 or s.n_bound and not isinstance(s.n, Expr):
                raise _Problem(f"gemm of {s.n} columns bounded by {s.n_bound}: a bound is for a run-time n only")
            if s.b_ktab and (s.kind != "f32" or s.b_sk
                             or self.buffers.get(s.b_ktab, Buffer("", "", 0)).dtype != "i64"):
                raise _Problem(f"{s.kind} gemm reads B in place through {s.b_ktab!r}: float32, an i64 table, no b_sk")
            if s.a_mtab and (s.a_sb or self.buffers.get(s.a_mtab, Buffer("", "", 0)).dtype != "i64"):
                raise _Problem(f"gemm row-offset table {s.a_mtab} is not an i64 buffer (or A is also in row blocks)")
            if isinstance(s.a_rows, Expr):  # (rows of a length known at run time: the codegen's whole rows)
                if not (s.a_mtab and self.expr(s.a_rows) == "i64" and isinstance(s.m, Expr)):
                    raise _Problem(f"gemm in rows of {s.a_rows} pixels: needs a row-offset table, a run-time m")
            elif s.a_rows and not (s.a_mtab and isinstance(s.m, int) and s.a_rows > 0 and s.m % s.a_rows == 0):
                raise _Problem(f"gemm of {s.m} rows in rows of {s.a_rows} pixels: needs a row-offset table, whole rows")
            if s.a_kspan and not (s.a_mtab and s.a_ktab and s.kind == "f32"
                                  and self.buffers.get(s.a_kspan, Buffer("", "", 0)).dtype == "i64"):
                raise _Problem(f"gemm k-span table {s.a_kspan}: an i64 buffer, beside row and k-offset tables, float32")
            if s.a_sb < 0 or s.a_sb and (s.a_ktab or s.kind != "f32"):
                raise _Problem(f"{s.kind} gemm with A in row blocks {s.a_sb} apart: float32 only, no a_ktab")
            if s.b_words and (s.kind not in ("u8s8", "s8u8") or s.in_place_b):
                raise _Problem(f"{s.kind} gemm with B packed as 16-bit pairs: only u8s8 and s8u8, B packed")
            runs = prod(c for c, _ in s.a_kruns) if s.a_kruns else 1
            if s.tiles and (s.kind == "f32" or s.b_words or s.b_ktab or s.in_place_b and s.kind != "bf16"
                            or s.a_mtab and not (isinstance(s.a_rows, int) and s.a_rows > 0) or s.a_sb or s.a_ktab
                            or s.nr not in (16, 32) or s.mr > 64 * 16 // s.nr or isinstance(s.a_sm, Expr)
                            or s.k % runs or s.k // runs % 16):
                raise _Problem(f"{s.kind} gemm on tiles: 8-bit or bf16, B packed (bf16: or in place), A strided "
                               f"(a_kruns, not tables but rows'), panels of 16 or 32 columns, 4 accumulator tiles, "
                               f"runs of k in whole 64-byte steps (tile {s.mr}x{s.nr}, k {s.k}, runs {s.a_kruns})")
            if s.a_kruns and not (s.tiles and all(isinstance(c, int) and c > 0 and isinstance(st, int)
                                                  for c, st in s.a_kruns)
                                  and s.k % prod(c for c, _ in s.a_kruns) == 0):
                raise _Problem(f"gemm k runs {s.a_kruns}: tiles only, counts dividing k={s.k}")
            if s.m_rows and not (s.tiles and s.stores_along == "m" and isinstance(s.m, int)
                                 and len(s.m_rows) == 2 and 0 < s.m_rows[1] <= s.m_rows[0]):
                raise _Problem(f"gemm over virtual rows {s.m_rows}: on tiles, stores along m, a static m")
            if s.b_words and (a_type != "i16" or b_type != "i16"):
                raise _Problem(f"gemm operands {s.a_buf}, {s.b_buf} are not 16-bit buffers (B packed in pairs)")
            if s.kind == "bf16":
                if not s.tiles or a_type not in ("u16", "bf16") or b_type not in ("u16", "bf16"):
                    raise _Problem(f"bf16 gemm of {s.a_buf} ({a_type}), {s.b_buf} ({b_type}): on tiles, A bf16 (or "
                                   "its bits), B 16-bit pairs")
            elif s.kind != "f32":
                if not s.b_words and (a_type not in ("i8", "u8") or b_type not in ("i8", "u8")):
                    raise _Problem(f"{s.kind} gemm operands {s.a_buf}, {s.b_buf} are not byte buffers")
            elif a_type not in _GEMM_A_TYPES:
                raise _Problem(f"gemm operand {s.a_buf} is not a float buffer computing in f32")
            elif b_type != "f32":
                raise _Problem(f"gemm operand {s.b_buf} is not an f32 buffer")
            if s.a_ktab and self.buffers.get(s.a_ktab, Buffer("", "", 0)).dtype != "i64":
                raise _Problem(f"gemm k-offset table {s.a_ktab} is not an i64 buffer")
            if self.expr(s.a_off) != "i64" or self.expr(s.b_off) != "i64":
                raise _Problem("gemm offsets are not i64")
            runtime_m = isinstance(s.m, Expr) and self.expr(s.m) == "i64"
            if min(1 if runtime_m else s.m, 1 if isinstance(s.n, Expr) else s.n, s.k, s.mr, s.nr) <= 0:
                raise _Problem(f"gemm of shape m={s.m} n={s.n} k={s.k} tile {s.mr}x{s.nr} split {s.split}")
            if s.nr % self.vector_width:
                raise _Problem(f"gemm tile {s.mr}x{s.nr}: columns not whole vectors of {self.vector_width}")
            self.block(s.epilogue, {s.m_var: ("i64", False), s.n_var: ("i64", False), s.acc_var: ("f32" if s.kind in FLOAT_GEMM_KINDS else "i32", False)})
        elif isinstance(s, WindowDot):
            for buf, want in ((s.p_buf, "u8"), (s.w_buf, "i32"), (s.out_buf, "i32")):
                if self.buffers.get(buf, Buffer("", "", 0)).dtype != want:
                    raise _Problem(f"window dot operand {buf} is not a {want} buffer")
            if any(self.expr(e) != "i64" for e in (s.p_off, s.w_off, s.out_off)):
                raise _Problem("window dot offsets are not i64")
            if min(s.rows, s.taps, s.width, s.stride, s.dilation) <= 0 or s.p_row < 0:
                raise _Problem(f"window dot of {s.rows}x{s.taps} taps over {s.width} outputs, stride {s.stride}")
            if not window_dot_fits(s.stride, s.dilation, s.taps):
                raise _Problem(f"window dot stride {s.stride}, dilation {s.dilation}: 16 outputs span over 64 bytes")
        elif isinstance(s, Deinterleave):
            for buf in (s.src, s.dst):
                if self.buffers.get(buf, Buffer("", "", 0)).dtype != "f32":
                    raise _Problem(f"deinterleave operand {buf} is not a f32 buffer")
            if self.expr(s.src_off) != "i64" or self.expr(s.dst_off) != "i64":
                raise _Problem("deinterleave offsets are not i64")
            if isinstance(s.src_count, Expr) and self.expr(s.src_count) != "i64":
                raise _Problem("deinterleave source count is not i64")
            sizes = (s.count, s.dst_stride)
            if any(isinstance(v, Expr) for v in sizes):  # (known at run time: i64 expressions)
                if any(not isinstance(v, int) and self.expr(v) != "i64" for v in sizes) or s.phases < 1:
                    raise _Problem(f"deinterleave of {s.count} x {s.phases} phases into runs {s.dst_stride} apart")
            elif s.phases < 1 or s.count < 1 or s.dst_stride < s.count:
                raise _Problem(f"deinterleave of {s.count} x {s.phases} phases into runs {s.dst_stride} apart")
        elif isinstance(s, TransposeBlock):
            for buf in (s.src, s.dst):
                if buf not in self.buffers:
                    raise _Problem(f"buffer {buf} does not exist")
            if self.expr(s.src_off) != "i64" or self.expr(s.dst_off) != "i64":
                raise _Problem("transpose block offsets are not i64")
            if not (0 < s.rows <= TRANSPOSE_LANES and (not isinstance(s.cols, int) or 0 < s.cols <= TRANSPOSE_LANES)):
                raise _Problem(f"transpose block of {s.rows}x{s.cols} elements (at most {TRANSPOSE_LANES} each way)")
            if any(not isinstance(v, int) and self.expr(v) != "i64" for v in (s.cols, s.src_stride)):
                raise _Problem("a transpose block's run-time columns and stride are not i64")
        else:
            raise _Problem(f"{type(s).__name__} is not a statement")


def verify_kernel(kernel: Kernel, name: str, ops) -> None:
    """Raise InternalError naming the kernel and its ops if it breaks the IR's contract."""
    try:
        _check_schedule(kernel)
        _Checker(kernel).block(kernel.body)
    except _Problem as e:
        raise InternalError(f"kernel {name} (ops {', '.join(ops)}) is malformed: {e}") from None
