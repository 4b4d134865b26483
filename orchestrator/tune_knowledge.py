"""Learning from the store: the records already measured start and steer a new search.

Every record keeps its kernel's *features* (its kind: the first op and the knobs it has; the
log2 of its GEMM's m, n and k, or of its output's size) and the log of the points its search
measured (point, ratio; None for a failure). A tune reads the records of this store that were
measured at the same target, thread count, toolchain and search space, and from them:

- *starts*: a kernel with no record of its own begins with the schedules that won on the
  most similar kernels of its kind (nearest sizes);
- *predictions*: a point's expected ratio is the mean of the ratios it measured on kernels
  of the same kind, weighted by how near their sizes are (a nearest-neighbour cost model);
  the search tries the points predicted best first, and those predicted to lose last.

Only the local store is read (an HTTP cache cannot be listed): records a build fetched from
one are local from then on.
"""
from __future__ import annotations

import math

from ..ir.loop import Gemm
from ..ir.schedule import canonical

from .tuning_records import SECTION, decode, record_parts

SIMILAR_STARTS = 2  # schedules taken from the nearest tuned kernels
NEAR = 1.0  # log2 distance at which a record's weight falls to 1/e
MAX_LOG = 400  # points a record keeps


def kernel_features(call) -> dict:
    gemm = _first_gemm(call.kernel.body)
    if gemm is not None and all(isinstance(v, int) for v in (gemm.m, gemm.n, gemm.k)):
        sizes = [gemm.m, gemm.n, gemm.k]
    else:
        sizes = [call.kernel.buffers[0].size]
    return {"kind": f"{call.ops[0]}|{','.join(sorted(call.space))}",
            "sizes": [round(math.log2(max(s, 1)), 3) for s in sizes]}


def _first_gemm(body):
    stack = list(body)
    while stack:
        s = stack.pop(0)
        if isinstance(s, Gemm):
            return s
        stack[:0] = list(getattr(s, "body", ()) or ()) + list(getattr(s, "then", ()) or ())
    return None


def _distance(a: list, b: list) -> float:
    if len(a) != len(b):
        return math.inf
    return math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b)))


class Knowledge:
    """What this store's records say about kernels like the ones being tuned."""

    def __init__(self, store, target, threads: int):
        expected = record_parts("", target, threads)
        self.records = []
        for key in store.record_keys() if store is not None else ():
            payload = store.get_view(key, SECTION)
            try:
                record = decode(payload, None) if payload is not None else None
            except ValueError:
                continue
            parts = (record or {}).get("parts", {})
            if record and "features" in record and all(parts.get(k) == v for k, v in expected.items() if k != "kernel"):
                self.records.append(record)

    def _alike(self, features: dict, exclude: str = ""):
        """(distance, record) of the same kind, nearest first."""
        same = [(_distance(features["sizes"], r["features"]["sizes"]), r) for r in self.records
                if r["features"]["kind"] == features["kind"] and r["parts"]["kernel"] != exclude]
        return sorted(((d, r) for d, r in same if d < math.inf), key=lambda pair: pair[0])

    def starts(self, features: dict, digest: str) -> list[dict]:
        """The winning schedules of the most similar tuned kernels."""
        out = []
        for _, record in self._alike(features, digest):
            if record["schedule"] and record["schedule"] not in out:
                out.append(record["schedule"])
            if len(out) == SIMILAR_STARTS:
                break
        return out

    def predictor(self, features: dict, digest: str):
        """point -> expected ratio (None: nothing like it measured), for one kernel."""
        weighted: dict[str, list] = {}
        for d, record in self._alike(features, digest):
            w = math.exp(-(d / NEAR) ** 2)
            for point, ratio in record.get("log", []):
                value = 2.0 if ratio is None else ratio  # (a failure: as bad as twice as slow)
                weighted.setdefault(canonical(point), []).append((w, value))

        def predict(point: dict) -> float | None:
            seen = weighted.get(canonical(point))
            total = sum(w for w, _ in seen) if seen else 0.0
            return sum(w * v for w, v in seen) / total if total > 1e-6 else None
        return predict

