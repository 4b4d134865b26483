"""A small log beside the store: one JSON line per build, for hit rates and miss explanations.

Each line records the build's lookups and hits and, per kernel, the key parts, so
`kiln explain` can say which part changed since the last build of the same model.
"""
from __future__ import annotations

import json
import os
import time

LOG_NAME = "builds.jsonl"
KEEP_LINES = 200


def append(store_root: str, model: str, kernels: list[dict], hits: int, lookups: int) -> None:
    path = os.path.join(store_root, LOG_NAME)
    line = json.dumps({"time": time.time(), "model": model, "hits": hits, "lookups": lookups,
                       "kernels": kernels}, separators=(",", ":"))
    try:
        with open(path, "a") as f:  # O_APPEND: concurrent builds interleave whole lines
            f.write(line + "\n")
        if os.path.getsize(path) > 8 << 20:
            _trim(path)
    except OSError:
        pass  # a log is a convenience; it never fails a build


def _trim(path: str) -> None:
    lines = read(os.path.dirname(path))[-KEEP_LINES:]
    tmp = path + f".tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(e, separators=(",", ":")) + "\n" for e in lines)
    os.replace(tmp, path)


def read(store_root: str) -> list[dict]:
    path = os.path.join(store_root, LOG_NAME)
    out = []
    try:
        with open(path, encoding="utf-8", errors="replace") as f:  # garbage bytes must not stop stats
            for line in f:
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue  # a torn line from a crash: skip it
                if isinstance(entry, dict) and isinstance(entry.get("hits"), int) and \
                        isinstance(entry.get("lookups"), int):
                    out.append(entry)
    except OSError:
        pass
    return out


def recent_hit_rate(store_root: str, last: int = 10) -> dict | None:
    entries = read(store_root)[-last:]
    if not entries:
        return None
    hits = sum(e["hits"] for e in entries)
    lookups = sum(e["lookups"] for e in entries)
    return {"builds": len(entries), "hits": hits, "lookups": lookups, "hit_rate": hits / lookups if lookups else 0.0}


def previous_parts(store_root: str, model: str) -> dict[str, dict]:
    """Key parts of each kernel (by its node names) in the last logged build of `model`."""
    for entry in reversed(read(store_root)):
        if entry.get("model") == model and entry.get("kernels"):  # whole-model hits log no parts
            return {k["id"]: k["parts"] for k in entry.get("kernels", [])}
    return {}
