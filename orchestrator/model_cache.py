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

from ..artifacts.store import StoredFile, file_sha256, mapped
from ..ir import external_data
from ..ir.errors import KilnError

from .cache_key import hash_sources, llvm_versions
from .file_digests import remembered
from .toolchain import host_toolchain

_SOURCES = ("ir", "orchestrator", "codegen_worker", "artifacts", "configs")
LARGE = 1 << 20  # bundle files above this size are stored as blobs and exported by hard link


@functools.lru_cache(maxsize=1)
def kiln_source_hash() -> str:
    """Every Kiln source file: a frontend or pass change must invalidate whole-model hits."""
    return hash_sources(_SOURCES, (".py", ".json", ".c"))  # .c: the thread pool linked into modules


def _model_data(model):
    """The model's serialized bytes: given, serialized, or the file mapped read-only."""
    if isinstance(model, (bytes, bytearray)):
        return bytes(model)
    if hasattr(model, "SerializeToString"):
        return model.SerializeToString(deterministic=True)
    return mapped(os.fspath(model))


def _describe(data) -> dict:
    return {"sha256": hashlib.sha256(data).hexdigest(),
            "locations": sorted({loc for _, loc in external_data.external_locations(data)})}


def content_digest(model, memo: str | None = None) -> bytes | None:
    """sha256 over every byte the model reads: the model itself and each external data file
    (by its location). None where that cannot be known (an unreadable file, external data
    without a folder to find it in): such a model is not looked up whole. With `memo` (a
    folder), files unchanged since they were last hashed are not hashed again."""
    in_memory = isinstance(model, (bytes, bytearray)) or hasattr(model, "SerializeToString")
    try:
        if in_memory:
            info = _describe(_model_data(model))
        else:
            info = remembered(memo, os.fspath(model), lambda: _describe(_model_data(model)))
        h = hashlib.sha256(bytes.fromhex(info["sha256"]))
        locations = info["locations"]
    except (OSError, ValueError):
        return None
    if locations:
        if in_memory:  # no folder to find the files in
            return None
        model_dir = os.path.dirname(os.path.abspath(os.fspath(model)))
        for loc in locations:
            try:
                path = external_data.resolve(model_dir, "", loc)
                digest = remembered(memo, path, lambda: {"sha256": file_sha256(path)})["sha256"]
                h.update(loc.encode() + b"\0" + bytes.fromhex(digest))
            except (KilnError, OSError):
                return None
    return h.digest()


def _linker_identity(target) -> str | None:
    """The C compiler that links the target's module (a cross compiler for another
    architecture; None: there is none, and the bundle holds objects)."""
    if target.runnable:
        return host_toolchain()["cc"]  # (recorded: no compiler process on a whole-model hit)
    from ..artifacts.link import compiler_identity, find_linker
    linker = find_linker(target.arch)
    return compiler_identity(linker) if linker else None


def model_key(model, target, opt_level: int, shapes, salt: str, memo: str | None = None, dims=None,
              precision: str = "fp32", fp32_nodes=(), accuracy: dict | None = None) -> str | None:
    """The store key of a finished bundle, or None if the model cannot be read (the normal
    path then reports the problem). memo: see content_digest."""
    digest = content_digest(model, memo)
    if digest is None:
        return None
    settings = {"target": target.to_dict(), "opt_level": opt_level, "salt": salt,
                "shapes": {k: list(v) for k, v in (shapes or {}).items()}, "kiln": kiln_source_hash(),
                "llvm": list(llvm_versions()), "cc": _linker_identity(target)}
    if dims:  # (only then: a static build's key is what it always was)
        settings["dims"] = {k: list(v) for k, v in dims.items()}
    if precision != "fp32":  # (likewise: a float32 build's key is what it always was)
        settings["precision"] = precision
    if fp32_nodes:
        settings["fp32_nodes"] = sorted(fp32_nodes)
    if accuracy:  # (the budget's record is in the bundle's manifest)
        settings["accuracy"] = accuracy
    h = hashlib.sha256(b"kiln-model-v2\0")
    h.update(digest)
    h.update(json.dumps(settings, sort_keys=True).encode())
    return h.hexdigest()


def with_tuning(key: str, tuning: str) -> str:
    """A whole-model key for a build with tuning off ("off") or following a tune's summary (its
    digest): the plain key is that of a build that found no summary."""
    return hashlib.sha256(f"kiln-model-tuning\0{key}\0{tuning}".encode()).hexdigest()


def pack(files: dict[str, bytes], report: dict, store=None) -> bytes:
    """A bundle and its build report as one payload: a JSON index, then the small files'
    bytes. Files above LARGE go to the store as blobs (named by their sha256 in the index),
    so a hit can hard-link them instead of writing them again."""
    names = sorted(files)
    index, inline = [], []
    for n in names:
        data = files[n]
        if store is not None and len(data) > LARGE:
            index.append([n, len(data), store.put_blob(data)])
        else:
            index.append([n, len(data)])
            inline.append(bytes(data))
    head = json.dumps({"files": index, "report": report}).encode()
    return struct.pack("<Q", len(head)) + head + b"".join(inline)


def unpack(payload, store=None) -> tuple[dict, dict]:
    """Inverse of pack: small files as bytes, blobs as StoredFile (verified). Raises
    ValueError when the entry is inconsistent or a blob is missing or damaged."""
    payload = memoryview(payload)
    (n,) = struct.unpack_from("<Q", payload)
    index = json.loads(bytes(payload[8:8 + n]))
    files, pos = {}, 8 + n
    for name, size, *blob in index["files"]:
        if blob:
            path = store.blob(blob[0]) if store is not None else None
            if path is None:
                raise ValueError(f"bundle file {name}: blob {blob[0][:12]} is missing or damaged")
            files[name] = StoredFile(path, size)
            continue
        files[name] = payload[pos:pos + size].tobytes()
        pos += size
    if pos != len(payload):
        raise ValueError("bundle entry size mismatch")
    return files, index["report"]
