"""Conversions between f32 and the 8- and 4-bit floats (ir/minifloats.py), as LLVM IR
functions of the math library: branch-free, so loops using them vectorize.

To f32 is exact: a normal code's exponent is rebiased and its mantissa shifted into place,
a subnormal's mantissa scaled by its power of two, then the format's specials and the sign.

From f32 rounds to nearest even: |x| is scaled by a power of two so that the format's unit
in the last place, at x's binade (or at the least normal one, below it), becomes 1;
roundeven, and scaling back, give the rounded value exactly, from whose bits the code is
taken (a subnormal's as the integer it is in units of the least subnormal). A rounded value
past the greatest finite one is the format's overflow code (Inf, or NaN where there is no
Inf; the E2M1 format saturates), NaN its NaN code. Saturation (Cast's `saturate`) clamps
before this, in the loop IR.
"""
from __future__ import annotations

import math
import struct

from ..ir.minifloats import E8M0, E8M0_ROUNDINGS, MINIFLOATS, Minifloat

_F32_EXP = 0x7F800000
_F32_ABS = 0x7FFFFFFF


def to_float_name(storage: str) -> str:
    return f"kiln_{storage}_to_f"


def from_float_name(storage: str) -> str:
    return f"kiln_f_to_{storage}"


def _float_hex(v: float) -> str:
    """An f32 constant as LLVM writes it (the bits of the double of that value)."""
    if math.isinf(v) or math.isnan(v):
        return "0x7FF0000000000000" if v > 0 else "0xFFF0000000000000" if math.isinf(v) else "0x7FF8000000000000"
    return f"0x{struct.unpack('<Q', struct.pack('<d', v))[0]:016X}"


def _least_normal_bits(fmt: Minifloat) -> int:
    """The f32 bits of the format's least normal value, 2^(1 - bias)."""
    return (127 + 1 - fmt.bias) << 23


def _to_float(storage: str, fmt: Minifloat) -> list:
    mantissa_mask = (1 << fmt.mbits) - 1
    lines = [f"define internal float @{to_float_name(storage)}(i8 %c) #1 {{",
             "  %w = zext i8 %c to i32", f"  %mag = and i32 %w, {fmt.sign_bit - 1}",
             f"  %sb = and i32 %w, {fmt.sign_bit}", "  %neg = icmp ne i32 %sb, 0",
             f"  %exp = lshr i32 %mag, {fmt.mbits}", f"  %mant = and i32 %mag, {mantissa_mask}",
             f"  %e1 = add i32 %exp, {127 - fmt.bias}", "  %e2 = shl i32 %e1, 23",
             f"  %m2 = shl i32 %mant, {23 - fmt.mbits}", "  %nb = or i32 %e2, %m2", "  %nf = bitcast i32 %nb to float",
             "  %mf = uitofp i32 %mant to float",
             f"  %sf = fmul float %mf, {_float_hex(2.0 ** (1 - fmt.bias - fmt.mbits))}",
             "  %isub = icmp eq i32 %exp, 0", "  %v = select i1 %isub, float %sf, float %nf"]
    nan = _float_hex(math.nan)
    if fmt.specials == "ieee":
        lines += [f"  %top = icmp eq i32 %exp, {(1 << fmt.ebits) - 1}", "  %zm = icmp eq i32 %mant, 0",
                  f"  %io = select i1 %zm, float {_float_hex(math.inf)}, float {nan}",
                  "  %v2 = select i1 %top, float %io, float %v"]
    elif fmt.specials == "fn":
        lines += [f"  %isnan = icmp eq i32 %mag, {fmt.sign_bit - 1}",
                  f"  %v2 = select i1 %isnan, float {nan}, float %v"]
    elif fmt.specials == "fnuz":
        lines += [f"  %isnan = icmp eq i32 %w, {fmt.sign_bit}", f"  %v2 = select i1 %isnan, float {nan}, float %v"]
    else:
        lines += ["  %v2 = fadd float %v, 0.0"]
    return lines + ["  %nv = fneg float %v2", "  %r = select i1 %neg, float %nv, float %v2", "  ret float %r", "}"]


def _overflow_code(fmt: Minifloat) -> int:
    if fmt.specials == "ieee":
        return ((1 << fmt.ebits) - 1) << fmt.mbits  # Inf
    if fmt.specials == "fn":
        return fmt.sign_bit - 1  # NaN
    return fmt.sign_bit  # fnuz's NaN (E2M1 saturates before: never used)


