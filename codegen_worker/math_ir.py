"""The math a kernel inlines rather than calling libm, so that loops using it vectorize
(exp, tanh, erf), float16 and bfloat16 conversions (the CPU's own float16 conversions where
the target has them, else in software: no libgcc helper is linked), and float constants as
LLVM writes them."""
from __future__ import annotations

import math
import struct


# Vectorizable math, inlined into every use (math_lib): exp by a reduction to |r| <= ln 2 / 2
# and a polynomial, tanh and erf as rational functions.
def _poly(acc_name: str, x: str, coeffs, lines: list) -> str:
    """Horner evaluation of coeffs (highest degree first) at %x; returns the result name.
    Each step is one fused multiply-add (`contract`): half the instructions, one rounding."""
    cur = fconst(coeffs[0])
    for i, c in enumerate(coeffs[1:]):
        lines.append(f"  %{acc_name}m{i} = fmul contract float {cur}, %{x}")
        lines.append(f"  %{acc_name}a{i} = fadd contract float %{acc_name}m{i}, {fconst(c)}")
        cur = f"%{acc_name}a{i}"
    return cur


def _clamp(x: str, lo: float, hi: float, out: str, lines: list) -> None:
    """%out = %x held to [lo, hi], NaN kept: x is each select's second operand, as it is
    vmaxps's and vminps's, which return their second operand where either is NaN."""
    lines += [f"  %{out}.u = fcmp olt float %{x}, {fconst(lo)}",
              f"  %{out}.l = select i1 %{out}.u, float {fconst(lo)}, float %{x}",
              f"  %{out}.o = fcmp ogt float %{out}.l, {fconst(hi)}",
              f"  %{out} = select i1 %{out}.o, float {fconst(hi)}, float %{out}.l"]


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


