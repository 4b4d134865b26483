"""Loop-nest kernel -> LLVM IR text.

Loops are emitted bottom-tested (every extent is static and positive; a phase's range
[lo, hi), known only at run time, is tested first: ir/loop.py, "Threads"), buffers are
`noalias` pointers, float math carries reassoc/contract flags so reductions vectorize, and
exp/tanh/erf are inlined polynomial and rational approximations rather than libm calls so
loops using them vectorize too. The Gemm statement becomes explicit vector code: an mr x nr register tile of
<vw x float> accumulators fed by FMAs, written to a stack tile, then the epilogue runs over
the tile as ordinary (vectorizable) loops.
"""
from __future__ import annotations

import math
import struct

from ..artifacts.cpu_features import byte_dot_widths
from ..ir.loop import (FLOAT_GEMM_KINDS, FLOAT_TYPES, SMALL_FLOAT_TYPES, SUB_BYTE_TYPES, TRANSPOSE_LANES, WINDOW_DOT_LANES, SYMBOLS,
                      Assign, Bin, Call, Cast, Cmp, Const, Deinterleave, For, Gemm, If, Kernel, Let, Load, Local, Select,
                      Store, TransposeBlock, Var, WindowDot, bits, called_functions, compute_type, highest,
                      is_unsigned, lowest, operand_type, phases, recomputable, value_bits)
from ..ir.minifloats import E8M0, E8M0_ROUNDINGS, MINIFLOATS, e8m0_rounding
from ..ir.schedule import PANEL_CHUNK_KIB, REDUCE_INTERLEAVE
from . import tile_gemm
from .minifloat_ir import e8m0_encoder_name, from_float_name, minifloat_conversions, to_float_name

# LLVM's type for each loop-IR type. Integers are sign-less in LLVM: signedness picks the
# instruction. f16 and bf16 are stored as i16 and converted in software (see _math_lib), so
# no target needs F16C or AVX512-BF16 and no libgcc helper is linked.
LL = {"f32": "float", "f64": "double", "i1": "i1", "b8": "i8", "f16": "i16", "bf16": "i16",
      **{t: "i8" for t in SUB_BYTE_TYPES + SMALL_FLOAT_TYPES},
      **{f"{s}{w}": f"i{w}" for s in "iu" for w in (8, 16, 32, 64)}}
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


def _literal(value, t: str) -> str:
    """A constant of loop-IR type t as LLVM writes it."""
    if t == "f32":
        return _fconst(value)
    if t == "f64":
        return f"0x{struct.unpack('<Q', struct.pack('<d', float(value)))[0]:016X}"
    if t == "i1":
        return "true" if value else "false"
    w = bits(t)
    v = int(value) % (1 << w)  # two's complement: LLVM reads integer literals as signed
    return str(v - (1 << w) if v >= 1 << (w - 1) else v)


# Vectorizable math, inlined into every use (_math_lib): exp by a reduction to |r| <= ln 2 / 2
# and a polynomial, tanh and erf as rational functions.
def _poly(acc_name: str, x: str, coeffs, lines: list) -> str:
    """Horner evaluation of coeffs (highest degree first) at %x; returns the result name.
    Each step is one fused multiply-add (`contract`): half the instructions, one rounding."""
    cur = _fconst(coeffs[0])
    for i, c in enumerate(coeffs[1:]):
        lines.append(f"  %{acc_name}m{i} = fmul contract float {cur}, %{x}")
        lines.append(f"  %{acc_name}a{i} = fadd contract float %{acc_name}m{i}, {_fconst(c)}")
        cur = f"%{acc_name}a{i}"
    return cur


def _clamp(x: str, lo: float, hi: float, out: str, lines: list) -> None:
    """%out = %x held to [lo, hi], NaN kept: x is each select's second operand, as it is
    vmaxps's and vminps's, which return their second operand where either is NaN."""
    lines += [f"  %{out}.u = fcmp olt float %{x}, {_fconst(lo)}",
              f"  %{out}.l = select i1 %{out}.u, float {_fconst(lo)}, float %{x}",
              f"  %{out}.o = fcmp ogt float %{out}.l, {_fconst(hi)}",
              f"  %{out} = select i1 %{out}.o, float {_fconst(hi)}, float %{out}.l"]


def _odd_rational(name: str, limit: float, num, den) -> list:
    """f(x) = x P(x^2) / Q(x^2) on x held to [-limit, limit] (coefficients highest degree
    first): FMAs and one divide, accurate relative to f near 0 where 1 - something would
    cancel, and NaN in, NaN out."""
    lines = [f"define internal float @kiln_{name}(float %x) #1 {{"]
    _clamp("x", -limit, limit, "c", lines)
    lines.append("  %x2 = fmul float %c, %c")
    p = _poly("p", "x2", num, lines)
    q = _poly("q", "x2", den, lines)
    return lines + [f"  %px = fmul float {p}, %c", f"  %y = fdiv float %px, {q}", "  ret float %y", "}"]


def _math_lib() -> str:
    # exp(x) = 2^n e^r, n = round(x / ln 2), |r| <= ln 2 / 2. n is rounded by adding 1.5 * 2^23
    # (whose ulp is 1), so n also stands in t's low mantissa bits: shifted up 23 it is the
    # exponent field, no round or convert instruction. e^r is a degree-6 polynomial fitted
    # for least maximum relative error on that range (1.9e-9, far below float32's 6e-8), as
    # one Horner chain of FMAs, its coefficients doubled: the result is 2 e^r times 2^(n-1),
    # so exp(89) and +inf overflow to +inf while 2^(n-1) stays a normal float up to n = 128.
    # From n = -126 (x below -86.99, exp under 1.8e-38) the exponent field is 0 and the
    # result flushes to +0. Rel. error 8.8e-8 against exp in double (Cephes' degree 7: 7.4e-8);
    # the FMA the lower degree saves is 8% of an exp-bound kernel on x86-64-v3 (a 1x1 conv's
    # 1.2M outputs through exp 0.86 -> 0.79 ms; AVX-512 0.64 -> 0.58). 15 instructions a
    # vector where roundeven and fptosi made 22 (SiLU on those outputs 474 -> 434 us on
    # AVX-512).
    magic = 12582912.0  # 1.5 * 2^23
    exp = ["define internal float @kiln_exp(float %x) #1 {"]
    _clamp("x", -87.33, 89.0, "c", exp)
    exp += [f"  %cl = fmul contract float %c, {_fconst(1.4426950408889634)}",
            f"  %t = fadd contract float %cl, {_fconst(magic)}",
            f"  %n = fsub float %t, {_fconst(magic)}",
            f"  %h = fmul contract float %n, {_fconst(0.693359375)}",
            "  %r0 = fsub contract float %c, %h",
            f"  %l = fmul contract float %n, {_fconst(-2.12194440e-4)}",
            "  %r = fsub contract float %r0, %l"]
    p = _poly("p", "r", [2 * c for c in (1.3836842563e-03, 8.3748162543e-03, 4.1668225659e-02, 1.6666420165e-01,
                                          4.9999992079e-01, 1.0000000363e+00, 1.0000000006e+00)], exp)
    exp += ["  %tb = bitcast float %t to i32", "  %sh = shl i32 %tb, 23", f"  %e = add i32 %sh, {126 << 23}",
            "  %s = bitcast i32 %e to float", f"  %y = fmul float {p}, %s", "  ret float %y", "}"]
    # tanh and erf as odd rational functions with the minimax coefficients Eigen and XLA use.
    # tanh on [-7.9053, 7.9053] (beyond, tanh is +-1 in float32; at the limit this is 1 - 6e-8):
    # error 2.7e-7, relative as well, where 1 - 2 / (exp(2x) + 1) lost 0.14% of tanh(x) near
    # 0; and no exp. erf on [-4, 4] (erf(4) is 1 in float32): abs. error 4.2e-7, relative
    # 2.3e-7 near 0, where Abramowitz-Stegun 7.1.26 lost 1% to 1 - q exp(-x^2) and took an
    # exp as well (GELU's epilogue cost its GEMM 40% more); held to [-1, 1].
    tanh = _odd_rational("tanh", 7.90531110763549805,
                         [-2.76076847742355e-16, 2.00018790482477e-13, -8.60467152213735e-11,
                          5.12229709037114e-08, 1.48572235717979e-05, 6.37261928875436e-04,
                          4.89352455891786e-03],
                         [1.19825839466702e-06, 1.18534705686654e-04, 2.26843463243900e-03,
                          4.89352518554385e-03])
    erf = _odd_rational("erf_unbounded", 4.0,
                        [-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06,
                         -5.69250639462346e-05, -7.34990630326855e-04, -2.95459980854025e-03,
                         -1.60960333262415e-02],
                        [-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03,
                         -7.37332916720468e-03, -1.42647390514189e-02])
    erf += ["define internal float @kiln_erf(float %x) #1 {",
            "  %r = call float @kiln_erf_unbounded(float %x)"]
    _clamp("r", -1.0, 1.0, "y", erf)
    erf += ["  ret float %y", "}"]
    return "\n".join(exp + tanh + erf + _half_conversions())


