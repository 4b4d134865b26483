"""The content-addressed store: one file per compiled object, keyed by its cache key.

Entry file: header (magic, format version, key, payload sha256, payload length) + payload.
Written to a temp name in the same folder and renamed into place, so a reader sees a whole
entry or none; verified on every read, so a corrupt, truncated or foreign file is a miss
(deleted, rebuilt, warned about), never a wrong hit. Nothing read from here is unpickled:
payloads are object bytes.

Blobs (`blobs/`) are raw files named by the sha256 of their content: the large files of a
finished bundle (weights). An export hard-links them instead of writing 45 MB again; they
are read-only, and verified against their name before they are handed out.
"""
from __future__ import annotations

import hashlib
import mmap
import os
import shutil
import struct
import tempfile
import warnings

MAGIC = b"KILNOBJ\0"
FORMAT = 1
_HEADER = struct.Struct("<8sI32s32sQ")  # magic, format, key, payload sha256, payload length


def mapped(path: str):
    """A read-only mapping of a whole file (empty bytes for an empty file): hashing or parsing
    a 45 MB model this way copies nothing into Python."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""


def file_sha256(path: str) -> str:
    data = mapped(path)
    try:
        return hashlib.sha256(data).hexdigest()
    finally:
        if isinstance(data, mmap.mmap):
            data.close()


class Store:
    def __init__(self, root: str, readonly: bool = False):
        self.root = os.path.abspath(os.path.expanduser(root))
        self.readonly = readonly
        self.objects = os.path.join(self.root, "objects")
        if not readonly:
            os.makedirs(self.objects, exist_ok=True)

    def blob_path(self, digest: str) -> str:
        return os.path.join(self.root, "blobs", digest[:2], digest[2:])

    def put_blob(self, data) -> str:
        """Store raw content under its sha256; returns the digest (also when read-only, so
        the caller can still name it)."""
        digest = hashlib.sha256(data).hexdigest()
        path = self.blob_path(digest)
        if self.readonly or self.blob(digest) is not None:
            return digest
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path))
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.chmod(tmp, 0o444)  # an exported hard link must not be edited in place
                os.replace(tmp, path)
            except BaseException:
                self._remove(tmp)
                raise
        except OSError as e:
            warnings.warn(f"kiln cache: cannot write {path}: {e}")
        return digest

    def blob(self, digest: str) -> str | None:
        """The path of a verified blob, or None (a damaged one is warned about and removed).

        Hashing 45 MB on every hit would be a third of a whole-model hit, so a blob carries a
        stamp (`NAME.ok`: inode, size, mtime when it was last hashed); while the file still
        matches its stamp it was not written since, and is not hashed again. (Whatever reads
        a bundle's weights checks them against the manifest's sha256 as well.)"""
        path = self.blob_path(digest)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        except OSError as e:
            warnings.warn(f"kiln cache: cannot read {path}: {e}")
            return None
        stamp = f"{st.st_ino} {st.st_size} {st.st_mtime_ns}"
        try:
            with open(path + ".ok") as f:
                trusted = f.read() == stamp
        except OSError:
            trusted = False
        if not trusted:
            try:
                actual = file_sha256(path)
            except OSError as e:
                warnings.warn(f"kiln cache: cannot read {path}: {e}")
                return None
            if actual != digest:
                warnings.warn(f"kiln cache: blob {path} does not match its name; it will be rebuilt")
                if not self.readonly:
                    self._remove(path)
                return None
        if not self.readonly:
            try:  # the stamp's mtime is the blob's recency for LRU garbage collection
                with open(path + ".ok", "w") as f:
                    f.write(stamp)
            except OSError:
                pass
        return path

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
        """Remove a file and the stamp a blob may have beside it."""
        for p in (path, path + ".ok"):
            try:
                os.remove(p)
            except OSError:
                pass

    def entries(self):
        """(key, path, size, mtime) of every entry and blob file, temp files excluded
        (a blob's key is its digest)."""
        for top in (self.objects, os.path.join(self.root, "blobs")):
            if not os.path.isdir(top):
                continue
            for sub in sorted(os.listdir(top)):
                folder = os.path.join(top, sub)
                if not os.path.isdir(folder):
                    continue
                for name in sorted(os.listdir(folder)):
                    if name.startswith(".tmp-") or name.endswith(".ok"):
                        continue
                    path = os.path.join(folder, name)
                    try:
                        st = os.stat(path)
                    except FileNotFoundError:
                        continue
                    mtime = st.st_mtime
                    if os.path.exists(path + ".ok"):  # a blob: its stamp says when it was last used
                        mtime = max(mtime, os.stat(path + ".ok").st_mtime)
                    yield sub + name, path, st.st_size, mtime

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
            if os.path.dirname(os.path.dirname(path)).endswith("blobs"):
                payload, why = (data, "") if hashlib.sha256(data).hexdigest() == key else (None, "content does not "
                                                                                         "match its name")
            else:
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


class StoredFile:
    """A bundle file that is a verified blob in the store: written out by hard link (or a
    copy across file systems), read only if someone asks for its bytes."""

    def __init__(self, path: str, size: int):
        self.path, self.size = path, size

    def __bytes__(self) -> bytes:
        with open(self.path, "rb") as f:
            return f.read()

    def __len__(self) -> int:
        return self.size

    def __eq__(self, other) -> bool:
        return bytes(self) == bytes(other)

    def __hash__(self):
        return hash(self.path)

    def write_to(self, dest: str) -> None:
        try:
            os.link(self.path, dest)
        except OSError:  # another file system, or links not allowed: copy
            shutil.copyfile(self.path, dest)
