"""Whole-model hits: an unchanged model (same bytes, target, options, Kiln) skips everything.

The store already makes a rebuild compile nothing; this goes further for CI, where most
commits leave most models untouched: the finished bundle is a store entry too, keyed by the
model's bytes and every build setting, so a hit costs one hash of the model file and one
read. Builds with custom passes, pass contexts, fault injection or --verify-cache bypass it
(their settings cannot be hashed faithfully, or they must compile).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import struct

from artifacts.link import compiler_identity
from ir import external_data
from ir.errors import KilnError

from .cache_key import hash_sources, llvm_versions

_SOURCES = ("ir", "orchestrator", "codegen_worker", "artifacts", "configs")
LARGE = 1 << 20  # bundle files above this size are handed out as views, not copies


@functools.lru_cache(maxsize=1)
def kiln_source_hash() -> str:
    """Every Kiln source file: a frontend or pass change must invalidate whole-model hits."""
    return hash_sources(_SOURCES, (".py", ".json"))


def model_bytes(model) -> bytes:
    if isinstance(model, (bytes, bytearray)):
        return bytes(model)
    if hasattr(model, "SerializeToString"):
        return model.SerializeToString(deterministic=True)
    with open(os.fspath(model), "rb") as f:
        return f.read()


def _file_digest(path: str) -> bytes:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.digest()


def content_digest(model) -> bytes | None:
    """sha256 over every byte the model reads: the model itself and each external data file
    (by its location). None where that cannot be known (an unreadable file, external data
    without a folder to find it in): such a model is not looked up whole."""
    try:
        data = model_bytes(model)
        locations = sorted({loc for _, loc in external_data.external_locations(data)})
    except (OSError, ValueError):
        return None
    h = hashlib.sha256(hashlib.sha256(data).digest())
    if locations:
        if isinstance(model, (bytes, bytearray)) or hasattr(model, "SerializeToString"):
            return None
        model_dir = os.path.dirname(os.path.abspath(os.fspath(model)))
        for loc in locations:
            try:
                path = external_data.resolve(model_dir, "", loc)
                h.update(loc.encode() + b"\0" + _file_digest(path))
            except (KilnError, OSError):
                return None
    return h.digest()


def model_key(model, target, opt_level: int, shapes, salt: str) -> str | None:
    """The store key of a finished bundle, or None if the model cannot be read (the normal
    path then reports the problem)."""
    digest = content_digest(model)
    if digest is None:
        return None
    settings = {"target": target.to_dict(), "opt_level": opt_level, "salt": salt,
                "shapes": {k: list(v) for k, v in (shapes or {}).items()}, "kiln": kiln_source_hash(),
                "llvm": list(llvm_versions()), "cc": compiler_identity()}
    h = hashlib.sha256(b"kiln-model-v2\0")
    h.update(digest)
    h.update(json.dumps(settings, sort_keys=True).encode())
    return h.hexdigest()


def pack(files: dict[str, bytes], report: dict) -> bytes:
    """A bundle and its build report as one payload: a JSON index, then the files' bytes."""
    names = sorted(files)
    index = json.dumps({"files": [[n, len(files[n])] for n in names], "report": report}).encode()
    return struct.pack("<Q", len(index)) + index + b"".join(files[n] for n in names)


def unpack(payload) -> tuple[dict, dict]:
    """Inverse of pack. Given a memoryview, the files are views into it: a 45 MB weights file
    is not copied again on its way from the store to the bundle folder."""
    payload = memoryview(payload)
    (n,) = struct.unpack_from("<Q", payload)
    index = json.loads(bytes(payload[8:8 + n]))
    files, pos = {}, 8 + n
    for name, size in index["files"]:
        view = payload[pos:pos + size]
        files[name] = view if size > LARGE else view.tobytes()  # only big files stay views
        pos += size
    if pos != len(payload):
        raise ValueError("bundle entry size mismatch")
    return files, index["report"]
