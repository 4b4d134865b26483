"""numpy dtypes of a bundle's element types, for the loader (numpy alone) and the compiler.

Every element type is numpy's own but bfloat16, which numpy lacks: it is ml_dtypes'
bfloat16 (the type onnx itself uses) where ml_dtypes is installed, and otherwise the raw
bits as uint16, so a bundle still loads and runs with numpy alone.
"""
from __future__ import annotations

import numpy as np


def numpy_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            return np.dtype(np.uint16)
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def kind(dt: np.dtype) -> str:
    """numpy's kind letter, with ml_dtypes' bfloat16 a float ("f") as it is."""
    return "f" if dt.name == "bfloat16" else dt.kind