# Software conversions between f32 and the 16-bit floats, branch-free so loops using them
# vectorize. f16 -> f32 is exact: the exponent is rebiased, Inf/NaN get the f32 exponent,
# and denormals are normalized by one float subtraction. f32 -> f16 rounds to nearest even
# (F. Giesen's float_to_half_fast3_rtne): overflow to Inf, NaN to a quiet NaN, denormals by
# one float addition whose hardware rounding is the wanted one. bf16 is the top half of an
# f32: rounding adds 0x7fff plus the kept part's lowest bit; NaN stays a quiet NaN.
def _half_conversions() -> list:
    return [
        "define internal float @kiln_h2f(i16 %h) #1 {",
        "  %w = zext i16 %h to i32", "  %s = and i32 %w, 32768", "  %sign = shl i32 %s, 16",
        "  %em = and i32 %w, 32767", "  %o0 = shl i32 %em, 13", "  %e = and i32 %o0, 260046848",
        "  %o1 = add i32 %o0, 939524096", "  %o2 = add i32 %o1, 939524096", "  %o3 = add i32 %o1, 8388608",
        "  %f3 = bitcast i32 %o3 to float", f"  %d = fsub float %f3, {_fconst(2.0 ** -14)}",
        "  %db = bitcast float %d to i32", "  %special = icmp eq i32 %e, 260046848", "  %den = icmp eq i32 %e, 0",
        "  %r1 = select i1 %special, i32 %o2, i32 %o1", "  %r2 = select i1 %den, i32 %db, i32 %r1",
        "  %r = or i32 %r2, %sign", "  %y = bitcast i32 %r to float", "  ret float %y", "}",
        "define internal i16 @kiln_f2h(float %f) #1 {",
        "  %u = bitcast float %f to i32", "  %sign = and i32 %u, -2147483648", "  %a = xor i32 %u, %sign",
        "  %big = icmp uge i32 %a, 1199570944", "  %nan = icmp ugt i32 %a, 2139095040",
        "  %bigv = select i1 %nan, i32 32256, i32 31744",
        "  %small = icmp ult i32 %a, 947912704", "  %af = bitcast i32 %a to float",
        f"  %ds = fadd float %af, {_fconst(0.5)}", "  %dsb = bitcast float %ds to i32",
        "  %smallv = sub i32 %dsb, 1056964608",
        "  %m = lshr i32 %a, 13", "  %odd = and i32 %m, 1", "  %n1 = add i32 %a, -939520001", "  %n2 = add i32 %n1, %odd",
        "  %normv = lshr i32 %n2, 13",
        "  %v1 = select i1 %small, i32 %smallv, i32 %normv", "  %v2 = select i1 %big, i32 %bigv, i32 %v1",
        "  %sh = lshr i32 %sign, 16", "  %v3 = or i32 %v2, %sh", "  %r = trunc i32 %v3 to i16", "  ret i16 %r", "}",
        "define internal float @kiln_bf2f(i16 %h) #1 {",
        "  %w = zext i16 %h to i32", "  %s = shl i32 %w, 16", "  %y = bitcast i32 %s to float", "  ret float %y", "}",
        "define internal i16 @kiln_f2bf(float %f) #1 {",
        "  %u = bitcast float %f to i32", "  %top = lshr i32 %u, 16", "  %lsb = and i32 %top, 1",
        "  %r0 = add i32 %u, 32767", "  %r1 = add i32 %r0, %lsb", "  %rn = lshr i32 %r1, 16",
        "  %nan = fcmp uno float %f, 0.0", "  %q = or i32 %top, 64", "  %v = select i1 %nan, i32 %q, i32 %rn",
        "  %r = trunc i32 %v to i16", "  ret i16 %r", "}",
    ]


# What the math library above calls; a kernel's own calls are declared as it emits them.
_DECLS = """
declare float @llvm.maxnum.f32(float, float)
declare float @llvm.minnum.f32(float, float)
declare float @llvm.roundeven.f32(float)
declare float @llvm.fabs.f32(float)
declare float @llvm.copysign.f32(float, float)
"""


def _fconst(v: float) -> str:
    """A float constant as LLVM wants it: the f32 value, printed as the bits of a double."""
    v = float(v)
    if v == v and abs(v) > 3.4028234663852886e38:
        v = math.copysign(math.inf, v)
    f32 = struct.unpack("<f", struct.pack("<f", v))[0]
    return f"0x{struct.unpack('<Q', struct.pack('<d', f32))[0]:016X}"


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


# Packed B larger than this (past L2) is prefetched into L2 as the micro-kernel runs: the
# next panel where a panel is at most PREFETCH_NEXT_PANEL_BYTES, else PREFETCH_K_STEPS
# ahead in the panel. Measured on ResNet-50/18, ViT and BERT: their 7x7-stage convs 1.36 ->
# 0.91 ms (the 2048-wide downsample), 0.64 -> 0.46 (1x1), 1.39 -> 1.08-1.10 (3x3, 512 wide);
# from 512 KiB rather than 1 MiB, MobileNetV3's 960-wide 1x1 convs at 7x7 0.10 -> 0.075 ms.
PREFETCH_B_BYTES = 512 * 1024
PREFETCH_NEXT_PANEL_BYTES = 256 * 1024
PREFETCH_K_STEPS = 64
# Only the first row block's pass over B misses L2; every later block's prefetches are
# instructions spent for nothing. Past this many row blocks they cost more than the first
# pass gains: on x86-64-v3 (an instruction in every 12 FMAs) ResNet's 3x3 128-channel conv at
# 28x28 (131 blocks of 6 pixels) 2.13 -> 2.05 ms without; level at 14x14 (33 blocks); its
# 7x7-stage layers (9 blocks) keep theirs (512-channel 3x3 2.13 ms without, 2.08 with).
PREFETCH_MAX_ROW_BLOCKS = 32


def _row_blocks(g: Gemm) -> int:
    """A GEMM's row blocks (a run-time m counts as few: a prefill's rows may well be)."""
    return g.m // g.mr if isinstance(g.m, int) else 0


# A GEMM whose B is read in place (a 1x1 conv's input planes) reads, at each k step, a line of
# another plane: MobileNetV2's 144 -> 24 projection streams 144 planes at once, more than the
# hardware prefetcher follows. Where B is past L2 (PREFETCH_B_BYTES), the micro-kernel fetches
# each k step's lines of the panel PREFETCH_IN_PLACE_PANELS_AHEAD ahead into L2 (as many row
# blocks as packed B's prefetch allows). Built both ways and timed interleaved, 1 thread,
# AVX-512: 96 -> 24 at 128 x 128 alone 1.47 -> 0.76 ms (2 to 16 panels ahead alike; 1 ahead,
# 2.2 ms, slower than none); in MobileNetV2 at 512 x 512, 32 -> 16 at 256 x 256 1.33 -> 0.80
# ms, 144 -> 24 at 128 x 128 1.52 -> 1.13, the 16 -> 96 expansion at 256 x 256 2.94 -> 2.66.
PREFETCH_IN_PLACE_PANELS_AHEAD = 4


def streams_b_in_place(g: Gemm) -> bool:
    """Whether the micro-kernel prefetches B read in place (see PREFETCH_IN_PLACE_PANELS_AHEAD):
    over sizes known at run time, where B at its bound would."""
    n = g.n if isinstance(g.n, int) else g.n_bound
    return g.in_place_b and n > g.nr and g.k * n * 4 > PREFETCH_B_BYTES and _row_blocks(g) <= PREFETCH_MAX_ROW_BLOCKS


# A register tile needs this many accumulators (FMA latency 4 x 2 FMA ports) for its k loop
# to run at the FMAs' rate; one of fewer waits on each sum. Where an output row's last block
# (Gemm.a_rows) would have fewer, it shares the last whole block's rows: 71 = 4 x 14 + 8 + 7.
MIN_TILE_ACCUMULATORS = 8


# vpdpbusd by vector width (LLVM selects the VEX-encoded AVX-VNNI form for the 256-bit one
# where the target has AVX-VNNI and not AVX-512 VL).
VPDPBUSD = {16: "llvm.x86.avx512.vpdpbusd.512", 8: "llvm.x86.avx512.vpdpbusd.256"}


MASKED_SUFFIX = {"float": "f32", "i32": "i32"}  # llvm.masked.load/store's name for a vector's elements

