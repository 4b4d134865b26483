"""LLVM's names for loop-IR types and values, and intrinsics more than one part of the
emitter calls (codegen_worker/llvm_emit.py and the parts it is made of)."""
from __future__ import annotations

import struct

from ..ir.loop import SMALL_FLOAT_TYPES, SUB_BYTE_TYPES, bits

from .math_ir import fconst

# LLVM's type for each loop-IR type. Integers are sign-less in LLVM: signedness picks the
# instruction. f16 and bf16 are stored as i16 and converted in software (codegen_worker/math_ir.py), so
# no target needs F16C or AVX512-BF16 and no libgcc helper is linked.
LL = {"f32": "float", "f64": "double", "i1": "i1", "b8": "i8", "f16": "i16", "bf16": "i16",
      **{t: "i8" for t in SUB_BYTE_TYPES + SMALL_FLOAT_TYPES},
      **{f"{s}{w}": f"i{w}" for s in "iu" for w in (8, 16, 32, 64)}}


def literal(value, t: str) -> str:
    """A constant of loop-IR type t as LLVM writes it."""
    if t == "f32":
        return fconst(value)
    if t == "f64":
        return f"0x{struct.unpack('<Q', struct.pack('<d', float(value)))[0]:016X}"
    if t == "i1":
        return "true" if value else "false"
    w = bits(t)
    v = int(value) % (1 << w)  # two's complement: LLVM reads integer literals as signed
    return str(v - (1 << w) if v >= 1 << (w - 1) else v)


# vpdpbusd by vector width (LLVM selects the VEX-encoded AVX-VNNI form for the 256-bit one
# where the target has AVX-VNNI and not AVX-512 VL).
VPDPBUSD = {16: "llvm.x86.avx512.vpdpbusd.512", 8: "llvm.x86.avx512.vpdpbusd.256"}
