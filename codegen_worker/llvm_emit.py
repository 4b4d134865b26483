"""Loop-nest kernel -> LLVM IR text.

Loops are emitted bottom-tested (every extent is static and positive; a phase's range
[lo, hi), known only at run time, is tested first: ir/loop.py, "Threads"), buffers are
`noalias` pointers, float math carries reassoc/contract flags so reductions vectorize, and
exp/tanh/erf are inlined polynomial and rational approximations rather than libm calls so
loops using them vectorize too (math_ir.py). FunctionEmitter is made of parts: this module's
expressions, statements and loops; gemm_emit.py's Gemm statement (explicit vector code: an
mr x nr register tile of accumulators fed by FMAs, written to a stack tile, then the epilogue
over the tile as ordinary vectorizable loops); integer_dots_emit.py's byte and word products
for its integer kinds; vector_blocks_emit.py's window rows, transposes and deinterleaves.
"""
from __future__ import annotations

from ..artifacts.cpu_features import byte_dot_widths, has_f16_conversions
from ..ir.loop import (FLOAT_TYPES, SUB_BYTE_TYPES, SYMBOLS, Assign, Bin, Call, Cast, Cmp, Const, Deinterleave, For,
                      Gemm, If, Kernel, Let, Load, Local, Select, Store, TransposeBlock, Var, WindowDot, bits,
                      compute_type, highest, is_unsigned, lowest, operand_type, phases, recomputable, value_bits)
from ..ir.minifloats import E8M0, E8M0_ROUNDINGS, MINIFLOATS, e8m0_rounding
from ..ir.schedule import PANEL_CHUNK_KIB, REDUCE_INTERLEAVE
from .gemm_emit import GemmEmitter
from .integer_dots_emit import IntegerDotEmitter
from .llvm_types import LL, literal
from .math_ir import MATH_DECLS, math_lib
from .minifloat_ir import e8m0_encoder_name, from_float_name, minifloat_conversions, to_float_name
from .vector_blocks_emit import VectorBlockEmitter

_FSUFFIX = {"f32": "f32", "f64": "f64"}
# (E8M0's store truncates its exponent: a Cast to it rounds first, as its round_mode says)
_PACK = {"f16": "kiln_f2h", "bf16": "kiln_f2bf", **{t: from_float_name(t) for t in MINIFLOATS},
         E8M0: e8m0_encoder_name("down", False)}
_UNPACK = {"f16": "kiln_h2f", "bf16": "kiln_bf2f", **{t: to_float_name(t) for t in (*MINIFLOATS, E8M0)}}
# round_<storage> calls: (conversion to the narrow type, back to f32, the narrow type's storage)
_ROUNDINGS = {**{f"round_{t}": (_PACK[t], _UNPACK[t], t) for t in _PACK},
              **{e8m0_rounding(m, s): (e8m0_encoder_name(m, s), _UNPACK[E8M0], E8M0)
                 for m in E8M0_ROUNDINGS for s in (False, True)}}
# No arcp: x / c must stay exact (Resize coordinates land on .5 boundaries by design).
FMF = "reassoc nsz contract afn"
_FBIN = {"add": "fadd", "sub": "fsub", "mul": "fmul", "div": "fdiv", "rem": "frem"}
_IBIN = {"add": "add", "sub": "sub", "mul": "mul", "div": "div", "rem": "rem", "and": "and", "or": "or",
         "xor": "xor", "shl": "shl", "shr": "shr"}
_FCMP = {"lt": "olt", "le": "ole", "gt": "ogt", "ge": "oge", "eq": "oeq", "ne": "une"}
_ICMP = {"lt": "slt", "le": "sle", "gt": "sgt", "ge": "sge", "eq": "eq", "ne": "ne"}
_INTRINSIC = {"log": "log", "sqrt": "sqrt", "abs": "fabs", "floor": "floor", "ceil": "ceil", "round": "roundeven",
              "exp": "exp"}


