"""The content-addressed store: one file per compiled object, keyed by its cache key.

Entry file: header (magic, format version, key, payload sha256, payload length) + payload.
Written to a temp name in the same folder and renamed into place, so a reader sees a whole
entry or none; verified on every read, so a corrupt, truncated or foreign file is a miss
(deleted, rebuilt, warned about), never a wrong hit. Nothing read from here is unpickled:
payloads are object bytes.

Blobs (`blobs/`) are raw files named by the sha256 of their content: the large files of a
finished bundle (weights). An export hard-links them instead of writing 45 MB again; they
are read-only, and verified against their name before they are handed out.

Nothing on disk is trusted (a restored or shared CI cache can hold anything): files are
opened without following links and without blocking, only regular files are read, and no
more than their header declares; the walk never enters a linked folder, and nothing
outside the store's root is ever deleted. Orphaned temp files (a build killed mid-write)
are counted by stats and swept by gc.
"""
from __future__ import annotations

import errno
import hashlib
import io
import json
import mmap
import os
import shutil
import stat
import struct
import tempfile
import time
import warnings

MAGIC = b"KILNOBJ\0"
FORMAT = 1
_HEADER = struct.Struct("<8sI32s32sQ")  # magic, format, key, payload sha256, payload length
ORPHAN_AGE_S = 3600.0  # a temp file older than this belongs to no running write: a killed build's


DIGEST_RECORD_BYTES = 64 * 1024  # a file digest record is a few hundred bytes
# A file digest record's fields (orchestrator/file_digests.py writes and reads them).
DIGEST_RECORD_FIELDS = ("stamp", "recorded_ns", "value")


def digest_record_problem(data: bytes) -> str:
    """What is wrong with a file digest record's bytes ('' if nothing)."""
    try:
        record = json.loads(data)
    except ValueError:
        return "not a JSON digest record"
    if not isinstance(record, dict) or set(record) != set(DIGEST_RECORD_FIELDS):
        return f"not a digest record ({', '.join(DIGEST_RECORD_FIELDS)})"
    return ""


class NotAnEntry(Exception):
    """A path in the store holds something that is not a readable regular file."""


