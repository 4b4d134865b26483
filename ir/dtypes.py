"""Element types: the one table of what Kiln knows about each.

A tensor's dtype is its ONNX element type by name ("float16", "uint8", ...), kept exactly
from the model to the module's outputs. Each has a *storage* type in the loop IR (what a
buffer holds) and a *compute* type (what a loaded element is while a kernel works on it):
float16 and bfloat16 compute in float32 and round when stored, bool computes as i1 and is
stored as a byte, the 4- and 2-bit integers are stored one to a byte (in its low bits, as
ml_dtypes holds them and so numpy's arrays of them) and compute as 8-bit integers, the 8-
and 4-bit floats (float8_e4m3fn ... float8_e8m0fnu, ml_dtypes' names; ir/minifloats.py) are
stored one to a byte and compute in float32, every other type computes as itself (integers
wrap at their own width).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..artifacts import element_types
from .loop import compute_type, value_bits

numpy_dtype = element_types.numpy_dtype  # one definition for the loader and the compiler


@dataclass(frozen=True)
class DType:
    name: str      # Kiln's and numpy's name
    onnx: int      # TensorProto.DataType
    storage: str   # loop-IR buffer type
    itemsize: int

    @property
    def compute(self) -> str:
        return compute_type(self.storage)

    @property
    def is_float(self) -> bool:
        return self.storage[0] in "fb" and self.storage != "b8"

    @property
    def is_int(self) -> bool:
        return self.storage[0] in "iu"

    @property
    def is_signed(self) -> bool:
        return self.storage[0] == "i" or self.is_float

    @property
    def int_range(self) -> tuple[int, int]:
        """The least and greatest value of an integer type (a 4-bit one's, not its byte's)."""
        width = value_bits(self.storage)
        return (-(1 << (width - 1)), (1 << (width - 1)) - 1) if self.is_signed else (0, (1 << width) - 1)


_TABLE = [DType("float32", 1, "f32", 4), DType("uint8", 2, "u8", 1), DType("int8", 3, "i8", 1),
          DType("uint16", 4, "u16", 2), DType("int16", 5, "i16", 2), DType("int32", 6, "i32", 4),
          DType("int64", 7, "i64", 8), DType("bool", 9, "b8", 1), DType("float16", 10, "f16", 2),
          DType("float64", 11, "f64", 8), DType("uint32", 12, "u32", 4), DType("uint64", 13, "u64", 8),
          DType("bfloat16", 16, "bf16", 2), DType("uint4", 21, "u4", 1), DType("int4", 22, "i4", 1),
          DType("uint2", 25, "u2", 1), DType("int2", 26, "i2", 1), DType("float8_e4m3fn", 17, "f8e4m3fn", 1),
          DType("float8_e4m3fnuz", 18, "f8e4m3fnuz", 1), DType("float8_e5m2", 19, "f8e5m2", 1),
          DType("float8_e5m2fnuz", 20, "f8e5m2fnuz", 1), DType("float4_e2m1fn", 23, "f4e2m1", 1),
          DType("float8_e8m0fnu", 24, "f8e8m0", 1)]
DTYPES = {d.name: d for d in _TABLE}
_BY_ONNX = {d.onnx: d for d in _TABLE}
# Names of the ONNX element types Kiln does not compute in, for error messages.
_OTHER_ONNX = {8: "STRING", 14: "COMPLEX64", 15: "COMPLEX128"}


def dtype(name: str) -> DType:
    return DTYPES[name]


def from_onnx(elem_type: int) -> DType | None:
    return _BY_ONNX.get(elem_type)


def onnx_type_name(elem_type: int) -> str:
    d = _BY_ONNX.get(elem_type)
    return d.name.upper() if d else _OTHER_ONNX.get(elem_type, str(elem_type))


def kiln_name(dt) -> str | None:
    """The Kiln dtype of a numpy dtype, or None if Kiln has none for it."""
    name = np.dtype(dt).name
    return name if name in DTYPES else None


def is_float(name: str) -> bool:
    return DTYPES[name].is_float


def is_int(name: str) -> bool:
    return DTYPES[name].is_int