def math_lib(native_f16: bool = False) -> str:
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
    exp += [f"  %cl = fmul contract float %c, {fconst(1.4426950408889634)}",
            f"  %t = fadd contract float %cl, {fconst(magic)}",
            f"  %n = fsub float %t, {fconst(magic)}",
            f"  %h = fmul contract float %n, {fconst(0.693359375)}",
            "  %r0 = fsub contract float %c, %h",
            f"  %l = fmul contract float %n, {fconst(-2.12194440e-4)}",
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
    return "\n".join(exp + tanh + erf + half_conversions(native_f16))


def half_conversions(native_f16: bool = False) -> list:
    return (_native_f16() if native_f16 else _software_f16()) + _bf16_conversions()


# With F16C (every AVX2 x86 CPU) or on aarch64, LLVM's fpext/fptrunc of half are one
# instruction each (vcvtph2ps/vcvtps2ph, fcvt), vectorized 16 wide: the software form is
# about 20 integer instructions an element, and made a float16 model's kernels 2-3x slower
# than their float32 build. The same numbers (exact widening, rounding to nearest even with
# overflow to Inf); a NaN keeps its payload where the software form writes the canonical one.
def _native_f16() -> list:
    return [
        "define internal float @kiln_h2f(i16 %h) #1 {",
        "  %x = bitcast i16 %h to half", "  %y = fpext half %x to float", "  ret float %y", "}",
        "define internal i16 @kiln_f2h(float %f) #1 {",
        "  %x = fptrunc float %f to half", "  %y = bitcast half %x to i16", "  ret i16 %y", "}",
    ]


# Software conversions between f32 and the 16-bit floats, branch-free so loops using them
# vectorize. f16 -> f32 is exact: the exponent is rebiased, Inf/NaN get the f32 exponent,
# and denormals are normalized by one float subtraction. f32 -> f16 rounds to nearest even
# (F. Giesen's float_to_half_fast3_rtne): overflow to Inf, NaN to a quiet NaN, denormals by
# one float addition whose hardware rounding is the wanted one.
def _software_f16() -> list:
    return [
        "define internal float @kiln_h2f(i16 %h) #1 {",
        "  %w = zext i16 %h to i32", "  %s = and i32 %w, 32768", "  %sign = shl i32 %s, 16",
        "  %em = and i32 %w, 32767", "  %o0 = shl i32 %em, 13", "  %e = and i32 %o0, 260046848",
        "  %o1 = add i32 %o0, 939524096", "  %o2 = add i32 %o1, 939524096", "  %o3 = add i32 %o1, 8388608",
        "  %f3 = bitcast i32 %o3 to float", f"  %d = fsub float %f3, {fconst(2.0 ** -14)}",
        "  %db = bitcast float %d to i32", "  %special = icmp eq i32 %e, 260046848", "  %den = icmp eq i32 %e, 0",
        "  %r1 = select i1 %special, i32 %o2, i32 %o1", "  %r2 = select i1 %den, i32 %db, i32 %r1",
        "  %r = or i32 %r2, %sign", "  %y = bitcast i32 %r to float", "  ret float %y", "}",
        "define internal i16 @kiln_f2h(float %f) #1 {",
        "  %u = bitcast float %f to i32", "  %sign = and i32 %u, -2147483648", "  %a = xor i32 %u, %sign",
        "  %big = icmp uge i32 %a, 1199570944", "  %nan = icmp ugt i32 %a, 2139095040",
        "  %bigv = select i1 %nan, i32 32256, i32 31744",
        "  %small = icmp ult i32 %a, 947912704", "  %af = bitcast i32 %a to float",
        f"  %ds = fadd float %af, {fconst(0.5)}", "  %dsb = bitcast float %ds to i32",
        "  %smallv = sub i32 %dsb, 1056964608",
        "  %m = lshr i32 %a, 13", "  %odd = and i32 %m, 1", "  %n1 = add i32 %a, -939520001", "  %n2 = add i32 %n1, %odd",
        "  %normv = lshr i32 %n2, 13",
        "  %v1 = select i1 %small, i32 %smallv, i32 %normv", "  %v2 = select i1 %big, i32 %bigv, i32 %v1",
        "  %sh = lshr i32 %sign, 16", "  %v3 = or i32 %v2, %sh", "  %r = trunc i32 %v3 to i16", "  ret i16 %r", "}",
    ]


# bf16 is the top half of an f32: rounding adds 0x7fff plus the kept part's lowest bit; NaN
# stays a quiet NaN. (AVX512-BF16's vcvtneps2bf16 would flush denormals: not the same numbers.)
def _bf16_conversions() -> list:
    return [
        "define internal float @kiln_bf2f(i16 %h) #1 {",
        "  %w = zext i16 %h to i32", "  %s = shl i32 %w, 16", "  %y = bitcast i32 %s to float", "  ret float %y", "}",
        "define internal i16 @kiln_f2bf(float %f) #1 {",
        "  %u = bitcast float %f to i32", "  %top = lshr i32 %u, 16", "  %lsb = and i32 %top, 1",
        "  %r0 = add i32 %u, 32767", "  %r1 = add i32 %r0, %lsb", "  %rn = lshr i32 %r1, 16",
        "  %nan = fcmp uno float %f, 0.0", "  %q = or i32 %top, 64", "  %v = select i1 %nan, i32 %q, i32 %rn",
        "  %r = trunc i32 %v to i16", "  ret i16 %r", "}",
    ]


# What the math library above calls; a kernel's own calls are declared as it emits them.
MATH_DECLS = """
declare float @llvm.maxnum.f32(float, float)
declare float @llvm.minnum.f32(float, float)
declare float @llvm.roundeven.f32(float)
declare float @llvm.fabs.f32(float)
declare float @llvm.copysign.f32(float, float)
"""


def fconst(v: float) -> str:
    """A float constant as LLVM wants it: the f32 value, printed as the bits of a double."""
    v = float(v)
    if v == v and abs(v) > 3.4028234663852886e38:
        v = math.copysign(math.inf, v)
    f32 = struct.unpack("<f", struct.pack("<f", v))[0]
    return f"0x{struct.unpack('<Q', struct.pack('<d', f32))[0]:016X}"
