"""The 8- and 4-bit float formats ONNX names, as loop-IR storage types: one byte an element
(a 4-bit one in its low bits, as ml_dtypes holds it), computing as f32.

Each is a sign bit, `ebits` of exponent with `bias`, `mbits` of mantissa, subnormals where
the exponent field is 0, and one of four ways with what a float32 has and they lack:
  - "ieee" (E5M2): all-ones exponent is Inf (mantissa 0) or NaN, as in IEEE 754;
  - "fn" (E4M3FN): no Inf; S.1111.111 is NaN, the rest of the top binade is finite;
  - "fnuz" (E4M3FNUZ, E5M2FNUZ): no Inf, no -0; 0x80 (the code of -0) is the one NaN;
  - "none" (E2M1): no Inf, no NaN; a NaN becomes -0 (+0 if its sign bit is set) and any
    overflow the greatest value, as ml_dtypes (onnx's reference) converts.
E8M0 (float8_e8m0fnu, the scale of microscaling formats) is an exponent alone: 2^(code -
127), 0xFF NaN, no sign and no zero. A float converts to it by its exponent bits, rounded by
Cast's `round_mode` (up where any fraction bit is set, down, or to nearest as onnx's
reference does it) and, with `saturate`, never past 2^127.

The conversions themselves are codegen's (codegen_worker/minifloat_ir.py); this module
imports nothing, so the loop IR and codegen share one table.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Minifloat:
    ebits: int
    mbits: int
    bias: int
    specials: str  # "ieee", "fn", "fnuz" or "none" (see the module doc)

    @property
    def sign_bit(self) -> int:
        return 1 << (self.ebits + self.mbits)

    @property
    def greatest(self) -> float:
        """The greatest finite value."""
        top = (1 << self.ebits) - 1 - (self.specials == "ieee")  # the highest exponent of finite values
        mantissa = (1 << self.mbits) - 1 - (self.specials == "fn")  # S.1111.111 is NaN
        return (1 + mantissa / (1 << self.mbits)) * 2.0 ** (top - self.bias)


MINIFLOATS = {
    "f8e4m3fn": Minifloat(4, 3, 7, "fn"),
    "f8e4m3fnuz": Minifloat(4, 3, 8, "fnuz"),
    "f8e5m2": Minifloat(5, 2, 15, "ieee"),
    "f8e5m2fnuz": Minifloat(5, 2, 16, "fnuz"),
    "f4e2m1": Minifloat(2, 1, 1, "none"),
}

E8M0 = "f8e8m0"
E8M0_ROUNDINGS = ("up", "down", "nearest")


def e8m0_rounding(round_mode: str, saturate: bool) -> str:
    """The loop-IR call rounding an f32 to E8M0 (then back, exactly) as Cast's attributes say."""
    return f"round_{E8M0}_{round_mode}" + ("_sat" if saturate else "")
