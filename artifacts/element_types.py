"""numpy dtypes of a bundle's element types, for the loader (numpy alone) and the compiler.

Every element type is numpy's own but bfloat16 and the 4- and 2-bit integers, which numpy
lacks: they are ml_dtypes' types (those onnx itself uses) where ml_dtypes is installed, and
otherwise their raw bits (bfloat16 as uint16; int4, uint4, int2, uint2 as uint8, the value in
its low bits), so a bundle still loads and runs with numpy alone.
"""
from __future__ import annotations

import numpy as np


_ML_DTYPES = {"bfloat16": np.uint16, "int4": np.uint8, "uint4": np.uint8, "int2": np.uint8, "uint2": np.uint8}
_ML_KINDS = {"bfloat16": "f", "int4": "i", "int2": "i", "uint4": "u", "uint2": "u"}


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
