"""Kiln's answer where ONNX's Cast leaves the result undefined: a float converted to an integer
type out of that type's range (NaN and the infinities among them).

ONNX defines a float-to-integer Cast only where the value, truncated toward zero, fits the
type. Libraries disagree on the rest (numpy goes through a C cast; ml_dtypes 0.7 answers 0 for
its 4- and 2-bit types, where earlier releases kept the low bits), so Kiln fixes its own
answer, the same in every kernel (codegen_worker/llvm_emit.py, `_cast`) and at build time
(constant folding):

1. truncate toward zero;
2. saturate to the 64-bit integers: int64 for a signed type or a negative value, uint64 for a
   uint64 destination's non-negative values; NaN is 0;
3. keep the destination's low bits (two's complement for a signed type), as ONNX's
   integer-to-integer Cast does.

So 300.0 to int8 is 44, -1.0 to uint8 is 255, +Inf to int32 is -1 (int64's greatest, its low
32 bits), NaN is 0 everywhere. Where ONNX defines the result this is that result.
"""
from __future__ import annotations

import numpy as np

from .dtypes import DTYPES, numpy_dtype
from .loop import SUB_BYTE_TYPES, value_bits

_TWO_63 = 2.0 ** 63


def float_to_integer(values: np.ndarray, dtype_name: str) -> np.ndarray:
    """`values` (any float type) cast to the integer type `dtype_name` as Kiln's kernels cast."""
    storage = DTYPES[dtype_name].storage
    shape = np.shape(values)
    t = np.trunc(np.asarray(values).astype(np.float64).reshape(-1))  # (1-D: a 0-d one is a scalar)
    t[np.isnan(t)] = 0
    # (float64 holds no int64 greatest: the top end is placed by comparison, not by a cast)
    whole = np.clip(t, -_TWO_63, _TWO_63 - 1024).astype(np.int64)
    whole[t >= _TWO_63] = np.iinfo(np.int64).max
    if storage == "u64":
        whole = whole.view(np.uint64)
        big = t >= _TWO_63
        whole[big] = np.minimum(t[big], 2.0 ** 64 - 2048).astype(np.uint64)
        whole[t >= 2.0 ** 64] = np.iinfo(np.uint64).max
    if storage not in SUB_BYTE_TYPES:
        return whole.astype(numpy_dtype(dtype_name)).reshape(shape)  # numpy's integer casts keep the low bits
    bits = value_bits(storage)
    low = whole & ((1 << bits) - 1)
    if DTYPES[dtype_name].is_signed:
        low = np.where(low >= 1 << (bits - 1), low - (1 << bits), low)
    return low.astype(numpy_dtype(dtype_name)).reshape(shape)
