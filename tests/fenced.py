"""Output arrays fenced by guard bytes, to catch a kernel writing outside the caller's buffer.

Kernels write a model's outputs straight into the arrays the caller passes (`Module.run`'s
`out=`, orchestrator.bundle.output_homes). Those are not arena buffers: nothing pads them to
whole vectors or aligns them past their element size. A FencedOutputs places each output
one element past a 64-byte boundary, between guard bytes, so a vector store that rounds up
to a whole register, a row written past its end or an aligned access shows.
"""
from __future__ import annotations

import numpy as np

GUARD = 0xA5
GUARD_BYTES = 128


class FencedOutputs:
    def __init__(self, like: dict):
        """One fenced array per output, of the shape and dtype of `like`'s (name -> array)."""
        self._buffers, self.arrays = {}, {}
        for name, a in like.items():
            a = np.asarray(a)
            raw = np.full(a.nbytes + 2 * GUARD_BYTES + 64, GUARD, np.uint8)
            start = -raw.ctypes.data % 64 + GUARD_BYTES + a.itemsize  # (element-aligned, not vector-aligned)
            self._buffers[name] = (raw, start, a.nbytes)
            self.arrays[name] = raw[start:start + a.nbytes].view(a.dtype).reshape(a.shape)

    def trespassed(self) -> list[str]:
        """The outputs whose guard bytes were written."""
        return [name for name, (raw, start, n) in self._buffers.items()
                if (raw[:start] != GUARD).any() or (raw[start + n:] != GUARD).any()]
