"""A codegen worker's toolchain identity: the parts of its toolchain that decide object bytes.

A cache key names the driver's toolchain; an object compiled where any of these parts differ
must not be stored under it. Ray actors report their identity when they start
(orchestrator.ray_actor) and the driver compares it with its own.
"""
from __future__ import annotations

import functools
import hashlib
import json

from .cache_key import codegen_source_hash
from .toolchain import host_toolchain

# The parts of a toolchain that decide the object bytes: an object compiled where any of them
# differs must not be stored under a key that names ours. (The CPU a worker runs on is not
# one: a job names its target CPU and features explicitly. It is reported, not compared.)
IDENTITY_PARTS = ("kiln_codegen", "llvmlite", "llvm", "triple")


def toolchain_identity() -> dict:
    """This process's toolchain as a codegen worker reports it: the IDENTITY_PARTS, plus the
    host CPU and Kiln's version for the report."""
    from ..artifacts.manifest import KILN_VERSION
    t = host_toolchain()
    return {"kiln_codegen": codegen_source_hash(), "llvmlite": t["llvmlite"], "llvm": t["llvm"],
            "triple": t["triple"], "cpu": t["cpu"], "kiln": KILN_VERSION}


@functools.lru_cache(maxsize=1)
def local_identity() -> dict:
    """This process's identity (the driver's, or a local executor's workers')."""
    identity = toolchain_identity()
    return {**identity, "digest": identity_digest(identity)}


def identity_digest(identity: dict) -> str:
    """A short name for the parts that must match (worker pools are named by it)."""
    text = json.dumps({k: identity.get(k) for k in IDENTITY_PARTS}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def identity_difference(ours: dict, theirs: dict) -> str:
    """How a worker's toolchain differs from ours, readably ('' if it does not)."""
    diffs = []
    for part in IDENTITY_PARTS:
        a, b = ours.get(part), theirs.get(part)
        if a != b:
            shown = (lambda v: str(v)[:12]) if part == "kiln_codegen" else str
            diffs.append(f"{part} {shown(b)} there, {shown(a)} here")
    return "; ".join(diffs)
