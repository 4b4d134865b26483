"""Kiln's documented answer for a float cast to an integer type out of its range (ir/casts.py:
ONNX leaves it undefined), written out element by element in Python's integers, and the mask
of elements where ONNX does define a cast. The tests judge defined elements by onnx's
reference evaluator and the others by this definition, never by a library's accident."""
import math

import numpy as np

# (bits, signed) of each integer type
INTEGER_TYPES = {"int8": (8, True), "uint8": (8, False), "int16": (16, True), "uint16": (16, False),
                 "int32": (32, True), "uint32": (32, False), "int64": (64, True), "uint64": (64, False),
                 "int4": (4, True), "uint4": (4, False), "int2": (2, True), "uint2": (2, False)}


def kiln_cast(value: float, dtype: str) -> int:
    """Truncate toward zero, saturate to 64 bits (int64, or uint64 for a uint64's non-negative
    values; NaN is 0), keep the type's low bits (two's complement where signed)."""
    bits, signed = INTEGER_TYPES[dtype]
    if math.isnan(value):
        return 0
    top = (1 << 64) - 1 if dtype == "uint64" and value >= 0 else (1 << 63) - 1
    t = max(-(1 << 63), min(top, math.trunc(value) if math.isfinite(value) else int(math.copysign(top + 1, value))))
    low = t & ((1 << bits) - 1)
    return low - (1 << bits) if signed and low >= 1 << (bits - 1) else low


def kiln_casts(values: np.ndarray, dtype: str) -> list:
    return [kiln_cast(float(v), dtype) for v in np.asarray(values, np.float64).ravel()]


def defined(values: np.ndarray, dtype: str) -> np.ndarray:
    """Where ONNX defines the cast of these floats to `dtype`: finite, and within the type
    once truncated toward zero."""
    bits, signed = INTEGER_TYPES[dtype]
    least, greatest = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    wide = np.asarray(values).astype(np.float64)
    with np.errstate(invalid="ignore"):
        t = np.trunc(wide)
        return np.isfinite(wide) & (t >= least) & (t < float(greatest + 1))  # (exact: a power of two)
