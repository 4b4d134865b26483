"""What is known about a file, remembered by its stat, the way git's index and ccache's
direct mode do: a model file whose inode, size, mtime and ctime are unchanged since it was
hashed is not hashed again (45 MB of ResNet-18: a fifth of a whole-model hit).

ctime cannot be set by a user, and every write changes it; a record made within RACY_NS of
the file's last change is not trusted (the file may have changed again in the same clock
tick), so the next build hashes again and makes a record that is. A record that cannot be
read or written costs a hash, nothing else. The records live in the store, which trusts
nothing on disk: they are read as regular files only (a FIFO there would block a plain open
forever), never through a link, never past a few KiB, and never in a folder that is a link.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
import time

from ..artifacts.store import DIGEST_RECORD_BYTES, DIGEST_RECORD_FIELDS, NotAnEntry, read_regular

RACY_NS = 2_000_000_000


def _a_real_folder(folder: str) -> bool:
    """A folder, not a link to one (records written through a link would land outside)."""
    try:
        return stat.S_ISDIR(os.lstat(folder).st_mode)
    except OSError:
        return False


def remembered(folder: str | None, path: str, compute) -> dict:
    """compute() -> a JSON-able dict describing the file at `path`, or the one recorded for
    it in `folder` while the file's stat has not changed since."""
    if folder is None:
        return compute()
    try:
        st = os.stat(path)
    except OSError:
        return compute()
    stamp = [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
    record = os.path.join(folder, hashlib.sha256(os.path.realpath(path).encode()).hexdigest()[:32] + ".json")
    try:
        if _a_real_folder(folder):
            saved = json.loads(read_regular(record, DIGEST_RECORD_BYTES))
            if saved["stamp"] == stamp and saved["recorded_ns"] - max(st.st_mtime_ns, st.st_ctime_ns) > RACY_NS:
                return saved["value"]
    except (OSError, NotAnEntry, ValueError, KeyError, TypeError):
        pass
    value = compute()
    try:
        os.makedirs(folder, exist_ok=True)
        if not _a_real_folder(folder):
            return value
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
        with os.fdopen(fd, "w") as f:
            json.dump(dict(zip(DIGEST_RECORD_FIELDS, (stamp, time.time_ns(), value))), f)
        os.replace(tmp, record)
    except OSError:
        pass
    return value
