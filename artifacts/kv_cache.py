"""KVCache: the buffers a module's KV caches live in between calls (`Module.new_cache`).

A bundle whose decoder appends to its `past_key_values` in place (manifest `caches`,
ir/passes/kv_cache.py) reads each past from, and writes each present into, one buffer per
layer and kind, `capacity` entries long along the cache's axis. A KVCache holds those
buffers and how many entries they hold; `Module.run(feeds, cache=cache)` takes the past
inputs from it, appends this call's entries and returns the presents as views of it. A step
then copies nothing that grows with the past.
"""
from __future__ import annotations

import numpy as np

from .element_types import numpy_dtype
from .errors import KilnError
from .manifest import dim_value


class KVCache:
    def __init__(self, manifest, values: dict):
        """values: every symbol the buffers' shapes name (the batch, the capacities)."""
        self.specs = manifest.caches
        outputs = {s["name"]: s for s in manifest.outputs}
        self.buffers = {}
        for c in self.specs:
            spec = outputs[c["present"]]
            shape = [dim_value(d, values) for d in spec["shape"]]
            shape[c["axis"]] = values[c["capacity"]]
            self.buffers[c["present"]] = np.zeros(shape, numpy_dtype(spec["dtype"]))
        self.length = 0  # entries held along each cache's axis: the next call's past length

    @property
    def capacity(self) -> int:
        return min(self.buffers[c["present"]].shape[c["axis"]] for c in self.specs)

    def past(self, spec: dict, length: int | None = None) -> np.ndarray:
        """The entries a cache holds (a view; `length` of them, default all)."""
        cut = [slice(None)] * self.buffers[spec["present"]].ndim
        cut[spec["axis"]] = slice(0, self.length if length is None else length)
        return self.buffers[spec["present"]][tuple(cut)]

    def __getitem__(self, name: str) -> np.ndarray:
        """A present's (or its past input's) entries so far, by name."""
        for c in self.specs:
            if name in (c["past"], c["present"]):
                return self.past(c)
        raise KilnError(f"the cache has no tensor '{name}' (it holds {', '.join(c['present'] for c in self.specs)})")

    def reset(self) -> None:
        """Start over (a new prompt): the buffers are kept, their entries forgotten."""
        self.length = 0

    def __repr__(self) -> str:
        return f"KVCache({len(self.specs)} buffers, {self.length} of {self.capacity} entries held)"
