"""Cache keys: sha256 over named parts, each one loggable so a miss can be explained.

Everything that changes the object code is a part; nothing else is (paths, log and dump
settings stay out). The kernel enters as its canonical bytes, which hold no tensor or
process-local names.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os

ARTIFACT_FORMAT = 1
# Sources whose change can change generated code, beyond the kernel bytes themselves.
_CODEGEN_SOURCES = ("codegen_worker", os.path.join("ir", "lower"), os.path.join("ir", "ops"),
                    os.path.join("ir", "loop.py"), os.path.join("ir", "schedule.py"))


def hash_sources(entries, suffixes=(".py",)) -> str:
    """sha256 over Kiln's own source files (name and content) below `entries`."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    files = []
    for entry in entries:
        path = os.path.join(root, entry)
        if os.path.isfile(path):
            files.append(path)
        else:
            files += [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.endswith(suffixes)]
    h = hashlib.sha256()
    for f in sorted(files):
        h.update(os.path.relpath(f, root).encode())
        with open(f, "rb") as fh:
            h.update(hashlib.sha256(fh.read()).digest())
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def codegen_source_hash() -> str:
    return hash_sources(_CODEGEN_SOURCES)


def llvm_versions() -> tuple[str, str]:
    from .toolchain import host_toolchain
    t = host_toolchain()
    return t["llvmlite"], t["llvm"]


def key_parts(kernel_bytes: bytes, target, opt_level: int, fallback: bool = False, salt: str = "") -> dict:
    llvmlite_version, llvm_version = llvm_versions()
    return {
        "kernel": hashlib.sha256(kernel_bytes).hexdigest(),
        "triple": target.triple,
        "cpu": target.cpu,
        "features": target.features,
        "llvm_options": list(target.llvm_options),
        "opt_level": opt_level,
        "fallback_schedule": fallback,
        "llvmlite": llvmlite_version,
        "llvm": llvm_version,
        "kiln_codegen": codegen_source_hash(),
        "artifact_format": ARTIFACT_FORMAT,
        "salt": salt,
    }


def key_of(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def explain_difference(old: dict, new: dict) -> list[str]:
    """The parts that differ between two keys, as readable lines."""
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
