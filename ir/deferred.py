"""Constants computed when the weights file is written, not when they are lowered.

Lowering repacks most of a model's weights (GEMM panels, conv taps). Computed eagerly, the
packed copies and the weights they come from are all held at once: twice a language
model's bytes. A DeferredArray names its shape and type up front (what memory planning and
the manifest need) and computes its values only when the bundle writes them, in pieces of a
few MB, from the weight it reads (a view: nothing copied until then).
"""
from __future__ import annotations

import math

import numpy as np


class DeferredArray:
    """pieces() yields arrays of `dtype` whose elements, in order, are the value's (C order)."""
    __slots__ = ("shape", "dtype", "_pieces")

    def __init__(self, shape: tuple, dtype, pieces):
        self.shape, self.dtype, self._pieces = tuple(int(d) for d in shape), np.dtype(dtype), pieces

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def pieces(self):
        """The value's pieces as contiguous arrays, checked against the promised type and size
        (a lowering bug must never reach the weights file)."""
        total = 0
        for piece in self._pieces():
            piece = np.ascontiguousarray(piece)
            if piece.dtype != self.dtype:
                raise AssertionError(f"a deferred constant of {self.dtype} computed a piece of {piece.dtype}")
            total += piece.size
            yield piece
        if total != self.size:
            raise AssertionError(f"a deferred constant of {self.size} elements computed {total}")

    def materialize(self) -> np.ndarray:
        return np.concatenate([p.reshape(-1) for p in self.pieces()] or [np.empty(0, self.dtype)]).reshape(self.shape)


def pieces(value):
    """A constant's values in order: an array whole, a deferred one piece by piece."""
    return value.pieces() if isinstance(value, DeferredArray) else (np.ascontiguousarray(value),)