def _align(storage: str) -> int:
    return max(bits(storage) // 8, 1)


def _clamped_within(e, dst: str) -> bool:
    """Is e min(max(x, lo), hi) (either order) with constant bounds inside dst's range?"""
    bounds = []
    while isinstance(e, Bin) and e.op in ("max", "min") and len(bounds) < 2:
        const = e.b if isinstance(e.b, Const) else e.a if isinstance(e.a, Const) else None
        if const is None:
            return False
        bounds.append((e.op, const.value))
        e = e.a if const is e.b else e.b
    ops = {op: v for op, v in bounds}
    return set(ops) == {"max", "min"} and lowest(dst) <= ops["max"] and ops["min"] <= highest(dst)


# With mask registers, a vector_masked loop of run-time length shorter than this many vectors
# runs predicated throughout (its mask computed per vector): as whole vectors then a masked
# tail, two loops' setup cost more than the row (depthwise convs over run-time sizes, against
# their static time: 144 x 56 x 56 stride 2 1.63 -> 1.43x, 960 x 7 x 7 2.29 -> 1.86x). From 64
# wide the two loops win (a 224-wide row: 7% faster than predicated throughout).
PREDICATED_ROW_VECTORS = 4


class FunctionEmitter(GemmEmitter, IntegerDotEmitter, VectorBlockEmitter):
    def __init__(self, kernel: Kernel, symbol: str, dot_widths: frozenset = frozenset()):
        self.k = kernel
        self.symbol = symbol
        # The vector widths at which the target has vpdpbusd (artifacts.cpu_features.byte_dot_widths):
        # 8-bit GEMMs at those widths use it, others emulate it.
        self.dot_widths = dot_widths
        self.vw = int(kernel.option("vector_width", 8))
        self.vectorize = bool(kernel.option("vectorize", True))
        self.fmf = FMF if kernel.option("reassociate", True) else FMF.replace("reassoc ", "")
        # The schedule's codegen knobs (ir/schedule.py): B's L2 chunk and its prefetching.
        self.panel_chunk_bytes = int(kernel.option("panel_chunk_kib", PANEL_CHUNK_KIB)) * 1024
        self.prefetch = kernel.option("prefetch", "auto")
        self.reduce_interleave = int(kernel.option("reduce_interleave", REDUCE_INTERLEAVE))
        self.lines: list[str] = []
        self.allocas: list[str] = []
        self.meta: list[str] = []
        # The access group of the innermost `independent` loop being emitted: its loads and
        # stores are tagged with it, and the loop promises LLVM they carry no dependence.
        self.access_group: str | None = None
        self.n = 0
        self.block = "entry"
        # This block's pure instructions by their text (right of the `=`) -> the value: index
        # arithmetic written per load repeats itself (a Winograd tile's 36 loads recomputed
        # the same row and channel offsets: 60% of a 6,400-line kernel), and each copy cost
        # parsing and LLVM's passes time before EarlyCSE removed it.
        self.block_values: dict[str, str] = {}
        self.bufs = {b.name: (f"%b{i}", b.dtype) for i, b in enumerate(kernel.buffers)}
        self.reads_symbols = SYMBOLS in self.bufs  # (sizes known at run time)
        # Symbol k's value, loaded once at the function's entry (None: load where read). Read
        # where it is used, a load inside a conditional block (a bordered copy's rows inside the
        # input) could not leave its loop, nor could the sizes computed from it: a 14-wide
        # depthwise row's copy recomputed some 40 of them per row, 3.6x its static time.
        self.symbol_values: dict | None = {}
        self.scopes: list[dict] = [{}]
        self.decls: set[str] = set()  # intrinsics and C library functions the body calls
        self.functions: list[str] = []  # functions of the kernel's own (outlined tiles)
        self.outlined: dict[tuple, str] = {}  # (Gemm id, rows, cols) -> its tile function
        self.outline_choice: dict[int, bool] = {}  # Gemm id -> outline_tiles(g)
        self.types: dict[int, tuple] = {}

    # -- helpers -------------------------------------------------------------------------
    def tmp(self, hint: str = "t") -> str:
        self.n += 1
        return f"%{hint}{self.n}"

    def emit(self, line: str) -> None:
        self.lines.append("  " + line)

    def pure(self, rhs: str, hint: str) -> str:
        """The value of an instruction without side effects (`rhs`, as written right of the
        `=`): the one this block already computed, else a new one (a value of this block
        dominates the rest of it)."""
        v = self.block_values.get(rhs)
        if v is None:
            v = self.block_values[rhs] = self.tmp(hint)
            self.emit(f"{v} = {rhs}")
        return v

    def label(self, name: str) -> None:
        self.lines.append(f"{name}:")
        self.block = name
        self.block_values = {}

    def lookup(self, name: str):
        for scope in reversed(self.scopes):
            if name in scope:
                return scope[name]
        raise KeyError(f"kernel uses variable '{name}' before binding it")

    def bind(self, name: str, value) -> None:
        self.scopes[-1][name] = value

    # -- expressions ---------------------------------------------------------------------
    def dtype(self, e) -> str:
        """The compute type of expression e (remembered: deep fused expressions ask often)."""
        if isinstance(e, (Const, Var)):
            return self._dtype(e)  # a variable's type is its binding's, looked up each time
        key = id(e)
        if key not in self.types:
            self.types[key] = (self._dtype(e), e)  # e kept alive: its id stays its own
        return self.types[key][0]

    def _dtype(self, e) -> str:
        if isinstance(e, Const):
            return e.dtype
        if isinstance(e, Var):
            return self.lookup(e.name)[2]
        if isinstance(e, Load):
            return compute_type(self.bufs[e.buf][1])
        if isinstance(e, Cmp):
            return "i1"
        if isinstance(e, Cast):
            return e.dtype
        if isinstance(e, Call):
            return "i1" if e.fn == "not" else operand_type(e.args, self.dtype)
        if isinstance(e, Bin):
            return operand_type((e.a, e.b), self.dtype)
        if isinstance(e, Select):
            return operand_type((e.a, e.b), self.dtype)
        raise TypeError(e)

    def value(self, e, want: str | None = None) -> str:
        """The SSA value of `e`; a literal (Const) is written as a `want` if given."""
        if isinstance(e, Const):
            return literal(e.value, want or e.dtype)
        return self.expr(e)

    def expr(self, e) -> str:
        if isinstance(e, Const):
            return literal(e.value, e.dtype)
        if isinstance(e, Var):
            kind, ref, dt = self.lookup(e.name)
            if kind == "ssa":
                return ref
            v = self.tmp("v")
            self.emit(f"{v} = load {LL[dt]}, ptr {ref}")
            return v
        if isinstance(e, Load):
            if e.buf == SYMBOLS and isinstance(e.index, Const) and self.symbol_values is not None:
                return self.symbol_values.setdefault(int(e.index.value), f"%sym{int(e.index.value)}")
            ptr, st = self.bufs[e.buf]
            return self.load(ptr, st, self.expr(e.index))
        if isinstance(e, Bin):
            return self.binop(e)
        if isinstance(e, Cmp):
            dt = operand_type((e.a, e.b), self.dtype)
            a, b = self.value(e.a, dt), self.value(e.b, dt)
            v = self.tmp("c")
            if dt in FLOAT_TYPES:
                self.emit(f"{v} = fcmp {_FCMP[e.op]} {LL[dt]} {a}, {b}")
            else:
                pred = _ICMP[e.op] if e.op in ("eq", "ne") or not is_unsigned(dt) else "u" + _ICMP[e.op][1:]
                self.emit(f"{v} = icmp {pred} {LL[dt]} {a}, {b}")
            return v
        if isinstance(e, Select):
            dt = operand_type((e.a, e.b), self.dtype)
            c, a, b = self.value(e.cond, "i1"), self.value(e.a, dt), self.value(e.b, dt)
            v = self.tmp("s")
            self.emit(f"{v} = select i1 {c}, {LL[dt]} {a}, {LL[dt]} {b}")
            return v
        if isinstance(e, Cast):
            return self.cast(e)
        if isinstance(e, Call):
            return self.call(e)
        raise TypeError(f"cannot emit {e!r}")

    def gep(self, ptr: str, dt: str, index: str) -> str:
        return self.pure(f"getelementptr inbounds {LL[dt]}, ptr {ptr}, i64 {index}", "p")

    def load(self, ptr: str, storage: str, index: str) -> str:
        """Element `index` of a buffer, converted from its storage type to its compute type."""
        p = self.gep(ptr, storage, index)
        v = self.tmp("ld")
        self.emit(f"{v} = load {LL[storage]}, ptr {p}, align {_align(storage)}{self.access_tag()}")
        if storage == "b8":
            b = self.tmp("bool")
            self.emit(f"{b} = icmp ne i8 {v}, 0")
            return b
        if storage in _UNPACK:
            f = self.tmp("wide")
            self.emit(f"{f} = call float @{_UNPACK[storage]}({LL[storage]} {v})")
            return f
        if storage in SUB_BYTE_TYPES:
            return self.sub_byte(v, storage)
        return v

    def sub_byte(self, byte: str, storage: str) -> str:
        """A 4- or 2-bit integer in the low bits of an i8 as its 8-bit value: the high bits
        cleared (unsigned) or copies of its sign bit (signed), whatever they were."""
        v, unused = self.tmp("nib"), 8 - value_bits(storage)
        if is_unsigned(storage):
            self.emit(f"{v} = and i8 {byte}, {(1 << (8 - unused)) - 1}")
        else:
            up = self.tmp("up")
            self.emit(f"{up} = shl i8 {byte}, {unused}")
            self.emit(f"{v} = ashr i8 {up}, {unused}")
        return v

    def store(self, ptr: str, storage: str, index: str, value: str) -> None:
        """Store a compute-type value into a buffer, converting (rounding) to its storage type."""
        if storage == "b8":
            z = self.tmp("z")
            self.emit(f"{z} = zext i1 {value} to i8")
            value = z
        elif storage in _PACK:
            h = self.tmp("narrow")
            self.emit(f"{h} = call {LL[storage]} @{_PACK[storage]}(float {value})")
            value = h
        elif storage in SUB_BYTE_TYPES:  # its low bits, the rest clear (as ml_dtypes stores it)
            low = self.tmp("low")
            self.emit(f"{low} = and i8 {value}, {(1 << value_bits(storage)) - 1}")
            value = low
        p = self.gep(ptr, storage, index)
        self.emit(f"store {LL[storage]} {value}, ptr {p}, align {_align(storage)}{self.access_tag()}")

    def access_tag(self) -> str:
        return "" if self.access_group is None else f", !llvm.access.group {self.access_group}"

    def binop(self, e: Bin) -> str:
        dt = operand_type((e.a, e.b), self.dtype)
        a, b = self.value(e.a, dt), self.value(e.b, dt)
        t = LL[dt]
        if dt not in FLOAT_TYPES and e.op not in ("max", "min"):
            return self.pure(f"{self.int_opcode(e.op, dt)} {t} {a}, {b}", "x")
        v = self.tmp("x")
        if dt in FLOAT_TYPES:
            if e.op in ("max", "min"):
                self.float_max_min(e, a, b, v, t)
            elif e.op == "pow":
                self.emit(f"{v} = call {self.fmf} {t} @{self.intrinsic('pow', dt, 2)}({t} {a}, {t} {b})")
            else:
                # A division never carries reassoc: with it LLVM sinks a reciprocal taken once
                # into the loop that multiplies by it (x * (1 / s) -> x / s), a divide per
                # element where there was a multiply (a softmax's or a LayerNorm's last pass).
                flags = self.fmf.replace("reassoc ", "") if e.op == "div" else self.fmf
                self.emit(f"{v} = {_FBIN[e.op]} {flags} {t} {a}, {b}")
        else:
            c = self.tmp("c")
            pred = ("u" if is_unsigned(dt) else "s") + ("gt" if e.op == "max" else "lt")
            self.emit(f"{c} = icmp {pred} {t} {a}, {b}")
            self.emit(f"{v} = select i1 {c}, {t} {a}, {t} {b}")
        return v

    @staticmethod
    def int_opcode(op: str, dt: str) -> str:
        if op in ("div", "rem"):
            return ("u" if is_unsigned(dt) else "s") + _IBIN[op]
        if op == "shr":
            return "lshr" if is_unsigned(dt) else "ashr"
        if dt == "i64" and op in ("add", "sub", "mul"):
            return _IBIN[op] + " nsw"  # i64 is the index type: no-wrap lets LLVM reason about addresses
        return _IBIN[op]

    def float_max_min(self, e: Bin, a: str, b: str, v: str, t: str) -> None:
        """IEEE max/min that propagate NaN from either side, as onnxruntime does.
        `select (x > y), x, y` yields y when either is NaN: one vmaxps/vminps. With a constant
        (never NaN) operand that is all it takes, the constant in the first place; otherwise
        llvm.maximum/minimum, which propagate NaN and which the vectorizer knows as a
        reduction (a max over a whole tensor vectorizes)."""
        if not isinstance(e.a, Const) and not isinstance(e.b, Const):
            dt = next(k for k, ll in LL.items() if ll == t and k in FLOAT_TYPES)
            name = self.intrinsic("maximum" if e.op == "max" else "minimum", dt, 2)
            self.emit(f"{v} = call {t} @{name}({t} {a}, {t} {b})")
            return
        pred = "ogt" if e.op == "max" else "olt"
        if isinstance(e.b, Const):
            a, b = b, a
        c = self.tmp("c")
        self.emit(f"{c} = fcmp {pred} {t} {a}, {b}")
        self.emit(f"{v} = select i1 {c}, {t} {a}, {t} {b}")

    def cast(self, e: Cast) -> str:
        src, dst = self.dtype(e.a), e.dtype
        a = self.expr(e.a)
        if src == dst:
            return a
        v = self.tmp("cv")
        s, d = LL[src], LL[dst]
        if dst == "i1":
            zero = "0.0" if src in FLOAT_TYPES else "0"
            self.emit(f"{v} = {'fcmp une' if src in FLOAT_TYPES else 'icmp ne'} {s} {a}, {zero}")
        elif src in FLOAT_TYPES and dst in FLOAT_TYPES:
            self.emit(f"{v} = {'fpext' if bits(dst) > bits(src) else 'fptrunc'} {s} {a} to {d}")
        elif src in FLOAT_TYPES and _clamped_within(e.a, dst):
            # Already clamped to the type's range (a requantize): a plain conversion to the
            # width, frozen so a NaN that slipped through is some value, not poison.
            raw = self.tmp("cr")
            self.emit(f"{raw} = {'fptoui' if is_unsigned(dst) else 'fptosi'} {s} {a} to {d}")
            self.emit(f"{v} = freeze {d} {raw}")
        elif src in FLOAT_TYPES:
            # Kiln's answer where ONNX leaves one undefined (ir/casts.py): truncated,
            # saturated to 64 bits (NaN is 0), then the width's low bits.
            name = f"llvm.fptosi.sat.i64.{_FSUFFIX[src]}"
            self.decls.add(f"declare i64 @{name}({s})")
            wide = v if dst == "i64" else self.tmp("cw")
            if dst == "u64":  # from 2**63 up, uint64's own range
                signed, unsigned, big = self.tmp("cs"), self.tmp("cu"), self.tmp("cb")
                uname = f"llvm.fptoui.sat.i64.{_FSUFFIX[src]}"
                self.decls.add(f"declare i64 @{uname}({s})")
                self.emit(f"{signed} = call i64 @{name}({s} {a})")
                self.emit(f"{unsigned} = call i64 @{uname}({s} {a})")
                self.emit(f"{big} = fcmp oge {s} {a}, 0x43E0000000000000")
                self.emit(f"{v} = select i1 {big}, i64 {unsigned}, i64 {signed}")
                return v
            self.emit(f"{wide} = call i64 @{name}({s} {a})")
            if wide != v:
                self.emit(f"{v} = trunc i64 {wide} to {d}")
        elif dst in FLOAT_TYPES:
            op = "uitofp" if src == "i1" or is_unsigned(src) else "sitofp"
            self.emit(f"{v} = {op} {s} {a} to {d}")
        elif bits(dst) == bits(src):
            return a  # the same bits, another signedness
        elif bits(dst) < bits(src):
            self.emit(f"{v} = trunc {s} {a} to {d}")
        else:
            op = "zext" if src == "i1" or is_unsigned(src) else "sext"
            self.emit(f"{v} = {op} {s} {a} to {d}")
        return v

    def intrinsic(self, fn: str, dt: str, arity: int = 1) -> str:
        name = f"llvm.{fn}.{_FSUFFIX[dt]}"
        t = LL[dt]
        self.decls.add(f"declare {t} @{name}({', '.join([t] * arity)})")
        return name

    def libm(self, fn: str, dt: str) -> str:
        name = fn + ("f" if dt == "f32" else "")
        self.decls.add(f"declare {LL[dt]} @{name}({LL[dt]})")
        return name

    def call(self, e: Call) -> str:
        dt = "i1" if e.fn == "not" else operand_type(e.args, self.dtype)
        args = [self.value(a, dt) for a in e.args]
        v = self.tmp("f")
        fn, t = e.fn, LL[dt]
        if fn == "neg":
            self.emit(f"{v} = fneg {t} {args[0]}" if dt in FLOAT_TYPES else f"{v} = sub {t} 0, {args[0]}")
        elif fn == "not":
            self.emit(f"{v} = xor i1 {args[0]}, true")
        elif fn in _ROUNDINGS:  # to the precision of a narrower float
            h = self.tmp("narrow")
            pack, unpack, storage = _ROUNDINGS[fn]
            self.emit(f"{h} = call {LL[storage]} @{pack}(float {args[0]})")
            self.emit(f"{v} = call float @{unpack}({LL[storage]} {h})")
        elif fn in ("exp", "tanh", "erf") and dt == "f32":
            self.emit(f"{v} = call {self.fmf} float @kiln_{fn}(float {args[0]})")
        elif fn == "fmod":
            self.emit(f"{v} = frem {t} {args[0]}, {args[1]}")
        elif fn == "max_no_nan":  # one vmaxps: nnan and nsz drop llvm.maximum's fix-ups
            name = self.intrinsic("maximum", dt, 2)
            self.emit(f"{v} = call nnan {self.fmf} {t} @{name}({t} {args[0]}, {t} {args[1]})")
        elif fn in _INTRINSIC:
            params = ", ".join(f"{t} {a}" for a in args)
            self.emit(f"{v} = call {self.fmf} {t} @{self.intrinsic(_INTRINSIC[fn], dt, len(args))}({params})")
        else:  # trigonometry, and exp/tanh/erf of f64: the C library
            self.emit(f"{v} = call {t} @{self.libm(fn, dt)}({t} {args[0]})")
        return v

    # -- statements ----------------------------------------------------------------------
    def stmts(self, body) -> None:
        self.scopes.append({})
        for s in body:
            self.stmt(s)
        self.scopes.pop()

    def stmt(self, s) -> None:
        if isinstance(s, For) and not isinstance(s.extent, int):  # an extent known at run time
            end = self.expr(s.extent)
            if s.kind in ("masked", "forced_vector", "vector_masked") and self.vectorize:
                # Whole vectors, then the ragged end as one masked vector. Left to LLVM, the
                # remainder of a vector loop interleaved 4 deep ran as scalar code: all of a
                # 56-wide depthwise row (a MobileNet's 3x3 stride-2 convs at 3-5x their
                # static time).
                def whole_then_tail():
                    whole = self.int_op("and", end, -self.vw)
                    self.loop(s.var, 0, lambda: self.stmts(s.body), "run_time_whole", lo="0", hi=whole)
                    self.loop(s.var, 0, lambda: self.stmts(s.body), "run_time_tail", lo=whole, hi=end)
                if self.overlaps_last_vector(s):
                    self.when(self.int_op("icmp sge", end, self.vw), lambda: self.whole_then_overlap(s, end),
                              lambda: self.loop(s.var, 0, lambda: self.stmts(s.body), "run_time_tail", lo="0", hi=end))
                    return
                if s.kind == "vector_masked" and self.vw >= 16:
                    self.when(self.int_op("icmp slt", end, PREDICATED_ROW_VECTORS * self.vw),
                              lambda: self.loop(s.var, 0, lambda: self.stmts(s.body), "run_time_tail", lo="0", hi=end),
                              whole_then_tail)
                    return
                whole_then_tail()
            else:  # (LLVM vectorizes a "vectorize" loop with a remainder where it can)
                self.loop(s.var, 0, lambda: self.stmts(s.body), s.kind, lo="0", hi=end)
        elif isinstance(s, For):
            whole = s.extent - s.extent % self.vw
            if s.kind == "vector_masked" and self.vectorize and 0 < whole < s.extent:
                # The whole vectors run unmasked, then one masked remainder. A loop predicated
                # throughout recomputes its mask every iteration: without mask registers (AVX2,
                # NEON) it loads through it too (vmaskmovps; a 14-wide depthwise row ran 2.6x its
                # AVX-512 time), and with them (AVX-512) the mask's six instructions made a
                # 56-wide depthwise row 7% slower, a 3x3 stride-2 one at 28 wide 10%. (Without
                # mask registers a recomputable body's remainder is a whole vector instead.)
                self.loop(s.var, whole, lambda: self.stmts(s.body), "vector_only")
                if self.overlaps_last_vector(s):
                    self.last_vector(s, str(s.extent - self.vw))
                else:
                    self.loop(s.var, s.extent, lambda: self.stmts(s.body), s.kind, first=whole)
            else:
                self.loop(s.var, s.extent, lambda: self.stmts(s.body), s.kind)
        elif isinstance(s, Store):
            ptr, st = self.bufs[s.buf]
            value = self.value(s.value, compute_type(st))
            self.store(ptr, st, self.expr(s.index), value)
        elif isinstance(s, Let):
            self.bind(s.var, ("ssa", self.expr(s.value), self.dtype(s.value)))
        elif isinstance(s, Local):
            slot = f"%loc{len(self.allocas)}"
            self.allocas.append(f"{slot} = alloca {LL[s.dtype]}")
            self.emit(f"store {LL[s.dtype]} {self.value(s.init, s.dtype)}, ptr {slot}")
            self.bind(s.var, ("slot", slot, s.dtype))
        elif isinstance(s, Assign):
            kind, slot, dt = self.lookup(s.var)
            self.emit(f"store {LL[dt]} {self.value(s.value, dt)}, ptr {slot}")
        elif isinstance(s, If):
            self.if_(s)
        elif isinstance(s, Gemm):
            self.gemm(s)
        elif isinstance(s, WindowDot):
            self.window_dot(s)
        elif isinstance(s, TransposeBlock):
            self.transpose_block(s)
        elif isinstance(s, Deinterleave):
            self.deinterleave(s)
        else:
            raise TypeError(f"cannot emit {s!r}")

    def overlaps_last_vector(self, s: For) -> bool:
        """Whether a loop's ragged end runs as one whole vector overlapping the one before (its
        body recomputable: ir.loop.recomputable) rather than a masked vector: where there are
        no mask registers (AVX2, NEON), whose masked loads and stores are slow (vmaskmovps) or
        were scalar code: a depthwise conv's 14-wide rows, 384 channels, 3x3, x86-64-v3 code:
        0.039 -> 0.022 ms built for the size, 0.071 -> 0.030 over run-time sizes. With mask
        registers the masked vector is as fast or faster (AVX-512: 96 channels, stride 2, at
        112 x 112 0.150 ms masked, 0.188 overlapping)."""
        return self.vw < 16 and recomputable(s.body)

    def whole_then_overlap(self, s: For, end: str) -> None:
        """A recomputable loop (ir.loop.recomputable) of end >= vw iterations, end known at run
        time: its whole vectors, then iterations [end - vw, end) as one vector."""
        whole = self.int_op("and", end, -self.vw)
        self.loop(s.var, 0, lambda: self.stmts(s.body), "run_time_whole", lo="0", hi=whole)
        self.when(self.int_op("icmp ne", whole, end), lambda: self.last_vector(s, self.int_op("sub", end, self.vw)))

    def last_vector(self, s: For, first: str) -> None:
        """Iterations [first, first + vw) of loop s, as one vector."""
        lane = f"{s.var}.lane"

        def iteration():
            self.scopes.append({s.var: ("ssa", self.int_op("add nsw", first, self.lookup(lane)[1]), "i64")})
            self.stmts(s.body)
            self.scopes.pop()
        self.loop(lane, self.vw, iteration, "vector_only")

    def loop_metadata(self, kind: str, extent: int = 0) -> str:
        props = []
        if kind == "masked" and self.vectorize and extent % self.vw and extent < 2 * self.vw:
            # A short loop with a ragged end (a 28- or 7-wide output row) runs as masked
            # vectors rather than a vector and a scalar remainder of up to vw - 1 iterations.
            props.append('!{!"llvm.loop.vectorize.predicate.enable", i1 true}')
            # (fully unrolled before the vectorizer saw it, a 7-wide row became scalar code)
            props += ['!{!"llvm.loop.vectorize.enable", i1 true}', '!{!"llvm.loop.unroll.disable"}']
        if not self.vectorize:
            props += ['!{!"llvm.loop.vectorize.enable", i1 false}', '!{!"llvm.loop.unroll.disable"}']
        elif kind == "unroll":
            props.append('!{!"llvm.loop.unroll.full"}')
        elif kind == "reduce":  # (unrolled first, a short max reduction became a scalar chain)
            props += ['!{!"llvm.loop.vectorize.enable", i1 true}',
                      f'!{{!"llvm.loop.interleave.count", i32 {self.reduce_interleave}}}',
                      '!{!"llvm.loop.unroll.disable"}']
        elif kind in ("vector_only", "vector_masked", "forced_vector"):
            # (this loop, not the one around it once this is unrolled)
            props += ['!{!"llvm.loop.vectorize.enable", i1 true}', '!{!"llvm.loop.unroll.disable"}']
            if kind == "vector_masked" and extent % self.vw:
                props.append('!{!"llvm.loop.vectorize.predicate.enable", i1 true}')
        elif kind == "scalar":
            # (nor unrolled: LLVM unrolled a tile's write-back, its epilogue copied for each of
            # 14 rows; rolled, MobileNetV2 compiles in 2.2 s of worker time, not 3.6, ResNet-18
            # in 3.5, not 4.4; the modules' times moved within the noise: five CNNs and a
            # transformer, interleaved, -1 to +4% in one run, -1 to +1% in the next; 2026-12-07,
            # Emerald Rapids)
            props += ['!{!"llvm.loop.vectorize.enable", i1 false}', '!{!"llvm.loop.unroll.disable"}']
        elif kind == "rolled":
            props.append('!{!"llvm.loop.unroll.disable"}')
        elif kind == "independent":
            props += ['!{!"llvm.loop.vectorize.enable", i1 true}',
                      f'!{{!"llvm.loop.parallel_accesses", {self.access_group}}}']
        elif kind == "run_time_tail" and self.vw < 16:
            # (fewer than a vector, known at run time: without mask registers, a predicated
            # vector ends in vmaskmovps stores, microcoded on AMD cores; scalar code is cheaper)
            props += ['!{!"llvm.loop.vectorize.enable", i1 false}', '!{!"llvm.loop.unroll.disable"}']
        elif kind in ("run_time_whole", "run_time_tail"):  # (a trip count that is whole vectors, or < one)
            props += ['!{!"llvm.loop.vectorize.enable", i1 true}', '!{!"llvm.loop.interleave.count", i32 1}',
                      '!{!"llvm.loop.unroll.disable"}']
            if kind == "run_time_tail":
                props.append('!{!"llvm.loop.vectorize.predicate.enable", i1 true}')
        if not props:
            return ""
        ids = []
        for p in props:
            ids.append(f"!{len(self.meta) + 1000}")
            self.meta.append(f"{ids[-1]} = {p}")
        self.n += 1
        loop_id = f"!{len(self.meta) + 1000}"
        self.meta.append(f"{loop_id} = distinct !{{{loop_id}, {', '.join(ids)}}}")
        return f", !llvm.loop {loop_id}"

    def loop(self, var: str, extent: int, body, kind: str = "serial", lo: str | None = None,
             hi: str | None = None, first: int = 0) -> None:
        """Iterations [first, extent), or with lo and hi (i64 values) [lo, hi), which may be empty."""
        if lo is None and extent <= first:
            return
        self.n += 1
        head, latch, exit_ = f"L{self.n}.body", f"L{self.n}.latch", f"L{self.n}.exit"
        pred = self.block
        count = extent - first if lo is None else 0  # (known at compile time)
        if lo is None:
            start, end = str(first), str(extent)
            self.emit(f"br label %{head}")
        else:
            start, end = lo, hi
            some = self.tmp("some")
            self.emit(f"{some} = icmp slt i64 {lo}, {hi}")
            self.emit(f"br i1 {some}, label %{head}, label %{exit_}")
        self.label(head)
        iv = self.tmp(var.replace(".", "_") + "_")
        nxt = self.tmp("next")
        self.emit(f"{iv} = phi i64 [{start}, %{pred}], [{nxt}, %{latch}]")
        self.scopes.append({var: ("ssa", iv, "i64")})
        outer_group = self.access_group
        if kind == "independent":
            self.access_group = f"!{len(self.meta) + 1000}"
            self.meta.append(f"{self.access_group} = distinct !{{}}")
        body()
        self.scopes.pop()
        self.emit(f"br label %{latch}")
        self.label(latch)
        self.emit(f"{nxt} = add nuw nsw i64 {iv}, 1")
        c = self.tmp("cond")
        self.emit(f"{c} = icmp ult i64 {nxt}, {end}")
        self.emit(f"br i1 {c}, label %{head}, label %{exit_}{self.loop_metadata(kind, count)}")
        self.access_group = outer_group
        self.label(exit_)

    def switch(self, value: str, cases: dict) -> None:
        """Run cases[v]() where the i64 value is v (nothing for other values)."""
        self.n += 1
        end, labels = f"S{self.n}.end", {v: f"S{self.n}.case{v}" for v in cases}
        targets = " ".join(f"i64 {v}, label %{labels[v]}" for v in cases)
        self.emit(f"switch i64 {value}, label %{end} [ {targets} ]")
        for v, body in cases.items():
            self.label(labels[v])
            body()
            self.emit(f"br label %{end}")
        self.label(end)

    def when(self, cond: str, body, otherwise=None) -> None:
        """Run body where the i1 value cond holds (else otherwise, if given)."""
        self.n += 1
        then, no, end = f"W{self.n}.then", f"W{self.n}.else", f"W{self.n}.end"
        self.emit(f"br i1 {cond}, label %{then}, label %{no if otherwise else end}")
        for label, run in ((then, body), (no, otherwise)):
            if run:
                self.label(label)
                run()
                self.emit(f"br label %{end}")
        self.label(end)

    def int_op(self, op: str, a: str, b) -> str:
        """One i64 instruction (add, sub, mul, udiv, icmp ..., smin, smax) on values or literals."""
        if op in ("smin", "smax"):
            self.decls.add(f"declare i64 @llvm.{op}.i64(i64, i64)")
            return self.pure(f"call i64 @llvm.{op}.i64(i64 {a}, i64 {b})", "x")
        return self.pure(f"{op} i64 {a}, {b}", "x")

    def if_(self, s: If, then_body=None) -> None:
        """then_body: emits the then branch in place of s.then (a guarded phase's range)."""
        self.n += 1
        then, else_, end = f"I{self.n}.then", f"I{self.n}.else", f"I{self.n}.end"
        c = self.expr(s.cond)
        self.emit(f"br i1 {c}, label %{then}, label %{else_}")
        self.label(then)
        if then_body:
            then_body()
        else:
            self.stmts(s.then)
        self.emit(f"br label %{end}")
        self.label(else_)
        self.stmts(s.orelse)
        self.emit(f"br label %{end}")
        self.label(end)

    # -- the function --------------------------------------------------------------------
    def function(self) -> str:
        """`void symbol(buffers..., i64 phase, i64 lo, i64 hi)`: runs one phase of the kernel
        (ir.loop, "Threads"), a parallel one over [lo, hi) of its parts."""
        prelude, parts = phases(self.k.body)
        self.scopes.append({})
        for s in prelude:
            self.stmt(s)
        if len(parts) == 1:
            self.phase(parts[0])
        else:
            cases = " ".join(f"i64 {i}, label %P{i}" for i in range(1, len(parts)))
            self.emit(f"switch i64 %phase, label %P0 [ {cases} ]")
            for i, part in enumerate(parts):
                self.label(f"P{i}")
                self.phase(part)
                self.emit("br label %done")
            self.label("done")
        self.scopes.pop()
        params = ", ".join([f"ptr noalias {p}" for p, _ in self.bufs.values()] + ["i64 %phase", "i64 %lo", "i64 %hi"])
        head = [f"define void @{self.symbol}({params}) #0 {{", "entry:"]
        head += ["  " + a for a in self.allocas]
        for k, value in sorted(self.symbol_values.items()):
            at = f"%sym{k}.at"
            head += [f"  {at} = getelementptr inbounds i64, ptr {self.bufs[SYMBOLS][0]}, i64 {k}",
                     f"  {value} = load i64, ptr {at}, align 8"]
        return "\n".join(head + self.lines + ["  ret void", "}"])

    def phase(self, part) -> None:
        if isinstance(part, tuple):
            self.stmts(part)
        elif isinstance(part, If):  # (a guarded phase: the entry tests it too)
            self.if_(part, lambda: self.phase(part.then[0]))
        elif isinstance(part, Gemm):
            self.gemm(part, "%lo", "%hi")
        elif part.parallel:
            self.loop(part.var, part.extent, lambda: self.stmts(part.body), part.kind, lo="%lo", hi="%hi")
        else:
            self.stmt(part)


def kernel_to_llvm_ir(kernel: Kernel, symbol: str, triple: str, cpu: str, features: str) -> str:
    fe = FunctionEmitter(kernel, symbol, frozenset(byte_dot_widths(features)))
    body = fe.function()
    width = 512 if fe.vw >= 16 else 256
    # Over sizes known at run time, LLVM would turn a row's copy or fill into a call of memcpy
    # or memset (with a compile-time length it inlines them): a depthwise conv's bordered copy
    # called them for every row of every channel, 1.5x the kernel's static time at 56 x 56.
    calls = ' "no-builtin-memcpy" "no-builtin-memset" "no-builtin-memmove"' if fe.reads_symbols else ""
    attrs = (f'attributes #0 = {{ nounwind "prefer-vector-width"="{width}" '
             f'"target-cpu"="{cpu}" "target-features"="{features}"{calls} }}')
    math_attrs = attrs.replace("#0", "#1")
    decls = sorted(set(MATH_DECLS.strip().splitlines()) | fe.decls)
    conversions = minifloat_conversions(body + "".join(fe.functions))  # (those the kernel calls)
    parts = [f'target triple = "{triple}"', *decls, math_lib(has_f16_conversions(triple, features)), *conversions, *fe.functions,
             body, attrs, math_attrs.replace("nounwind", "nounwind alwaysinline"),
             attrs.replace("#0", "#2").replace("nounwind", "nounwind noinline"), *fe.meta]
    return "\n".join(parts) + "\n"
