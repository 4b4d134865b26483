"""numpy dtypes of a bundle's element types, for the loader (numpy alone) and the compiler.

Every element type is numpy's own but bfloat16, the 4- and 2-bit integers and the 8- and
4-bit floats, which numpy lacks: they are ml_dtypes' types (those onnx itself uses) where
ml_dtypes is installed, and otherwise their raw bits (bfloat16 as uint16; the others as
uint8, a 4- or 2-bit value in its low bits), so a bundle still loads and runs with numpy alone.
"""
from __future__ import annotations

import numpy as np


_SMALL_FLOATS = ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float4_e2m1fn",
                 "float8_e8m0fnu")
_ML_DTYPES = {"bfloat16": np.uint16, "int4": np.uint8, "uint4": np.uint8, "int2": np.uint8, "uint2": np.uint8,
              **{name: np.uint8 for name in _SMALL_FLOATS}}
_ML_KINDS = {"bfloat16": "f", "int4": "i", "int2": "i", "uint4": "u", "uint2": "u",
             **{name: "f" for name in _SMALL_FLOATS}}


def numpy_dtype(name: str) -> np.dtype:
    if name in _ML_DTYPES:
        try:
            import ml_dtypes
        except ImportError:
            return np.dtype(_ML_DTYPES[name])
        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def kind(dt: np.dtype) -> str:
    """numpy's kind letter, with ml_dtypes' types the kind they are (numpy says "V")."""
    return _ML_KINDS.get(dt.name, dt.kind)
