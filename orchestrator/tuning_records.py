"""Tuning records: a kernel's measured best schedule, kept in the store beside the objects.

A record's key names everything its result depends on: the kernel (the digest of its IR under
the hand-written rules), the target (triple, CPU, features, LLVM options), the thread count it
was measured at, the toolchain (llvmlite, LLVM, Kiln's codegen sources) and the search space's
version (ir/schedule.py). Its value is data, JSON, verified on read and never executed: the
chosen schedule (knob -> value; {} when the rules won), the measured ratios against the rules'
schedule, and the machine it was measured on. Records travel through the HTTP cache as
action-cache entries, like objects.

A record from another toolchain or search-space version is never applied: its exact key does
not match. Each record is also filed under a *seed* key (the same without toolchain and space
version), where a later tune finds it as a starting point, and a build notices that a kernel
was tuned once but its record no longer applies (it says so: no silent fall back).

A model's *summary* lists the records a tune found for its kernels; its digest enters the
whole-model key, so a tuned bundle is never answered with an untuned one (or the reverse).
"""
from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import warnings

from ..ir.schedule import SPACE_VERSION, ScheduleError, check

from .cache_key import key_of
from .toolchain_identity import local_identity

RECORD_FORMAT = 1
SECTION = "records"  # the store's folder for them
INDEX = "record_index"  # the folder for records filed under their seed keys, and models' summaries
MAX_RECORD_BYTES = 256 * 1024


def usable_cores() -> int:
    return len(os.sched_getaffinity(0))


def seed_parts(kernel_digest: str, target, threads: int) -> dict:
    """What a record's result depends on, but the toolchain and the search space."""
    return {"kind": "kiln-tuning-record", "kernel": kernel_digest, "triple": target.triple, "cpu": target.cpu,
            "features": target.features, "llvm_options": list(target.llvm_options), "threads": int(threads)}


def record_parts(kernel_digest: str, target, threads: int) -> dict:
    ident = local_identity()
    return {**seed_parts(kernel_digest, target, threads), "llvmlite": ident["llvmlite"], "llvm": ident["llvm"],
            "kiln_codegen": ident["kiln_codegen"], "space_version": SPACE_VERSION}


