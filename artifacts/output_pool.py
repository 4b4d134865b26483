"""Output arrays reused across calls once nobody holds them.

A fresh numpy array of many MB is fresh memory: the entry faults in every page as it writes
the output there (a 1B-parameter decoder's 128 MiB of KV-cache outputs cost it 25 ms a step
at past 512, a sixth of the step). So `Module.run` hands out views of buffers it keeps: a
buffer whose only references are the pool's own is free again (the caller dropped every
array made from it) and serves a later output that fits. An array the caller keeps keeps its
buffer: nothing a caller holds is ever written again.
"""
from __future__ import annotations

import math
import sys

import numpy as np

SLACK = 1.25  # a new buffer is this much larger than asked: a cache growing by a row a step fits again
MIN_POOLED_BYTES = 1 << 20  # smaller outputs are plain np.empty: few pages to save
# Kernels write outputs in place with whole-vector stores: at malloc's 16-byte alignment every
# other 64-byte store of a 3 -> 64 conv at 512 x 512 split a cache line (13.45 ms, 12.90 aligned).
ALIGN = 64
_FREE_REFS = 3  # sys.getrefcount of a free buffer: the pool's list, the loop variable, the call's argument


class OutputPool:
    def __init__(self):
        self._buffers: list[np.ndarray] = []  # uint8 arrays that own their memory

    def array(self, shape: tuple, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize  # (np.prod costs 2 us: a small model's whole call is 10)
        if nbytes < MIN_POOLED_BYTES:
            return np.empty(shape, dtype)
        best, small = None, None
        for buf in self._buffers:
            if sys.getrefcount(buf) != _FREE_REFS:
                continue
            if buf.nbytes - ALIGN >= nbytes and (best is None or buf.nbytes < best.nbytes):
                best = buf
            elif buf.nbytes - ALIGN < nbytes:
                small = buf
        if best is None:
            if small is not None:  # (a free buffer too small for what is asked now: its memory goes back)
                self._buffers = [b for b in self._buffers if b is not small]
            best = np.empty(int(nbytes * SLACK) + ALIGN, np.uint8)
            self._buffers.append(best)
        start = -best.ctypes.data % ALIGN  # (a view of the owner itself: its refcount counts the caller's arrays)
        return best[start:start + nbytes].view(dtype).reshape(shape)