def read_regular(path: str, limit: int | None = None) -> bytes:
    """A regular file's bytes: opened without following a link and without blocking (a FIFO
    would hang a plain open), refusing anything that is not a regular file or is larger than
    `limit`. FileNotFoundError passes through; every other refusal is NotAnEntry."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise
    except OSError as e:
        raise NotAnEntry("a symbolic link" if e.errno == errno.ELOOP else str(e)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotAnEntry("not a regular file")
        if limit is not None and st.st_size > limit:
            raise NotAnEntry(f"{st.st_size} bytes, more than the {limit} it may hold")
        chunks, left = [], st.st_size
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def mapped(path: str, regular_only: bool = False):
    """A read-only mapping of a whole file (empty bytes for an empty file): hashing or parsing
    a 45 MB model this way copies nothing into Python. With regular_only, a link or anything
    but a regular file is NotAnEntry (store files)."""
    flags = os.O_RDONLY | (os.O_NOFOLLOW | os.O_NONBLOCK if regular_only else 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if regular_only and e.errno == errno.ELOOP:
            raise NotAnEntry("a symbolic link") from None
        raise
    try:
        st = os.fstat(fd)
        if regular_only and not stat.S_ISREG(st.st_mode):
            raise NotAnEntry("not a regular file")
        return mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if st.st_size else b""
    finally:
        os.close(fd)


def file_sha256(path: str, regular_only: bool = False) -> str:
    data = mapped(path, regular_only)
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
        # Tuning records (orchestrator/tuning_records.py): entries like objects, kept apart so
        # they can be counted and listed; and what finds them (a record filed under another
        # key, a model's summary).
        self.records = os.path.join(self.root, "records")
        self.record_index = os.path.join(self.root, "record_index")
        # What is known about model files, by their stat (orchestrator/file_digests.py): one
        # small JSON record a file, no shards.
        self.digests = os.path.join(self.root, "digests")
        if not readonly:
            os.makedirs(self.objects, exist_ok=True)

    def blob_path(self, digest: str) -> str:
        return os.path.join(self.root, "blobs", digest[:2], digest[2:])

    def put_blob(self, data) -> str:
        """Store raw content (bytes, or a TemporaryBlob: linked or copied, never read into
        memory) under its sha256; returns the digest (also when read-only, so the caller can
        still name it)."""
        digest = data.sha256 if isinstance(data, TemporaryBlob) else hashlib.sha256(data).hexdigest()
        path = self.blob_path(digest)
        if self.readonly or Store.blob(self, digest) is not None:  # this folder's copy, not a remote's
            return digest
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path))
            try:
                if isinstance(data, TemporaryBlob):  # (its name reserved; the blob takes it)
                    os.close(fd)
                    os.unlink(tmp)
                    data.write_to(tmp)
                else:
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
            st = os.lstat(path)
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
                actual = file_sha256(path, regular_only=True)
            except NotAnEntry as e:
                actual = f"({e})"
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

    def path(self, key: str, section: str = "objects") -> str:
        """Where the entry `key` lies: in `section`, "objects" (objects and bundles) or "records"."""
        return os.path.join(self.root, section, key[:2], key[2:])

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

    def prefetch(self, keys, section: str = "objects") -> int:
        """Make the entries of `keys` local before they are read one by one; how many were
        fetched. A folder has nothing to fetch (a store with a server behind it does)."""
        return 0

    def get(self, key: str) -> bytes | None:
        view = self.get_view(key)
        return None if view is None else view.tobytes()

    def get_view(self, key: str, section: str = "objects") -> memoryview | None:
        """Like get, but a read-only view of the payload: no copy (for large entries)."""
        path = self.path(key, section)
        try:
            data = read_regular(path)
            payload, why = self.check(key, data)
        except FileNotFoundError:
            return None
        except NotAnEntry as e:
            payload, why = None, str(e)
        except OSError as e:
            warnings.warn(f"kiln cache: cannot read {path}: {e}; compiling instead")
            return None
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

    def put(self, key: str, payload: bytes, section: str = "objects") -> None:
        if self.readonly:
            return
        path = self.path(key, section)
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

    def _remove(self, path: str) -> None:
        """Remove what stands at `path` (a file, a link itself, a FIFO, a folder that took an
        entry's place) and the stamp a blob may have beside it; never anything outside the
        store's root, and never through a link."""
        if os.path.commonpath([self.root, os.path.abspath(path)]) != self.root:
            return
        for p in (path, path + ".ok"):
            try:
                if stat.S_ISDIR(os.lstat(p).st_mode):
                    shutil.rmtree(p, ignore_errors=True)  # rmtree does not follow links inside
                else:
                    os.remove(p)
            except OSError:
                pass

    def _walk(self):
        """(kind, key, path, lstat) of everything in the entry folders, links never followed:
        kind is "entry", "record" (a tuning record), "index" (what finds one), "blob", "digest" (a
        file digest record), "temp", or "foreign" (a link, FIFO or folder where an entry belongs, a linked or
        non-folder shard)."""
        yield from self._walk_digests()
        tops = ((self.objects, "entry"), (self.records, "record"), (self.record_index, "index"),
                (os.path.join(self.root, "blobs"), "blob"))
        for top, kind in tops:
            if kind in ("record", "index") and not os.path.lexists(top):  # (made by the first record written)
                continue
            try:
                if not stat.S_ISDIR(os.lstat(top).st_mode):
                    yield "foreign", "", top, None
                    continue
                shards = sorted(os.listdir(top))
            except OSError:
                continue
            for sub in shards:
                folder = os.path.join(top, sub)
                try:
                    st = os.lstat(folder)
                except OSError:
                    continue
                if not stat.S_ISDIR(st.st_mode):  # a linked shard folder is never entered
                    yield "foreign", "", folder, st
                    continue
                for name in sorted(os.listdir(folder)):
                    path = os.path.join(folder, name)
                    try:
                        st = os.lstat(path)
                    except OSError:
                        continue
                    if name.endswith(".ok") and kind == "blob":
                        continue
                    if name.startswith(".tmp-"):
                        yield "temp", "", path, st
                    elif stat.S_ISREG(st.st_mode):
                        yield kind, sub + name, path, st
                    else:
                        yield "foreign", sub + name, path, st

    def _walk_digests(self):
        try:
            st = os.lstat(self.digests)
            names = sorted(os.listdir(self.digests)) if stat.S_ISDIR(st.st_mode) else None
        except OSError:
            return
        if names is None:  # a link (or a file) where the folder belongs: never entered
            yield "foreign", "", self.digests, st
            return
        for name in names:
            path = os.path.join(self.digests, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if name.startswith(".tmp-"):
                yield "temp", "", path, st
            else:
                yield ("digest" if stat.S_ISREG(st.st_mode) else "foreign"), name, path, st

    def entries(self):
        """(key, path, size, mtime) of every entry and blob file, temp files excluded
        (a blob's key is its digest). Tuning records are not among them: they are small, cost
        measurements to remake, and gc keeps them."""
        for kind, key, path, st in self._walk():
            if kind not in ("entry", "blob"):
                continue
            mtime = st.st_mtime
            try:  # a blob: its stamp says when it was last used
                mtime = max(mtime, os.lstat(path + ".ok").st_mtime)
            except OSError:
                pass
            yield key, path, st.st_size, mtime

    def _orphans(self) -> list:
        now = time.time()
        return [(path, st.st_size) for kind, _, path, st in self._walk()
                if kind == "temp" and now - st.st_mtime > ORPHAN_AGE_S]

    def stats(self) -> dict:
        sizes = [size for _, _, size, _ in self.entries()]
        records = [st.st_size for kind, _, _, st in self._walk() if kind == "record"]
        orphans = self._orphans()
        return {"root": self.root, "entries": len(sizes), "bytes": sum(sizes), "records": len(records),
                "record_bytes": sum(records), "orphaned_temp_files": len(orphans),
                "orphaned_bytes": sum(size for _, size in orphans)}

    def record_keys(self) -> list[str]:
        """The keys of the tuning records held here (not a remote cache's)."""
        return [key for kind, key, _, _ in self._walk() if kind == "record"]

    def verify(self) -> list[tuple[str, str]]:
        """Re-hash every entry and blob; delete (unless read-only) and return the bad ones,
        with reasons: damaged entries, and whatever is not an entry where one belongs."""
        bad = []
        for kind, key, path, _ in list(self._walk()):
            if kind == "temp":
                continue
            if kind == "foreign":
                bad.append((path, "not a regular file (a link, FIFO or folder)"))
            else:
                valid_key = len(key) == 64 and all(c in "0123456789abcdef" for c in key)
                try:
                    if kind == "blob":
                        ok = file_sha256(path, regular_only=True) == key
                        why = "" if ok else "content does not match its name"
                    elif kind == "digest":
                        why, valid_key = digest_record_problem(read_regular(path, DIGEST_RECORD_BYTES)), True
                    else:
                        why = self.check(key if valid_key else None, read_regular(path))[1]
                except (NotAnEntry, OSError) as e:
                    why = str(e)
                if valid_key and not why:
                    continue
                bad.append((path, why or "file name is not a key"))
            if not self.readonly:
                self._remove(path)
        return bad

    def gc(self, max_bytes: int) -> dict:
        """Delete least recently used entries until the store holds at most max_bytes.
        Safe while builds run: an entry deleted under a reader is just a miss."""
        removed = freed = 0
        for path, size in self._orphans():  # temp files no write will ever finish
            self._remove(path)
            removed, freed = removed + 1, freed + size
        items = sorted(self.entries(), key=lambda e: e[3])
        total = sum(e[2] for e in items)
        for key, path, size, _ in items:
            if total <= max_bytes:
                break
            self._remove(path)
            total -= size
            freed += size
            removed += 1
        return {"removed": removed, "freed_bytes": freed, "bytes": total}


_COPY_CHUNK = 16 << 20


class _FileContent:
    """A bundle file kept on disk: sized and compared like bytes, read only when asked."""
    size: int

    def __len__(self) -> int:
        return self.size

    def __eq__(self, other) -> bool:
        return bytes(self) == bytes(other)


class TemporaryBlob(_FileContent):
    """A bundle file too large to hold in memory (a model's weights), written once, piece by
    piece, to an unnamed temporary file: the page cache holds it, not this process, and it
    is gone with its last reference, even after a crash. Read, compared and exported like
    StoredFile; its sha256 is known from the writing."""

    def __init__(self):
        try:  # (O_TMPFILE without O_EXCL, unlike tempfile's: the file may be given a name later)
            self._file = os.fdopen(os.open(tempfile.gettempdir(), os.O_TMPFILE | os.O_RDWR, 0o600), "w+b")
        except (AttributeError, OSError):  # no O_TMPFILE here: a file unlinked at once
            self._file = tempfile.TemporaryFile(prefix="kiln-blob-")
        self._hash = hashlib.sha256()
        self.size = 0

    def write(self, data) -> None:
        self._file.write(data)
        self._hash.update(data)
        self.size += memoryview(data).nbytes

    @classmethod
    def adopt(cls, fd: int, size: int, sha256: str) -> "TemporaryBlob":
        """The blob whose file another process wrote and handed over as `fd` (a model host's
        weights: orchestrator/model_hosts.py), of `size` bytes and that sha256."""
        blob = cls.__new__(cls)
        blob._file, blob._hash, blob.size = os.fdopen(fd, "r+b"), _KnownDigest(sha256), size
        return blob

    @property
    def sha256(self) -> str:
        return self._hash.hexdigest()

    def fileno(self) -> int:
        self._file.flush()
        return self._file.fileno()

    def copy_to(self, f) -> None:
        """Write the whole content into the open binary file f."""
        self._file.flush()
        fd, pos = self._file.fileno(), 0
        while pos < self.size:
            chunk = os.pread(fd, min(_COPY_CHUNK, self.size - pos), pos)
            if not chunk:
                raise OSError(f"a temporary blob ended at {pos} of its {self.size} bytes")
            f.write(chunk)
            pos += len(chunk)

    def __bytes__(self) -> bytes:
        out = io.BytesIO()
        self.copy_to(out)
        return out.getvalue()

    def __hash__(self):
        return hash(self.sha256)

    def write_to(self, dest: str) -> None:
        """A new file `dest` with the content: the unnamed file itself given that name where
        the system allows (an O_TMPFILE file on the same file system: nothing copied)."""
        self._file.flush()
        try:  # (a src_dir_fd makes Python call linkat, which follows /proc's link to the file)
            root = os.open("/", os.O_RDONLY)
            try:
                os.link(f"/proc/self/fd/{self._file.fileno()}", dest, src_dir_fd=root, follow_symlinks=True)
            finally:
                os.close(root)
            return
        except OSError:  # another file system, no /proc, or a file already unlinked: copy
            pass
        with open(dest, "wb") as f:
            self.copy_to(f)


class _KnownDigest:
    def __init__(self, hexdigest: str):
        self._hex = hexdigest

    def hexdigest(self) -> str:
        return self._hex


class StoredFile(_FileContent):
    """A bundle file that is a verified blob in the store: written out by hard link (or a
    copy across file systems), read only if someone asks for its bytes."""

    def __init__(self, path: str, size: int):
        self.path, self.size = path, size

    def __bytes__(self) -> bytes:
        with open(self.path, "rb") as f:
            return f.read()

    def __hash__(self):
        return hash(self.path)

    def write_to(self, dest: str) -> None:
        try:
            os.link(self.path, dest)
        except OSError:  # another file system, or links not allowed: copy
            shutil.copyfile(self.path, dest)
