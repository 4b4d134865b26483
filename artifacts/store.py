"""The content-addressed store: one file per compiled object, keyed by its cache key.

Entry file: header (magic, format version, key, payload sha256, payload length) + payload.
Written to a temp name in the same folder and renamed into place, so a reader sees a whole
entry or none; verified on every read, so a corrupt, truncated or foreign file is a miss
(deleted, rebuilt, warned about), never a wrong hit. Nothing read from here is unpickled:
payloads are object bytes.
"""
from __future__ import annotations

import hashlib
import os
import struct
import tempfile
import warnings

MAGIC = b"KILNOBJ\0"
FORMAT = 1
_HEADER = struct.Struct("<8sI32s32sQ")  # magic, format, key, payload sha256, payload length


class Store:
    def __init__(self, root: str, readonly: bool = False):
        self.root = os.path.abspath(os.path.expanduser(root))
        self.readonly = readonly
        self.objects = os.path.join(self.root, "objects")
        if not readonly:
            os.makedirs(self.objects, exist_ok=True)

    def path(self, key: str) -> str:
        return os.path.join(self.objects, key[:2], key[2:])

    @staticmethod
    def encode(key: str, payload: bytes) -> bytes:
        return _HEADER.pack(MAGIC, FORMAT, bytes.fromhex(key), hashlib.sha256(payload).digest(), len(payload)) + payload

    @staticmethod
    def check(key: str | None, data: bytes) -> tuple[memoryview | None, str]:
        """(payload, "") if `data` is a valid entry (for `key`, if given), else (None, reason)."""
        if len(data) < _HEADER.size:
            return None, "shorter than the header"
        magic, fmt, k, digest, n = _HEADER.unpack_from(data)
        if magic != MAGIC:
            return None, "not a Kiln store entry (bad magic)"
        if fmt != FORMAT:
            return None, f"format {fmt}, expected {FORMAT}"
        if key is not None and k != bytes.fromhex(key):
            return None, "entry holds another key"
        payload = memoryview(data)[_HEADER.size:]  # a view: large entries are never copied
        if len(payload) != n:
            return None, f"truncated: {len(payload)} of {n} payload bytes"
        if hashlib.sha256(payload).digest() != digest:
            return None, "payload checksum mismatch"
        return payload, ""

    def get(self, key: str) -> bytes | None:
        view = self.get_view(key)
        return None if view is None else view.tobytes()

    def get_view(self, key: str) -> memoryview | None:
        """Like get, but a read-only view of the payload: no copy (for large entries)."""
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            warnings.warn(f"kiln cache: cannot read {path}: {e}; compiling instead")
            return None
        payload, why = self.check(key, data)
        if payload is None:
            warnings.warn(f"kiln cache: entry {path} is invalid ({why}); it will be rebuilt")
            if not self.readonly:
                self._remove(path)
            return None
        if not self.readonly:
            try:
                os.utime(path)  # recency for LRU garbage collection
            except OSError:
                pass
        return payload

    def put(self, key: str, payload: bytes) -> None:
        if self.readonly:
            return
        path = self.path(key)
        folder = os.path.dirname(path)
        try:
            os.makedirs(folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(self.encode(key, payload))
                os.replace(tmp, path)
            except BaseException:
                self._remove(tmp)
                raise
        except OSError as e:  # a full disk or a read-only mount must not fail the build
            warnings.warn(f"kiln cache: cannot write {path}: {e}")

    @staticmethod
    def _remove(path: str) -> None:
        try:
            os.remove(path)
        except OSError:
            pass

    def entries(self):
        """(key, path, size, mtime) of every entry file, temp files excluded."""
        if not os.path.isdir(self.objects):
            return
        for sub in sorted(os.listdir(self.objects)):
            folder = os.path.join(self.objects, sub)
            if not os.path.isdir(folder):
                continue
            for name in sorted(os.listdir(folder)):
                if name.startswith(".tmp-"):
                    continue
                path = os.path.join(folder, name)
                try:
                    st = os.stat(path)
                except FileNotFoundError:
                    continue
                yield sub + name, path, st.st_size, st.st_mtime

    def stats(self) -> dict:
        sizes = [size for _, _, size, _ in self.entries()]
        return {"root": self.root, "entries": len(sizes), "bytes": sum(sizes)}

    def verify(self) -> list[tuple[str, str]]:
        """Re-hash every entry; delete (unless read-only) and return the bad ones with reasons."""
        bad = []
        for key, path, _, _ in list(self.entries()):
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError as e:
                bad.append((path, str(e)))
                continue
            valid_key = len(key) == 64 and all(c in "0123456789abcdef" for c in key)
            payload, why = self.check(key if valid_key else None, data)
            if payload is None or not valid_key:
                bad.append((path, why or "file name is not a key"))
                if not self.readonly:
                    self._remove(path)
        return bad

    def gc(self, max_bytes: int) -> dict:
        """Delete least recently used entries until the store holds at most max_bytes.
        Safe while builds run: an entry deleted under a reader is just a miss."""
        items = sorted(self.entries(), key=lambda e: e[3])
        total = sum(e[2] for e in items)
        removed = freed = 0
        for key, path, size, _ in items:
            if total <= max_bytes:
                break
            self._remove(path)
            total -= size
            freed += size
            removed += 1
        return {"removed": removed, "freed_bytes": freed, "bytes": total}