def machine_fingerprint() -> dict:
    """The machine a record was measured on: reported, not part of its key (the target is)."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return {"cpu_model": model, "usable_cores": usable_cores(), "host_cpu": local_identity().get("cpu", "")}


def make_record(parts: dict, schedule: dict, ratio: float, ratios: list, default_ms: float, trials: int,
                failed: int, name: str, complete: bool, sizes: dict | None = None, features: dict | None = None,
                log: list = ()) -> dict:
    """complete: the search ran its course (a tune that ran out of budget first leaves it
    incomplete, and the next tune goes on from its schedule). features and log: what later
    tunes learn from (orchestrator/tune_knowledge.py)."""
    return {"format": RECORD_FORMAT, "parts": parts, "schedule": check(schedule), "ratio": round(float(ratio), 4),
            "complete": bool(complete), **({"features": features} if features else {}),
            "log": [[check(p), None if r is None else round(float(r), 4)] for p, r in log],
            "ratios": [round(float(r), 4) for r in ratios], "default_ms": round(float(default_ms), 6),
            "trials": int(trials), "failed": int(failed), "name": name, "sizes": sizes or {},
            "machine": machine_fingerprint(),
            "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def encode(record: dict) -> bytes:
    return json.dumps(record, sort_keys=True, separators=(",", ":")).encode()


def decode(payload, parts: dict | None) -> dict:
    """A record read from the store, checked field by field (and against the parts it was
    looked up by, if given). Raises ValueError saying what is wrong."""
    if len(payload) > MAX_RECORD_BYTES:
        raise ValueError(f"{len(payload)} bytes, more than a record holds")
    try:
        record = json.loads(bytes(payload))
    except ValueError:
        raise ValueError("not JSON") from None
    if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT:
        raise ValueError(f"not a format-{RECORD_FORMAT} tuning record")
    if parts is not None and record.get("parts") != parts:
        raise ValueError("it was measured for another kernel, target or toolchain than its key says")
    if not isinstance(record.get("complete", True), bool):
        raise ValueError("'complete' is not a bool")
    ratio = record.get("ratio")
    if not isinstance(ratio, (int, float)) or not (0 < ratio < 100) or math.isnan(ratio):
        raise ValueError(f"ratio {ratio!r}")
    try:
        record["schedule"] = check(record.get("schedule"))
        record["log"] = [[check(p), r] for p, r in record.get("log", [])
                         if r is None or (isinstance(r, (int, float)) and 0 < r < 100)]
    except (ScheduleError, TypeError, ValueError) as e:
        raise ValueError(f"its log: {e}") from None
    features = record.get("features")
    if features is not None and not (isinstance(features, dict) and isinstance(features.get("kind"), str)
                                     and isinstance(features.get("sizes"), list)
                                     and all(isinstance(s, (int, float)) for s in features["sizes"])):
        raise ValueError("its features are not a kind and sizes")
    return record


class Records:
    """The records of one store for builds and tunes at one target and thread count."""

    def __init__(self, store, target, threads: int | None = None):
        self.store, self.target = store, target
        self.threads = threads or usable_cores()
        self.stale: list[str] = []  # kernels tuned once whose records no longer apply (lookup)

    def lookup(self, call) -> dict | None:
        """lower()'s `schedules`: the record for a kernel call, or None. (A kernel over run-time
        sizes has one schedule for all of them, measured at the sizes its record names.)"""
        record = self.find(call.default_digest)
        if record is None and self.seed(call.default_digest) is not None:
            self.stale.append(call.name)
        return record

    def _read(self, key: str, parts: dict | None, section: str = SECTION) -> dict | None:
        payload = self.store.get_view(key, section) if self.store is not None else None
        if payload is None:
            return None
        try:
            return decode(payload, parts)
        except ValueError as e:
            warnings.warn(f"kiln: tuning record {key[:12]} is unusable ({e}); ignored")
            return None

    def find(self, kernel_digest: str) -> dict | None:
        """The record that applies to this kernel here, or None."""
        parts = record_parts(kernel_digest, self.target, self.threads)
        return self._read(key_of(parts), parts)

    def seed(self, kernel_digest: str) -> dict | None:
        """The latest record for this kernel from any toolchain or search space: a start, never applied."""
        return self._read(key_of(seed_parts(kernel_digest, self.target, self.threads)), None, INDEX)

    def keep(self, record: dict) -> str:
        """Store a record under its exact key and its seed key; returns the exact key."""
        parts = record["parts"]
        key = key_of(parts)
        if self.store is not None:
            data = encode(record)
            self.store.put(key, data, SECTION)
            seed = {k: parts[k] for k in seed_parts("", self.target, 0)}
            self.store.put(key_of(seed), data, INDEX)
        return key

    # -- a model's summary: which records its tune found ----------------------------------------
    def _summary_key(self, model_key: str) -> str:
        # (the model's key already names every Kiln source: a whole-model hit hashes nothing more)
        return key_of({"kind": "kiln-tuning-summary", "model": model_key, "threads": self.threads,
                       "space_version": SPACE_VERSION})

    def summary_digest(self, model_key: str) -> str | None:
        """The digest of the model's summary, if a tune wrote one: part of the whole-model key."""
        payload = self.store.get_view(self._summary_key(model_key), INDEX) if self.store is not None else None
        return None if payload is None else hashlib.sha256(payload).hexdigest()

    def keep_summary(self, model_key: str, records: dict) -> None:
        """records: kernel digest -> record key, for every kernel of the model that has one."""
        if self.store is not None:
            data = json.dumps({"format": RECORD_FORMAT, "records": dict(sorted(records.items()))},
                              sort_keys=True).encode()
            self.store.put(self._summary_key(model_key), data, INDEX)
