"""The kernel IR's contract, checked before a kernel leaves the driver.

An ill-typed kernel would otherwise surface as an LLVM parse error in a forked child,
retried three times. Here it is one InternalError naming the kernel, the ops it computes
and the first thing wrong: an unbound or mistyped variable, operands of different types,
a buffer that does not exist, a constant index outside its buffer, an Assign to something
that is not an accumulator.
"""
from __future__ import annotations

from .errors import InternalError
from .loop import (Assign, Bin, Buffer, Call, Cast, Cmp, Const, Expr, For, Gemm, If, Kernel, Let, Load, Local, Select,
                   Store, Var)

DTYPES = {"f32", "i64", "i1", "i8"}
_BIN_OPS = {"f32": {"add", "sub", "mul", "div", "rem", "max", "min", "pow"},
            "i64": {"add", "sub", "mul", "div", "rem", "max", "min", "and", "or"},
            "i1": {"and", "or"}}
_CMP_OPS = {"lt", "le", "gt", "ge", "eq", "ne"}
_F32_CALLS = {"exp", "log", "sqrt", "tanh", "erf", "abs", "floor", "ceil", "round", "neg", "fmod"}
_CASTS = {("f32", "i64"), ("i64", "f32"), ("i1", "f32"), ("i1", "i64"), ("f32", "i1"), ("i64", "i1")}
_LOOP_KINDS = {"serial", "vectorize", "unroll"}


class _Problem(Exception):
    pass


class _Checker:
    def __init__(self, kernel: Kernel):
        self.buffers: dict[str, Buffer] = {}
        for b in kernel.buffers:
            if b.name in self.buffers:
                raise _Problem(f"buffer {b.name} is declared twice")
            if b.dtype not in DTYPES:
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
    def expr(self, e) -> str:
        if isinstance(e, Const):
            if e.dtype not in DTYPES - {"i8"}:
                raise _Problem(f"constant {e.value!r} has type {e.dtype!r}")
            return e.dtype
        if isinstance(e, Var):
            dtype, _ = self.lookup(e.name)
            if e.dtype != dtype:
                raise _Problem(f"variable {e.name} is used as {e.dtype} but bound as {dtype}")
            return dtype
        if isinstance(e, Load):
            dtype = self.buffer(e.buf, e.index).dtype
            return "i1" if dtype == "i8" else dtype
        if isinstance(e, Bin):
            a, b = self.expr(e.a), self.expr(e.b)
            if a != b:
                raise _Problem(f"{e.op} of {a} and {b}")
            if e.op not in _BIN_OPS.get(a, ()):
                raise _Problem(f"{e.op} is not defined on {a}")
            return a
        if isinstance(e, Cmp):
            a, b = self.expr(e.a), self.expr(e.b)
            if a != b or e.op not in _CMP_OPS:
                raise _Problem(f"comparison {e.op} of {a} and {b}")
            return "i1"
        if isinstance(e, Select):
            if self.expr(e.cond) != "i1":
                raise _Problem("select on a condition that is not i1")
            a, b = self.expr(e.a), self.expr(e.b)
            if a != b:
                raise _Problem(f"select between {a} and {b}")
            return a
        if isinstance(e, Cast):
            src = self.expr(e.a)
            if src != e.dtype and (src, e.dtype) not in _CASTS:
                raise _Problem(f"cast from {src} to {e.dtype}")
            return e.dtype
        if isinstance(e, Call):
            want = "i1" if e.fn == "not" else "f32"
            if e.fn != "not" and e.fn not in _F32_CALLS:
                raise _Problem(f"unknown function {e.fn}")
            got = [self.expr(a) for a in e.args]
            if not got or any(g != want for g in got):
                raise _Problem(f"{e.fn} of {', '.join(got) or 'nothing'}")
            return want
        raise _Problem(f"{type(e).__name__} is not an expression")

    # -- statements ----------------------------------------------------------------------
    def stmt(self, s) -> None:
        if isinstance(s, For):
            if not isinstance(s.extent, int) or s.extent < 0 or s.kind not in _LOOP_KINDS:  # 0: no iterations
                raise _Problem(f"loop {s.var}: extent {s.extent!r}, kind {s.kind!r}")
            self.block(s.body, {s.var: ("i64", False)})
        elif isinstance(s, Store):
            dtype = self.buffer(s.buf, s.index).dtype
            value = self.expr(s.value)
            if value != dtype and not (dtype == "i8" and value == "i1"):
                raise _Problem(f"store of {value} into {s.buf} ({dtype})")
        elif isinstance(s, Let):
            self.bind(s.var, self.expr(s.value))
        elif isinstance(s, Local):
            if self.expr(s.init) != s.dtype:
                raise _Problem(f"accumulator {s.var} ({s.dtype}) starts from a {self.expr(s.init)}")
            self.bind(s.var, s.dtype, mutable=True)
        elif isinstance(s, Assign):
            dtype, mutable = self.lookup(s.var)
            if not mutable:
                raise _Problem(f"assignment to {s.var}, which is not an accumulator")
            if self.expr(s.value) != dtype:
                raise _Problem(f"assignment of a {self.expr(s.value)} to {s.var} ({dtype})")
        elif isinstance(s, If):
            if self.expr(s.cond) != "i1":
                raise _Problem("if on a condition that is not i1")
            self.block(s.then)
            self.block(s.orelse)
        elif isinstance(s, Gemm):
            for name in (s.a_buf, s.b_buf):
                if self.buffers.get(name, Buffer(name, "", 0)).dtype != "f32":
                    raise _Problem(f"gemm operand {name} is not an f32 buffer")
            if s.a_ktab and self.buffers.get(s.a_ktab, Buffer("", "", 0)).dtype != "i64":
                raise _Problem(f"gemm k-offset table {s.a_ktab} is not an i64 buffer")
            if self.expr(s.a_off) != "i64" or self.expr(s.b_off) != "i64":
                raise _Problem("gemm offsets are not i64")
            if min(s.m, s.n, s.k, s.mr, s.nr) <= 0:
                raise _Problem(f"gemm of shape m={s.m} n={s.n} k={s.k} tile {s.mr}x{s.nr}")
            self.block(s.epilogue, {s.m_var: ("i64", False), s.n_var: ("i64", False), s.acc_var: ("f32", False)})
        else:
            raise _Problem(f"{type(s).__name__} is not a statement")


def verify_kernel(kernel: Kernel, name: str, ops) -> None:
    """Raise InternalError naming the kernel and its ops if it breaks the IR's contract."""
    try:
        _Checker(kernel).block(kernel.body)
    except _Problem as e:
        raise InternalError(f"kernel {name} (ops {', '.join(ops)}) is malformed: {e}") from None