# With mask registers, a vector_masked loop of run-time length shorter than this many vectors
# runs predicated throughout (its mask computed per vector): as whole vectors then a masked
# tail, two loops' setup cost more than the row (depthwise convs over run-time sizes, against
# their static time: 144 x 56 x 56 stride 2 1.63 -> 1.43x, 960 x 7 x 7 2.29 -> 1.86x). From 64
# wide the two loops win (a 224-wide row: 7% faster than predicated throughout).
PREDICATED_ROW_VECTORS = 4


def first_lanes(lanes: int, count: int) -> str:
    """A constant <lanes x i1> mask with the first `count` lanes on."""
    return f"<{lanes} x i1> <" + ", ".join(f"i1 {'true' if i < count else 'false'}" for i in range(lanes)) + ">"


class FunctionEmitter:
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
            return _literal(e.value, want or e.dtype)
        return self.expr(e)

    def expr(self, e) -> str:
        if isinstance(e, Const):
            return _literal(e.value, e.dtype)
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

    # -- the GEMM micro-kernel -----------------------------------------------------------
    def gemm(self, g: Gemm, lo: str | None = None, hi: str | None = None) -> None:
        """The whole GEMM, or with lo and hi (a phase's range) its row blocks or column panels
        [lo, hi) as `g.split` says; the last block or panel may be partial. On tiles, its
        blocks configure them and it releases them when it ends."""
        self.gemm_blocks(g, lo, hi)
        if g.tiles:
            tile_gemm.release(self)

    def gemm_blocks(self, g: Gemm, lo: str | None, hi: str | None) -> None:
        vw, nr, mr = self.vw, g.nr, g.mr
        if nr % vw:
            raise ValueError(f"gemm panel width {nr} is not a multiple of the vector width {vw}")
        elt = "float" if g.kind in FLOAT_GEMM_KINDS else "i32"
        vt = f"<{vw} x {elt}>"
        if g.kind == "f32":
            self.decls.add(f"declare {vt} @llvm.fma.v{vw}f32({vt}, {vt}, {vt})")
        elif g.b_words:
            if vw != 8:
                raise ValueError(f"gemm with B in 16-bit pairs at vector width {vw}: AVX2's vpmaddwd is 8 lanes")
            self.decls.add("declare <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16>, <16 x i16>)")
        elif g.tiles:
            self.decls |= tile_gemm.declarations(g)
        elif vw in self.dot_widths:
            self.decls.add(f"declare {vt} @{VPDPBUSD[vw]}({vt}, {vt}, {vt})")
        tile = f"%tile{len(self.allocas)}"
        self.allocas.append(f"{tile} = alloca [{self.tile_rows(g) * nr} x {elt}], align 64")
        a_ptr = self.bufs[g.a_buf][0]
        b_ptr, _ = self.bufs[g.b_buf]
        a_off, b_off = self.expr(g.a_off), self.expr(g.b_off)
        runtime_n = not isinstance(g.n, int)  # (B read in place: a run-time count of pixels)
        if runtime_n:  # whole panels, then one of the run-time count of columns left, if any
            n = self.expr(g.n)
            full_panels, last_cols = self.int_op("udiv", n, nr), self.int_op("urem", n, nr)
            some_left = self.int_op("icmp ne", last_cols, 0)
        else:
            full_panels, last_cols = divmod(g.n, nr)
        runtime_m = not isinstance(g.m, int)
        full_blocks, last_rows = (self.int_op("udiv", self.expr(g.m), mr), None) if runtime_m else divmod(g.m, mr)
        # B in chunks of panels that stay in L2 (each k step of a panel is nr 4-byte lanes).
        chunk = max(1, self.panel_chunk_bytes // (g.k * nr * 4))
        rows_range = lo is not None and g.split == "m"

        # Row blocks outside, panels inside: the block's A rows (k-major in conv) stay in
        # cache while the panels of B stream past them; when B outgrows L2, every row block
        # runs over one L2-sized chunk of panels before the next chunk is read.
        # `panels` is (first, count) or, for a range known at run time, (first, end) values;
        # `partial` says whether the partial last panel follows (True, False or an i1 value).
        # `valid`: a run-time count of the tile's rows that are the GEMM's (left_over_rows).
        def block(m0: str, rows: int, panels: tuple, partial, valid: str | None = None) -> None:
            if g.tiles:  # (the tile shapes of this block's rows, once for its panels)
                tile_gemm.configure(self, g, rows)

            def panel(p: str, cols: int) -> None:
                pb = self.mul_const(p, nr if g.in_place_b else g.k * nr * (2 if g.b_words else 1))
                bp = self.tmp("bp")
                self.emit(f"{bp} = add nsw i64 {pb}, {b_off}")
                if g.tiles:
                    tile_gemm.tile_microkernel(self, g, a_ptr, a_off, b_ptr, bp, m0, rows, tile, vt)
                elif self.outline_tiles(g):
                    self.outlined_microkernel(g, a_off, bp, m0, rows, vt, tile, cols, valid)
                else:
                    self.microkernel(g, a_ptr, a_off, b_ptr, bp, m0, rows, vt, tile, cols, valid)
                self.writeback(g, tile, m0, p, rows, cols, valid)

            first, count = panels
            pan = f"{g.n_var}.pan"
            if not isinstance(count, int):
                self.loop(pan, 0, lambda: panel(self.lookup(pan)[1], nr), lo=first, hi=count)
            elif count:
                self.loop(pan, count, lambda: panel(
                    self.lookup(pan)[1] if first == 0 else self.int_op("add nsw", self.lookup(pan)[1], first), nr))
            if last_cols and partial is True:
                panel(str(full_panels), last_cols)
            elif last_cols and partial:
                self.when(partial, lambda: panel(str(full_panels), last_cols))

        def by_blocks(panels: tuple, partial) -> None:
            blk = f"{g.m_var}.blk"
            run = lambda: block(self.mul_const(self.lookup(blk)[1], mr), mr, panels, partial)  # noqa: E731
            if runtime_m:  # (threads dividing by row blocks: [lo, hi), the last one partial)
                self.loop(blk, 0, run, lo=lo if rows_range else "0",
                          hi=self.int_op("smin", hi, full_blocks) if rows_range else full_blocks)
                rest = lambda: left_over_rows(self.mul_const(full_blocks, mr),  # noqa: E731
                                              self.int_op("urem", self.expr(g.m), mr), panels, partial)
                if rows_range:
                    self.when(self.int_op("icmp sgt", hi, full_blocks), rest)
                else:
                    rest()
                return
            if not rows_range:
                if full_blocks:
                    self.loop(blk, full_blocks, run)
                if last_rows:
                    block(str(full_blocks * mr), last_rows, panels, partial)
                return
            if full_blocks:
                self.loop(blk, 0, run, lo=lo, hi=self.int_op("smin", hi, full_blocks))
            if last_rows:
                self.when(self.int_op("icmp sgt", hi, full_blocks),
                          lambda: block(str(full_blocks * mr), last_rows, panels, partial))

        def by_rows(panels: tuple, partial) -> None:
            """With a_rows: each row's whole blocks, then its shorter ones; rows [lo, hi) where
            threads divide by rows."""
            if not isinstance(g.a_rows, int):
                return by_run_time_rows(panels, partial)
            full, last = divmod(g.a_rows, mr)
            tail = [last] if last else []
            if full and 0 < last * (g.nr // vw) < MIN_TILE_ACCUMULATORS and not g.tiles:
                # (a last block too short to hide the FMA latency shares the last whole one's rows)
                full, tail = full - 1, [(mr + last + 1) // 2, (mr + last) // 2]
            row, blk = f"{g.m_var}.row", f"{g.m_var}.blk"

            def one_row():
                first = self.mul_const(self.lookup(row)[1], g.a_rows)
                if full:
                    self.loop(blk, full, lambda: block(
                        self.int_op("add nsw", first, self.mul_const(self.lookup(blk)[1], mr)), mr, panels, partial))
                done = full * mr
                for rows in tail:
                    block(self.int_op("add nsw", first, done), rows, panels, partial)
                    done += rows
            if rows_range:
                self.loop(row, 0, one_row, lo=lo, hi=hi)
            else:
                self.loop(row, g.m // g.a_rows, one_row)

        def by_run_time_rows(panels: tuple, partial) -> None:
            """by_rows over rows of a length known at run time: each row's whole blocks, then
            its last rows (left_over_rows)."""
            width, row, blk = self.expr(g.a_rows), f"{g.m_var}.row", f"{g.m_var}.blk"
            full = self.int_op("udiv", width, mr)

            def one_row():
                first = self.int_op("mul nsw", self.lookup(row)[1], width)
                self.loop(blk, 0, lambda: block(
                    self.int_op("add nsw", first, self.mul_const(self.lookup(blk)[1], mr)), mr, panels, partial),
                    lo="0", hi=full)
                left_over_rows(self.int_op("add nsw", first, self.mul_const(full, mr)),
                               self.int_op("urem", width, mr), panels, partial)
            if rows_range:
                self.loop(row, 0, one_row, lo=lo, hi=hi)
            else:
                self.loop(row, 0, one_row, lo="0", hi=self.int_op("udiv", self.expr(g.m), width))

        def left_over_rows(base: str, left: str, panels: tuple, partial) -> None:
            """The last rows < mr, known at run time: one tile of that many rows where they
            are at most half a tile, else two tiles of half of them each (rounded up, then
            down), each chosen by a switch. (As blocks of the powers of two in their count, a
            7-wide output row was tiles of 4, 2 and 1 rows, each k loop waiting on FMA
            latency: a ResNet's 7 x 7 stage over run-time sizes ran at 1.6x its static time.
            A tile for every count up to mr - 1 came within 1.2x too, but its 13 tiles on
            AVX-512 took a ResNet-18's build from 4.5 to 10.9 s.) A count from 3 up that is
            too small to fill MIN_TILE_ACCUMULATORS runs in the least tile that does, its rows
            past the count reading the last real row and stored nowhere, so LLVM compiles
            fewer tiles (a 6-column GEMM's 28-row tiles: 9 for its last rows, not 14). Not 1
            or 2 rows, a decoding step's: a 768 -> 3072 GEMV took 1.18x and 1.13x as long in
            the 4-row tile, 3 rows 1.01-1.05x."""
            half, part = mr // 2, f"{g.m_var}.part"
            # (rows of the least tile; on the tile unit, any count of rows is one tile shape)
            least = 1 if g.tiles else min(half, -(-MIN_TILE_ACCUMULATORS // (nr // vw)))
            two = self.int_op("icmp ugt", left, half)
            first = self.tmp("first")  # (the rows of the first tile: all of them, or half rounded up)
            self.emit(f"{first} = select i1 {two}, i64 {self.int_op('sub', left, self.int_op('lshr', left, 1))}, "
                      f"i64 {left}")

            def one_part():  # part 0: `first` rows from base; part 1: the rest after them
                later = self.int_op("icmp ne", self.lookup(part)[1], 0)
                size, at = self.tmp("rows"), self.tmp("at")
                self.emit(f"{size} = select i1 {later}, i64 {self.int_op('sub', left, first)}, i64 {first}")
                self.emit(f"{at} = select i1 {later}, i64 {self.int_op('add', base, first)}, i64 {base}")
                small = self.int_op("icmp ult", size, least)
                between, shape = self.tmp("between"), self.tmp("shape")  # (3 .. least - 1 rows: the least tile)
                self.emit(f"{between} = and i1 {small}, {self.int_op('icmp ugt', size, 2)}")
                self.emit(f"{shape} = select i1 {between}, i64 {least}, i64 {size}")
                # (the least tile reads and stores the count's rows only where it serves fewer)
                self.switch(shape, {rows: (lambda rows=rows: block(at, rows, panels, partial,
                                                                   size if rows == least > 3 else None))
                                    for rows in sorted({*range(1, min(3, least)), *range(least, half + 1)})})
            parts = self.tmp("parts")
            self.emit(f"{parts} = select i1 {two}, i64 2, i64 1")
            self.loop(part, 0, one_part, lo="0", hi=parts)

        blocks = by_rows if g.a_rows else by_blocks
        if lo is not None and g.split == "n":
            # Panels [lo, hi): the full ones in L2-sized chunks, then the partial one if in range.
            end = self.int_op("smin", hi, full_panels)
            span = self.int_op("smax", self.int_op("sub", end, lo), 0)
            n_chunks = self.int_op("udiv", self.int_op("add", span, chunk - 1), chunk)
            chk = f"{g.n_var}.chk"

            def one_chunk():
                c0 = self.int_op("add", lo, self.mul_const(self.lookup(chk)[1], chunk))
                blocks((c0, self.int_op("smin", self.int_op("add", c0, chunk), end)), False)
            self.loop(chk, 0, one_chunk, lo="0", hi=n_chunks)
            if runtime_n:
                self.when(self.int_op("icmp sgt", hi, full_panels), lambda: blocks((0, 0), some_left))
            elif last_cols:
                self.when(self.int_op("icmp sgt", hi, full_panels), lambda: blocks((0, 0), True))
            return
        if runtime_n:
            blocks(("0", full_panels), some_left)
            return
        chunks, rest = divmod(full_panels, chunk)
        if chunks <= 1 and not (chunks == 1 and rest):
            blocks((0, full_panels), True)
        else:
            self.loop(f"{g.n_var}.chk", chunks, lambda: blocks(
                (self.mul_const(self.lookup(f"{g.n_var}.chk")[1], chunk), chunk), False))
            blocks((chunks * chunk, rest), True)

    def outline_tiles(self, g: Gemm) -> bool:
        """Whether the tile's k loop is a function of its own: on AVX-512, where the epilogue
        calls exp, tanh or erf (a SiLU, sigmoid or GELU). Their polynomials' constants, hoisted
        out of every loop, held registers through the k loop, whose 28 accumulators then
        spilled (a 128 -> 256 1x1 conv with SiLU took 1.81 ms, 0.84 outlined; a 256 -> 1024
        one with GELU 3.18, 1.15). A function's registers are its own. (AVX2's k loop kept
        its registers: there the call only cost 1-7%.)"""
        if g.kind != "f32" or self.vw < 16:
            return False
        if id(g) not in self.outline_choice:
            self.outline_choice[id(g)] = bool(called_functions(g.epilogue) & {"exp", "tanh", "erf"})
        return self.outline_choice[id(g)]

    def outlined_microkernel(self, g: Gemm, a_off: str, bp: str, m0: str, rows: int, vt: str, tile: str,
                             cols: int, valid: str | None = None) -> None:
        """microkernel() as a call of `void (ptr a, ptr b, [ptr tables...,] ptr tile, i64
        a_off, i64 bp, i64 m0[, i64 cols][, i64 valid])`, one function per tile shape of this
        Gemm."""
        tables = [t for t in (g.a_mtab, g.a_ktab, g.b_ktab, g.a_kspan) if t]
        # (a row length or B's row stride known at run time reads the symbols)
        buffers = [g.a_buf, g.b_buf, *tables] + ([SYMBOLS] if self.reads_symbols else [])
        run_time_cols = not isinstance(cols, int)  # (then an argument of the function)
        key = (id(g), rows, "run-time" if run_time_cols else cols, valid is not None)
        name = self.outlined.get(key)
        if name is None:
            name = f"{self.symbol}_tile{len(self.outlined)}"
            self.outlined[key] = name
            saved = (self.lines, self.block, self.bufs, self.symbol_values, self.block_values)
            self.lines, self.block, self.symbol_values, self.block_values = [], "entry", None, {}
            self.bufs = {**self.bufs, **{buf: (f"%mk.{i}", self.bufs[buf][1]) for i, buf in enumerate(buffers)}}
            self.microkernel(g, "%mk.0", "%mk.a_off", "%mk.1", "%mk.bp", "%mk.m0", rows, vt, "%mk.tile",
                             "%mk.cols" if run_time_cols else cols, valid and "%mk.valid")
            body, (self.lines, self.block, self.bufs, self.symbol_values, self.block_values) = self.lines, saved
            params = [f"ptr noalias nocapture readonly %mk.{i}" for i in range(len(buffers))]
            params += ["ptr noalias nocapture writeonly %mk.tile", "i64 %mk.a_off", "i64 %mk.bp", "i64 %mk.m0"]
            params += ["i64 %mk.cols"] if run_time_cols else []
            params += ["i64 %mk.valid"] if valid else []
            self.functions.append("\n".join([f"define internal void @{name}({', '.join(params)}) #2 {{", "entry:",
                                             *body, "  ret void", "}"]))
        args = [f"ptr {self.bufs[buf][0]}" for buf in buffers] + [f"ptr {tile}", f"i64 {a_off}", f"i64 {bp}",
                                                                  f"i64 {m0}"]
        args += [f"i64 {cols}"] if run_time_cols else []
        args += [f"i64 {valid}"] if valid else []
        self.emit(f"call void @{name}({', '.join(args)})")

    def mul_const(self, v: str, c: int) -> str:
        return self.pure(f"mul nsw i64 {v}, {c}", "m")

    def microkernel(self, g: Gemm, a_ptr, a_off, b_ptr, bp, m0, rows, vt, tile, cols: int,
                    valid: str | None = None) -> None:
        """The tile's k loop, its sums stored to `tile`. With `valid` (a run-time count of its
        rows that are the GEMM's), the rows past it read the last of them."""
        vw, nv = self.vw, g.nr // self.vw
        elt = "float" if g.kind == "f32" else "i32"
        last = valid and self.int_op("sub nsw", valid, 1)

        def at_row(r: int, stride: int = 1):  # (row r's distance from the first, in A's elements)
            if not valid or r == 0:
                return str(r * stride)
            row = self.int_op("smin", last, r)
            return self.mul_const(row, stride) if stride != 1 else row
        rowbase = []
        entries = None  # (the tile's first and last entries of a_mtab)
        if g.a_rows:  # the tile's output row from a table, its pixels a_sm apart along it
            row, base = self.tmp("row"), self.tmp("ra")
            width = g.a_rows if isinstance(g.a_rows, int) else self.expr(g.a_rows)
            self.emit(f"{row} = udiv i64 {m0}, {width}")
            entries = (row, row)
            column = self.int_op("sub nsw", m0, self.int_op("mul nsw", row, width) if not isinstance(width, int)
                                 else self.mul_const(row, width))
            self.emit(f"{base} = load i64, ptr {self.gep(self.bufs[g.a_mtab][0], 'i64', row)}, align 8")
            first = self.int_op("add nsw", self.int_op("add nsw", base, a_off), self.mul_const(column, g.a_sm))
            rowbase = [first] + [self.int_op("add nsw", first, at_row(r, g.a_sm)) for r in range(1, rows)]
        elif g.a_mtab:  # each row's offset from a table (a conv's output pixels over its input)
            for r in range(rows):
                idx, off, t = self.tmp("mi"), self.tmp("moff"), self.tmp("ra")
                self.emit(f"{idx} = add nsw i64 {m0}, {at_row(r)}")
                self.emit(f"{off} = load i64, ptr {self.gep(self.bufs[g.a_mtab][0], 'i64', idx)}, align 8")
                self.emit(f"{t} = add nsw i64 {off}, {a_off}")
                rowbase.append(t)
        else:
            block_base = self.tmp("ra")  # row m0's element: A's blocks are a_sb apart per row of m0
            self.emit(f"{block_base} = add nsw i64 {self.mul_const(m0, g.a_sb or g.a_sm)}, {a_off}")
            for r in range(rows):
                t = self.tmp("ra")
                self.emit(f"{t} = add nsw i64 {block_base}, {at_row(r, g.a_sm)}")
                rowbase.append(t)
        k_first, k_end = "0", str(g.k)
        if g.a_kspan:  # only the k where some window of the tile is not all zero border
            entries = entries or (m0, self.int_op("add nsw", m0, last or rows - 1) if rows > 1 else m0)
            k_first, k_end = self.kspan(g, entries[0])
            if entries[1] != entries[0]:
                last_lo, last_hi = self.kspan(g, entries[1])
                k_first, k_end = self.int_op("smin", k_first, last_lo), self.int_op("smax", k_end, last_hi)
        self.n += 1
        pred, head, exit_ = self.block, f"K{self.n}.body", f"K{self.n}.exit"
        self.emit(f"br label %{head}")
        self.label(head)
        k, knext = self.tmp("k"), self.tmp("knext")
        self.emit(f"{k} = phi i64 [{k_first}, %{pred}], [{knext}, %{head}]")
        accs = [[self.tmp(f"acc{r}_{v}_") for v in range(nv)] for r in range(rows)]
        nexts = [[self.tmp(f"nacc{r}_{v}_") for v in range(nv)] for r in range(rows)]
        for r in range(rows):
            for v in range(nv):
                self.emit(f"{accs[r][v]} = phi {vt} [zeroinitializer, %{pred}], [{nexts[r][v]}, %{head}]")
        if g.b_ktab:  # B's row k starts at a table's offset (an input row of a conv)
            btp = self.gep(self.bufs[g.b_ktab][0], "i64", k)
            kb = self.tmp("bkoff")
            self.emit(f"{kb} = load i64, ptr {btp}, align 8")
        elif not isinstance(g.b_sk, int):  # (B's row stride known at run time: a plane of pixels)
            kb = self.int_op("mul nsw", k, self.expr(g.b_sk))
        else:
            kb = self.mul_const(k, g.b_sk or g.nr * (2 if g.b_words else 1))
        kbp = self.tmp("kb")
        self.emit(f"{kbp} = add nsw i64 {kb}, {bp}")
        bvec = []  # B's vectors of this k step (with b_words: the first pair's, then the second's)
        for v in range(nv * (2 if g.b_words else 1)):
            idx = self.tmp("bi")
            self.emit(f"{idx} = add nsw i64 {kbp}, {v * vw}")
            p = self.gep(b_ptr, "f32" if g.kind == "f32" else "i32", idx)
            if isinstance(cols, int):
                lanes = min(max(cols - v * vw, 0), vw) if g.in_place_b else vw
            else:  # (a run-time count of columns: B's lanes past it are not read)
                lanes = self.int_op("smin", self.int_op("smax", self.int_op("sub", cols, v * vw), 0), vw)
            # (in place, partly past N: only the columns that exist are read; wholly past: none)
            bvec.append(self.load_first(p, elt, vw, lanes, 4) if lanes else "zeroinitializer")
        # (a run-time m: its full row blocks, a prefill's; not the rows left after them, a decoding step's one)
        many_rows = g.m >= g.mr if isinstance(g.m, int) else rows == g.mr
        prefetch = not g.in_place_b and (self.prefetch == "on" or (
            self.prefetch == "auto" and g.k * g.n * 4 > PREFETCH_B_BYTES and _row_blocks(g) <= PREFETCH_MAX_ROW_BLOCKS))
        if g.kind == "f32" and streams_b_in_place(g):
            # B read in place is a row of another plane (or input row) at each k step: more
            # streams than the hardware's prefetcher follows. Fetch this k step's lines of a
            # panel a few ahead while this one computes.
            self.prefetch_lines(b_ptr, kbp, PREFETCH_IN_PLACE_PANELS_AHEAD * g.nr, g.nr)
        if g.kind == "f32" and prefetch and many_rows:
            # B past L2 streams from memory on the first row block's pass over it: fetch the
            # next panel's lines for this k while this panel computes, or, for panels too
            # big for two to share L2 with A, this panel's a few k steps ahead. (With one row
            # block or less, a GEMV, B is a plain stream the hardware prefetches by itself.)
            panel = g.k * g.nr
            self.prefetch_lines(b_ptr, kbp, panel if panel * 4 <= PREFETCH_NEXT_PANEL_BYTES
                                else PREFETCH_K_STEPS * g.nr, g.nr)
        if g.b_words:
            self.word_products(g, a_ptr, rowbase, k, bvec, accs, nexts, vt)
        elif g.kind != "f32":
            self.byte_products(g, a_ptr, rowbase, k, bvec, accs, nexts, vt)
        elif g.a_ktab:  # implicit GEMM: A's k offset comes from a table
            tp = self.gep(self.bufs[g.a_ktab][0], "i64", k)
            ks = self.tmp("koff")
            self.emit(f"{ks} = load i64, ptr {tp}, align 8")
        else:
            ks = k if g.a_sk == 1 else self.mul_const(k, g.a_sk)
        for r in range(rows if g.kind == "f32" else 0):
            ai = self.tmp("ai")
            self.emit(f"{ai} = add nsw i64 {rowbase[r]}, {ks}")
            a = self.load(a_ptr, self.bufs[g.a_buf][1], ai)
            ins = self.tmp("ins")
            self.emit(f"{ins} = insertelement {vt} poison, float {a}, i64 0")
            splat = self.tmp("splat")
            self.emit(f"{splat} = shufflevector {vt} {ins}, {vt} poison, <{vw} x i32> zeroinitializer")
            for v in range(nv):
                self.emit(f"{nexts[r][v]} = call {vt} @llvm.fma.v{vw}f32({vt} {splat}, {vt} {bvec[v]}, "
                          f"{vt} {accs[r][v]})")
        self.emit(f"{knext} = add nuw nsw i64 {k}, 1")
        c = self.tmp("kc")
        self.emit(f"{c} = icmp ult i64 {knext}, {k_end}")
        self.emit(f"br i1 {c}, label %{head}, label %{exit_}")
        self.label(exit_)
        self.store_registers(g, tile, nexts, rows, vt, elt)

    def store_registers(self, g: Gemm, tile: str, regs: list, rows: int, vt: str, elt: str) -> None:
        """A register tile's vectors (regs[r][v]: row r's v-th vector) into the stack tile the
        write-back reads: row-major, or for stores along m column-major, each column's rows
        [j * R, j * R + rows) transposed in registers vw x vw at a time (rows past the tile
        are zeros), so that the write-back reads and stores a column as vectors."""
        vw, nv = self.vw, g.nr // self.vw
        if g.stores_along == "m":
            height = self.tile_rows(g)
            for rb in range(0, height, vw):
                for v in range(nv):
                    block = [regs[rb + i][v] if rb + i < rows else "zeroinitializer" for i in range(vw)]
                    for lane, column in enumerate(self.transpose(block, vt)):
                        p = self.tmp("tp")
                        self.emit(f"{p} = getelementptr inbounds {elt}, ptr {tile}, i64 {(v * vw + lane) * height + rb}")
                        self.emit(f"store {vt} {column}, ptr {p}, align 4")
            return
        for r in range(rows):
            for v in range(nv):
                p = self.tmp("tp")
                self.emit(f"{p} = getelementptr inbounds {elt}, ptr {tile}, i64 {r * g.nr + v * vw}")
                self.emit(f"store {vt} {regs[r][v]}, ptr {p}, align 4")

    def prefetch_lines(self, base: str, at: str, ahead: int, floats: int) -> None:
        """Prefetch into L2 the cache lines of `floats` floats from element at + ahead of base."""
        self.decls.add("declare void @llvm.prefetch.p0(ptr, i32, i32, i32)")
        for line in range(0, floats, 16):
            idx, p = self.tmp("pf"), self.tmp("pfp")
            self.emit(f"{idx} = add nsw i64 {at}, {ahead + line}")
            # (not inbounds: past the last panel it points past B, which a prefetch may)
            self.emit(f"{p} = getelementptr float, ptr {base}, i64 {idx}")
            self.emit(f"call void @llvm.prefetch.p0(ptr {p}, i32 0, i32 2, i32 1)")

    def kspan(self, g: Gemm, entry: str) -> tuple:
        """The [lo, hi) k range of a_mtab's entry `entry`, from g.a_kspan."""
        at = self.mul_const(entry, 2)
        ends = []
        for i in (0, 1):
            v = self.tmp("kspan")
            idx = self.int_op("add nsw", at, i) if i else at
            self.emit(f"{v} = load i64, ptr {self.gep(self.bufs[g.a_kspan][0], 'i64', idx)}, align 8")
            ends.append(v)
        return tuple(ends)

    def tile_rows(self, g: Gemm) -> int:
        """Rows of the stack tile: mr, or for a column-major tile mr rounded up to vectors."""
        return -(-g.mr // self.vw) * self.vw if g.stores_along == "m" else g.mr

    def transpose(self, rows: list, vt: str, vw: int = 0) -> list:
        """A vw x vw block given as vw row vectors, as vw column vectors: for d = vw/2 .. 1,
        each 2d x 2d block swaps its off-diagonal d x d blocks (two shuffles per row pair)."""
        vw = vw or self.vw
        rows = list(rows)
        d = vw // 2
        while d:
            for i in range(vw):
                if i & d:
                    continue
                a, b = rows[i], rows[i + d]
                low = [lane if not lane & d else vw + lane - d for lane in range(vw)]
                high = [lane + d if not lane & d else vw + lane for lane in range(vw)]
                rows[i], rows[i + d] = self.tmp("tr"), self.tmp("tr")
                for out, mask in ((rows[i], low), (rows[i + d], high)):
                    self.emit(f"{out} = shufflevector {vt} {a}, {vt} {b}, <{vw} x i32> <"
                              + ", ".join(f"i32 {m}" for m in mask) + ">")
            d //= 2
        return rows

    def a_quads(self, g: Gemm, a_ptr, rowbase, k, vt, half: int = 0) -> list:
        """Each row's 4 A bytes of quad k as one i32 splat over the lanes (a signed A's bytes
        shifted to unsigned); with b_words (A in 16-bit elements), its pair `half` (elements
        2*half, 2*half + 1 of the quad)."""
        vw = self.vw
        if g.a_ktab:  # the quad's element offset comes from a table (the conv's input copy)
            tp = self.gep(self.bufs[g.a_ktab][0], "i64", k)
            koff = self.tmp("koff")
            self.emit(f"{koff} = load i64, ptr {tp}, align 8")
        else:
            koff = self.mul_const(k, 4)
        splats = []
        for base in rowbase:
            ai = self.tmp("ai")
            self.emit(f"{ai} = add nsw i64 {base}, {koff}")
            if half:
                ai2 = self.tmp("ai")
                self.emit(f"{ai2} = add nsw i64 {ai}, {2 * half}")
                ai = ai2
            p = self.gep(a_ptr, "i16" if g.b_words else "i8", ai)
            a = self.tmp("a4")
            self.emit(f"{a} = load i32, ptr {p}, align {2 if g.b_words else 1}")
            if g.kind == "s8s8":  # signed bytes + 128 = the same bytes read unsigned, top bits flipped
                flipped = self.tmp("a4u")
                self.emit(f"{flipped} = xor i32 {a}, -2139062144")
                a = flipped
            ins, splat = self.tmp("ins"), self.tmp("splat")
            self.emit(f"{ins} = insertelement {vt} poison, i32 {a}, i64 0")
            self.emit(f"{splat} = shufflevector {vt} {ins}, {vt} poison, <{vw} x i32> zeroinitializer")
            splats.append(splat)
        return splats

    def byte_products(self, g: Gemm, a_ptr, rowbase, k, bvec, accs, nexts, vt) -> None:
        """One quad step of an 8-bit GEMM: each row's 4 A bytes (one i32, splat) times each
        B vector's 4 bytes per lane, summed into the lane's i32 (vpdpbusd, or its emulation)."""
        vw = self.vw
        for r, splat in enumerate(self.a_quads(g, a_ptr, rowbase, k, vt)):
            for v in range(len(bvec)):
                unsigned, signed = (bvec[v], splat) if g.kind == "s8u8" else (splat, bvec[v])
                if vw in self.dot_widths:
                    self.emit(f"{nexts[r][v]} = call {vt} @{VPDPBUSD[vw]}({vt} {accs[r][v]}, "
                              f"{vt} {unsigned}, {vt} {signed})")
                else:
                    self.dot4_emulated(accs[r][v], unsigned, signed, nexts[r][v], vt)

    def word_products(self, g: Gemm, a_ptr, rowbase, k, bvec, accs, nexts, vt) -> None:
        """One quad step of an 8-bit GEMM whose B is packed in 16-bit pairs (Gemm.b_words):
        each row's A pairs (a0, a1) and (a2, a3), 16-bit elements, each one i32 splat over the
        lanes, times B's two pair vectors (vpmaddwd: a0*b0 + a1*b1 per lane, exact), each
        product added to the lane's i32 sum. Pair by pair, so that only one pair's B vectors
        are live beside the accumulators (a 6x16 tile's 12 fill 16 registers with them)."""
        vw, nv = self.vw, len(accs[0])
        wt = f"<{2 * vw} x i16>"
        words = [self.tmp("bw") for _ in bvec]
        for b_vec, w in zip(bvec, words):
            self.emit(f"{w} = bitcast {vt} {b_vec} to {wt}")
        sums = accs
        for j in range(2):
            splats = self.a_quads(g, a_ptr, rowbase, k, vt, j)
            after = nexts if j else [[self.tmp("pms") for _ in row] for row in accs]
            for r in range(len(rowbase)):
                pair = self.tmp("apw")
                self.emit(f"{pair} = bitcast {vt} {splats[r]} to {wt}")
                for v in range(nv):
                    prod = self.tmp("pmw")
                    self.emit(f"{prod} = call {vt} @llvm.x86.avx2.pmadd.wd({wt} {pair}, {wt} {words[j * nv + v]})")
                    self.emit(f"{after[r][v]} = add {vt} {sums[r][v]}, {prod}")
            sums = after

    def dot4_emulated(self, acc, unsigned, signed, out, vt) -> None:
        """acc + sum over the 4 bytes of each lane of unsigned byte x signed byte."""
        total = acc
        for j in range(4):
            u, s1, s2, prod = self.tmp("ub"), self.tmp("sb"), self.tmp("sb"), self.tmp("pr")
            sh = f"splat (i32 {8 * j})" if j else None
            if sh:
                self.emit(f"{u} = lshr {vt} {unsigned}, {sh}")
                u2 = self.tmp("ub")
                self.emit(f"{u2} = and {vt} {u}, splat (i32 255)")
                u = u2
            else:
                self.emit(f"{u} = and {vt} {unsigned}, splat (i32 255)")
            self.emit(f"{s1} = shl {vt} {signed}, splat (i32 {24 - 8 * j})")
            self.emit(f"{s2} = ashr {vt} {s1}, splat (i32 24)")
            self.emit(f"{prod} = mul {vt} {u}, {s2}")
            nxt = out if j == 3 else self.tmp("dsum")
            self.emit(f"{nxt} = add {vt} {total}, {prod}")
            total = nxt

    # -- the 8-bit depthwise window row --------------------------------------------------
    def window_dot(self, s: WindowDot) -> None:
        """16 outputs at a time (ir.loop.WindowDot): per window row and quad of taps, one
        64-byte load of the plane, a byte shuffle (vpermb) putting output i's four inputs in
        lane i, and a vpdpbusd against the quad's weights, splat. One accumulator per window
        row, summed at the end, so the dot products do not wait on each other."""
        lanes = WINDOW_DOT_LANES
        vt, bt = f"<{lanes} x i32>", f"<{lanes * 4} x i8>"
        vnni = lanes in self.dot_widths
        if vnni:
            self.decls.add(f"declare {vt} @{VPDPBUSD[lanes]}({vt}, {vt}, {vt})")
        p_ptr, w_ptr, o_ptr = self.bufs[s.p_buf][0], self.bufs[s.w_buf][0], self.bufs[s.out_buf][0]
        p_off, w_off, o_off = self.expr(s.p_off), self.expr(s.w_off), self.expr(s.out_off)
        weights = {}  # (row, quad) -> the quad's four weight bytes in every lane: loaded once
        for r in range(s.rows):
            for q in range(s.quads):
                wi = self.tmp("wi")
                self.emit(f"{wi} = add nsw i64 {w_off}, {r * s.quads + q}")
                w4, ins, splat = self.tmp("w4"), self.tmp("ins"), self.tmp("wsplat")
                self.emit(f"{w4} = load i32, ptr {self.gep(w_ptr, 'i32', wi)}, align 4")
                self.emit(f"{ins} = insertelement {vt} poison, i32 {w4}, i64 0")
                self.emit(f"{splat} = shufflevector {vt} {ins}, {vt} poison, <{lanes} x i32> zeroinitializer")
                weights[r, q] = splat
        masks = []  # per quad: lane i, byte j <- input i*stride + j*dilation from the quad's first
        for q in range(s.quads):
            masks.append(", ".join(f"i32 {i * s.stride + j * s.dilation if 4 * q + j < s.taps else 0}"
                                   for i in range(lanes) for j in range(4)))

        def one_vector():
            v = self.lookup("__wd_v")[1]
            first = self.int_op("add nsw", p_off, self.mul_const(v, lanes * s.stride))
            sums = []
            for r in range(s.rows):
                acc = "zeroinitializer"
                for q in range(s.quads):
                    at = self.int_op("add nsw", first, r * s.p_row + 4 * q * s.dilation)
                    raw, picked, quads, nxt = self.tmp("row"), self.tmp("pick"), self.tmp("q4"), self.tmp("dot")
                    self.emit(f"{raw} = load {bt}, ptr {self.gep(p_ptr, 'u8', at)}, align 1")
                    self.emit(f"{picked} = shufflevector {bt} {raw}, {bt} poison, <{lanes * 4} x i32> <{masks[q]}>")
                    self.emit(f"{quads} = bitcast {bt} {picked} to {vt}")
                    if vnni:
                        self.emit(f"{nxt} = call {vt} @{VPDPBUSD[lanes]}({vt} {acc}, {vt} {quads}, "
                                  f"{vt} {weights[r, q]})")
                    else:
                        self.dot4_emulated(acc, quads, weights[r, q], nxt, vt)
                    acc = nxt
                sums.append(acc)
            while len(sums) > 1:  # a balanced tree
                pairs = []
                for i in range(0, len(sums) - 1, 2):
                    t = self.tmp("rows")
                    self.emit(f"{t} = add {vt} {sums[i]}, {sums[i + 1]}")
                    pairs.append(t)
                sums = pairs + sums[len(sums) - len(sums) % 2:]
            out = self.int_op("add nsw", o_off, self.mul_const(v, lanes))
            self.emit(f"store {vt} {sums[0]}, ptr {self.gep(o_ptr, 'i32', out)}, align 4")
        self.loop("__wd_v", s.vectors, one_vector, "scalar")

    def first_lanes_mask(self, lanes: int, count) -> str:
        """The <lanes x i1> mask of the first `count` lanes: a constant, or for a count known
        at run time (an i64 value in [0, lanes]), a comparison with the lane numbers."""
        if isinstance(count, int):
            return first_lanes(lanes, count)
        splat = self.splat(count, "i64", lanes)
        numbers = "<" + ", ".join(f"i64 {i}" for i in range(lanes)) + ">"
        mask = self.tmp("lanes")
        self.emit(f"{mask} = icmp ult <{lanes} x i64> {numbers}, {splat}")
        return f"<{lanes} x i1> {mask}"

    def splat(self, value: str, elt: str, lanes: int) -> str:
        ins, out = self.tmp("ins"), self.tmp("splat")
        self.emit(f"{ins} = insertelement <{lanes} x {elt}> poison, {elt} {value}, i64 0")
        self.emit(f"{out} = shufflevector <{lanes} x {elt}> {ins}, <{lanes} x {elt}> poison, "
                  f"<{lanes} x i32> zeroinitializer")
        return out

    def load_first(self, ptr: str, elt: str, lanes: int, count, align: int, fill: str = "zeroinitializer") -> str:
        """A <lanes x elt> vector (elt: float or i32) at ptr of which only the first `count`
        lanes are read (an int, or an i64 value below `lanes`): a plain load, or one under a
        mask (the rest zero, or the vector value `fill`)."""
        vt, v = f"<{lanes} x {elt}>", self.tmp("vec")
        if isinstance(count, int) and count >= lanes:
            self.emit(f"{v} = load {vt}, ptr {ptr}, align {align}")
            return v
        fn = f"@llvm.masked.load.v{lanes}{MASKED_SUFFIX[elt]}.p0"
        self.decls.add(f"declare {vt} {fn}(ptr, i32, <{lanes} x i1>, {vt})")
        mask = self.first_lanes_mask(lanes, count)
        self.emit(f"{v} = call {vt} {fn}(ptr {ptr}, i32 {align}, {mask}, {vt} {fill})")
        return v

    def store_first(self, value: str, ptr: str, elt: str, lanes: int, count, align: int) -> None:
        """The first `count` lanes of a <lanes x elt> value stored at ptr (an int, or an i64
        value below `lanes`; under a mask where that is not all of them)."""
        vt = f"<{lanes} x {elt}>"
        if isinstance(count, int) and count >= lanes:
            self.emit(f"store {vt} {value}, ptr {ptr}, align {align}")
            return
        if not isinstance(count, int) and self.vw < 16:
            # Without mask registers, a store under a run-time mask is vmaskmovps, microcoded
            # on AMD cores (the Deinterleave tails of a strided depthwise conv's copy were a
            # third of its time at 28 x 28 on x86-64-v3); a switch over the counts stores
            # each as constant-prefix stores, which become plain pieces (partial_stores.py).
            return self.switch(count, {n: (lambda n=n: self.store_first(value, ptr, elt, lanes, n, align))
                                       for n in range(1, lanes + 1)})
        fn = f"@llvm.masked.store.v{lanes}{MASKED_SUFFIX[elt]}.p0"
        self.decls.add(f"declare void {fn}({vt}, ptr, i32, <{lanes} x i1>)")
        self.emit(f"call void {fn}({vt} {value}, ptr {ptr}, i32 {align}, {self.first_lanes_mask(lanes, count)})")

    def transpose_block(self, s: TransposeBlock) -> None:
        """ir.loop.TransposeBlock: rows loaded as vectors (a partial row through a masked
        load), transposed in registers, columns stored (partial ones through masked stores)."""
        n = TRANSPOSE_LANES
        src, dst = self.bufs[s.src][0], self.bufs[s.dst][0]
        src_off, dst_off = self.expr(s.src_off), self.expr(s.dst_off)
        run_time = not isinstance(s.cols, int)  # (a run-time width's last block: its columns counted then)
        cols = self.expr(s.cols) if run_time else s.cols
        stride = s.src_stride if isinstance(s.src_stride, int) else self.expr(s.src_stride)
        row_at = (lambda i: i * stride) if isinstance(stride, int) else (lambda i: self.mul_const(stride, i))
        rows = [self.load_first(self.gep(src, "u8", self.int_op("add nsw", src_off, row_at(i))), "i32", n, cols, 1)
                if i < s.rows else "zeroinitializer" for i in range(n)]
        for j, column in enumerate(self.transpose(rows, f"<{n} x i32>", n)[:n if run_time else cols]):
            def store(j=j, column=column):
                self.store_first(column, self.gep(dst, "u8", self.int_op("add nsw", dst_off, j * s.dst_stride)), "i32",
                                 n, s.rows, 1)
            if run_time:
                self.when(self.int_op("icmp sgt", cols, j), store)
            else:
                store()

    def deinterleave(self, s: Deinterleave) -> None:
        """ir.loop.Deinterleave: per vector of slots, one load of its `phases` vectors of
        input, a shuffle per phase, a store per phase; the ragged last one through a masked
        load and masked stores (constant masks)."""
        vw, ph = self.vw, s.phases
        wide = f"<{vw * ph} x float>"
        src, dst = self.bufs[s.src][0], self.bufs[s.dst][0]
        src_off, dst_off = self.expr(s.src_off), self.expr(s.dst_off)
        dst_stride = s.dst_stride if isinstance(s.dst_stride, int) else self.expr(s.dst_stride)

        def slots(t0: str, count, read=None, fill: str = "zeroinitializer") -> None:
            if read is None:
                read = count * ph if isinstance(count, int) else self.mul_const(count, ph)
            row = self.load_first(self.gep(src, "f32", self.int_op("add nsw", src_off, self.mul_const(t0, ph))),
                                  "float", vw * ph, read, 4, fill)
            for q in range(ph):
                part = self.tmp("diph")
                picks = ", ".join(f"i32 {q + ph * i}" for i in range(vw))
                self.emit(f"{part} = shufflevector {wide} {row}, {wide} poison, <{vw} x i32> <{picks}>")
                phase_at = (self.int_op("add nsw", dst_off, q * dst_stride) if isinstance(dst_stride, int)
                            else self.int_op("add nsw", dst_off, self.mul_const(dst_stride, q)))
                at = self.gep(dst, "f32", self.int_op("add nsw", phase_at, t0))
                self.store_first(part, at, "float", vw, count, 4)
        if s.src_count is not None:
            # Whole vectors while every element they read exists, then vectors under masks:
            # the slots' count, and the elements that exist (the rest read as the border).
            count = s.count if isinstance(s.count, int) else self.expr(s.count)
            exist = s.src_count if isinstance(s.src_count, int) else self.expr(s.src_count)
            exist = self.int_op("smax", exist, 0)
            full = self.int_op("smin", self.int_op("udiv", exist, vw * ph), self.int_op("udiv", count, vw))
            fill = self.splat(_literal(s.border, "f32"), "float", vw * ph)

            def ragged(v: str) -> None:
                t0 = self.mul_const(v, vw)
                lanes = self.int_op("smin", self.int_op("sub nsw", count, t0), vw)
                read = self.int_op("smin", self.int_op("smax", self.int_op("sub nsw", exist, self.mul_const(t0, ph)), 0),
                                   vw * ph)
                slots(t0, lanes, read, fill)
            self.loop("__di_v", 0, lambda: slots(self.mul_const(self.lookup("__di_v")[1], vw), vw), "scalar",
                      lo="0", hi=full)
            # The first vector under masks stands alone: its masks then depend on sizes only,
            # and leave the loops around it (a short row has no other vector).
            vectors = self.int_op("udiv", self.int_op("add nsw", count, vw - 1), vw)
            self.when(self.int_op("icmp slt", full, vectors), lambda: ragged(full))
            self.loop("__di_v", 0, lambda: ragged(self.lookup("__di_v")[1]), "scalar",
                      lo=self.int_op("add nsw", full, 1), hi=vectors)
            return
        if not isinstance(s.count, int):  # a count known at run time: whole vectors, then a masked one
            count = self.expr(s.count)
            whole, tail = self.int_op("and", count, -vw), self.int_op("and", count, vw - 1)
            self.loop("__di_v", 0, lambda: slots(self.mul_const(self.lookup("__di_v")[1], vw), vw), "scalar",
                      lo="0", hi=self.int_op("lshr", count, (vw - 1).bit_length()))
            self.when(self.int_op("icmp ne", tail, 0), lambda: slots(whole, tail))
            return
        whole, tail = divmod(s.count, vw)
        if whole:
            self.loop("__di_v", whole, lambda: slots(self.mul_const(self.lookup("__di_v")[1], vw), vw), "scalar")
        if tail:
            slots(str(whole * vw), tail)

    def writeback(self, g: Gemm, tile: str, m0: str, p: str, rows: int, cols: int, valid: str | None = None) -> None:
        """The epilogue over the tile, vectorized along the direction its stores are contiguous
        in (`g.stores_along`): along a row (n) for a row-major C or a pointwise conv's tile of
        pixels, down a column (m) for a conv's NCHW output, whose rows are pixels. Left to
        itself, LLVM unrolls the inner loop and vectorizes the outer one, with scatters where
        that is not the contiguous direction. With `valid`, its first `valid` rows only."""
        n0 = self.mul_const(p, g.nr)
        acc_type = "f32" if g.kind in FLOAT_GEMM_KINDS else "i32"
        m_base = [m0]  # (row r of the tile is the epilogue's m_base + r: with g.m_rows, per row segment)

        def element():
            r, j = self.lookup("__wb_r")[1], self.lookup("__wb_j")[1]
            m, n, ti = self.tmp("mm"), self.tmp("nn"), self.tmp("ti")
            self.emit(f"{m} = add nsw i64 {m_base[0]}, {r}")
            self.emit(f"{n} = add nsw i64 {n0}, {j}")
            if g.stores_along == "m":  # (the tile is column-major: microkernel)
                self.emit(f"{ti} = add nsw i64 {self.mul_const(j, self.tile_rows(g))}, {r}")
            else:
                self.emit(f"{ti} = add nsw i64 {self.mul_const(r, g.nr)}, {j}")
            tp = self.gep(tile, acc_type, ti)
            acc = self.tmp("accv")
            self.emit(f"{acc} = load {LL[acc_type]}, ptr {tp}, align 4")
            self.bind(g.m_var, ("ssa", m, "i64"))
            self.bind(g.n_var, ("ssa", n, "i64"))
            self.bind(g.acc_var, ("ssa", acc, acc_type))
            self.stmts(g.epilogue)

        if g.m_rows:
            # Virtual rows (Gemm.m_rows): the tile's rows in segments, one per plane row it
            # meets, each [lo, hi) of the rows that are pixels; the gap between is not stored.
            width, real = g.m_rows
            first = self.int_op("udiv", m0, width)
            end = self.int_op("add nsw", m0, rows)
            last = self.int_op("udiv", self.int_op("sub nsw", end, 1), width)

            def segment():
                row = self.lookup("__wb_seg")[1]
                start = self.mul_const(row, width)
                lo = self.int_op("sub nsw", self.int_op("smax", m0, start), m0)
                hi = self.int_op("sub nsw", self.int_op("smin", end, self.int_op("add nsw", start, real)), m0)
                # (row r of the tile is pixel row * real + (m0 + r - start))
                m_base[0] = self.int_op("add nsw", self.int_op("sub nsw", self.mul_const(row, real), start), m0)
                self.loop("__wb_j", cols, lambda: self.loop("__wb_r", 0, element, "run_time_tail", lo=lo, hi=hi),
                          "scalar")
            self.loop("__wb_seg", 0, segment, "scalar", lo=first, hi=self.int_op("add nsw", last, 1))
        elif valid and g.stores_along == "m":
            self.loop("__wb_j", cols, lambda: self.loop("__wb_r", 0, element, "run_time_tail", lo="0", hi=valid),
                      "scalar")
        elif valid:
            def a_row():
                if isinstance(cols, int):  # (as the rows of a whole tile below)
                    self.loop("__wb_j", cols, element, "vector_only" if g.in_place_b or g.kind == "s8u8" and g.b_words
                              else "vectorize")
                else:
                    self.loop("__wb_j", 0, element, "run_time_tail", lo="0", hi=cols)
            self.loop("__wb_r", 0, a_row, "scalar", lo="0", hi=valid)
        elif g.stores_along == "m":
            self.loop("__wb_j", cols, lambda: self.loop("__wb_r", rows, element, "vector_masked"), "scalar")
        elif not isinstance(cols, int):  # (a run-time count of columns, fewer than the panel's)
            self.loop("__wb_r", rows, lambda: self.loop("__wb_j", 0, element, "run_time_tail", lo="0", hi=cols),
                      "scalar")
        elif g.in_place_b or g.kind == "s8u8" and g.b_words:
            # (A tile of pixels: measured, LLVM's own choice scatters, and on AVX2's 16-bit
            # pointwise tile it ran scalar, half the speed; the byte tile on AVX-512 is 7% faster
            # left to LLVM.)
            self.loop("__wb_r", rows, lambda: self.loop("__wb_j", cols, element, "vector_only"), "scalar")
        elif not isinstance(g.m, int):  # (a run-time m: left to itself, LLVM scattered down the columns)
            self.loop("__wb_r", rows, lambda: self.loop("__wb_j", cols, element, "vectorize"), "scalar")
        else:
            # A row-major C: rows unrolled, each row's stores whole vectors. LLVM's own choice
            # vectorized down the rows with gathers and scatters as soon as the epilogue did
            # more than store (a bias, a ReLU, a residual): 128x512x2048 + bias 1.37 -> 1.01 ms.
            self.loop("__wb_r", rows, lambda: self.loop("__wb_j", cols, element, "vector_only"), "unroll")

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
    decls = sorted(set(_DECLS.strip().splitlines()) | fe.decls)
    conversions = minifloat_conversions(body + "".join(fe.functions))  # (those the kernel calls)
    parts = [f'target triple = "{triple}"', *decls, _math_lib(), *conversions, *fe.functions,
             body, attrs, math_attrs.replace("nounwind", "nounwind alwaysinline"),
             attrs.replace("#0", "#2").replace("nounwind", "nounwind noinline"), *fe.meta]
    return "\n".join(parts) + "\n"