def _from_float(storage: str, fmt: Minifloat) -> list:
    greatest = _float_hex(fmt.greatest)
    least_normal = _least_normal_bits(fmt)
    lines = [f"define internal i8 @{from_float_name(storage)}(float %f) #1 {{",
             "  %u = bitcast float %f to i32", "  %s = lshr i32 %u, 31", f"  %a0 = and i32 %u, {_F32_ABS}",
             f"  %nan = icmp ugt i32 %a0, {_F32_EXP}", "  %af0 = bitcast i32 %a0 to float"]
    if fmt.specials == "none":  # saturates: no Inf to overflow to
        lines += [f"  %af = call float @llvm.minnum.f32(float %af0, float {greatest})",
                  "  %a = bitcast float %af to i32"]
    else:
        lines += ["  %af = fadd float %af0, 0.0", "  %a = add i32 %a0, 0"]
    lines += [f"  %e0 = and i32 %a, {_F32_EXP}", f"  %lo = icmp ult i32 %e0, {least_normal}",
              f"  %e = select i1 %lo, i32 {least_normal}, i32 %e0",
              f"  %ub = sub i32 %e, {fmt.mbits << 23}", "  %ulp = bitcast i32 %ub to float",
              f"  %ib = sub i32 {254 << 23}, %ub", "  %inv = bitcast i32 %ib to float",
              "  %x = fmul float %af, %inv", "  %xr = call float @llvm.roundeven.f32(float %x)",
              "  %r = fmul float %xr, %ulp", "  %rb = bitcast float %r to i32",
              f"  %normal = icmp uge i32 %rb, {least_normal}", "  %re = lshr i32 %rb, 23",
              f"  %ef = sub i32 %re, {127 - fmt.bias}", f"  %eh = shl i32 %ef, {fmt.mbits}",
              f"  %mf = lshr i32 %rb, {23 - fmt.mbits}", f"  %mm = and i32 %mf, {(1 << fmt.mbits) - 1}",
              "  %cn = or i32 %eh, %mm",
              f"  %sx = fmul float %r, {_float_hex(2.0 ** (fmt.bias - 1 + fmt.mbits))}",
              "  %cs = fptoui float %sx to i32",
              "  %c0 = select i1 %normal, i32 %cn, i32 %cs",
              f"  %over = fcmp ogt float %r, {greatest}",
              f"  %c1 = select i1 %over, i32 {_overflow_code(fmt)}, i32 %c0",
              f"  %c2 = select i1 %nan, i32 {_nan_code(fmt)}, i32 %c1",
              f"  %sg = shl i32 %s, {fmt.ebits + fmt.mbits}",
              # (xor: E2M1's NaN code is -0's, and a negative NaN gives +0, as ml_dtypes converts)
              f"  %signed = {'or' if fmt.specials == 'fnuz' else 'xor'} i32 %c2, %sg"]
    if fmt.specials == "fnuz":  # no -0: a zero keeps no sign (NaN's code has the bit already)
        lines += ["  %nz = icmp ne i32 %c2, 0", "  %c3 = select i1 %nz, i32 %signed, i32 %c2"]
    else:
        lines += ["  %c3 = add i32 %signed, 0"]
    return lines + ["  %t = trunc i32 %c3 to i8", "  ret i8 %t", "}"]


def _nan_code(fmt: Minifloat) -> int:
    if fmt.specials == "ieee":
        return (((1 << fmt.ebits) - 1) << fmt.mbits) | (1 << (fmt.mbits - 1))  # quiet NaN
    if fmt.specials == "fn":
        return fmt.sign_bit - 1
    return fmt.sign_bit  # fnuz's NaN; E2M1's -0, what ml_dtypes makes of a NaN


def e8m0_encoder_name(round_mode: str, saturate: bool) -> str:
    return f"kiln_f_to_{E8M0}_{round_mode}" + ("_sat" if saturate else "")


def _e8m0_to_float() -> list:
    """2^(code - 127): the code as an f32 exponent (code 0, 2^-127, a subnormal), 0xFF NaN."""
    return [f"define internal float @{to_float_name(E8M0)}(i8 %c) #1 {{",
            "  %w = zext i8 %c to i32", "  %b = shl i32 %w, 23", "  %zero = icmp eq i32 %w, 0",
            "  %b2 = select i1 %zero, i32 4194304, i32 %b", "  %nan = icmp eq i32 %w, 255",
            "  %b3 = select i1 %nan, i32 2143289344, i32 %b2", "  %f = bitcast i32 %b3 to float", "  ret float %f", "}"]


def _e8m0_from_float(round_mode: str, saturate: bool) -> list:
    """An f32's exponent bits, rounded as onnx's reference rounds them (ir/minifloats.py)."""
    lines = [f"define internal i8 @{e8m0_encoder_name(round_mode, saturate)}(float %f) #1 {{",
             "  %u = bitcast float %f to i32", "  %e0 = lshr i32 %u, 23", "  %e = and i32 %e0, 255",
             "  %special = icmp eq i32 %e, 255"]
    if round_mode == "down":
        lines += ["  %up = icmp ne i32 0, 0"]
    elif round_mode == "up":  # any fraction bit
        lines += [f"  %frac = and i32 %u, {0x7FFFFF}", "  %up = icmp ne i32 %frac, 0"]
    else:  # the guard bit, and any bit after it or a nonzero exponent (onnx's reference)
        lines += [f"  %gb = and i32 %u, {0x400000}", "  %g = icmp ne i32 %gb, 0",
                  f"  %rest = and i32 %u, {0x3FFFFF}", "  %rs = icmp ne i32 %rest, 0", "  %lsb = icmp ne i32 %e, 0",
                  "  %tie = or i1 %rs, %lsb", "  %up = and i1 %g, %tie"]
    if saturate:  # never past 2^127
        lines += ["  %top = icmp eq i32 %e, 254", "  %below = xor i1 %top, true", "  %go = and i1 %up, %below"]
    else:
        lines += ["  %go = and i1 %up, true"]
    return lines + ["  %inc = zext i1 %go to i32", "  %r = add i32 %e, %inc",
                    "  %code = select i1 %special, i32 255, i32 %r", "  %t = trunc i32 %code to i8", "  ret i8 %t", "}"]


def minifloat_conversions(code: str) -> list:
    """The conversion functions that `code` (a kernel's LLVM IR) calls."""
    lines = []
    for storage, fmt in MINIFLOATS.items():
        if f"@{to_float_name(storage)}(" in code:
            lines += _to_float(storage, fmt)
        if f"@{from_float_name(storage)}(" in code:
            lines += _from_float(storage, fmt)
    if f"@{to_float_name(E8M0)}(" in code:
        lines += _e8m0_to_float()
    for round_mode in E8M0_ROUNDINGS:
        for saturate in (False, True):
            if f"@{e8m0_encoder_name(round_mode, saturate)}(" in code:
                lines += _e8m0_from_float(round_mode, saturate)
    return lines
