"""Compile leases: builders that share a store share the work of compiling.

A CI farm runs many `kiln build`s on one store; started together on one model, each found
every kernel missing and compiled it (four builders of ResNet-18: 81 compiles for 21
objects). Before compiling a missing kernel a builder now takes its lease, a small file
`leases/<key>` in the store created exclusively (O_CREAT | O_EXCL: one taker wins, on a local
disk and on NFS since v3). A builder that finds a kernel leased compiles its own and then
waits for the other's object to appear in the store, then uses it as a hit.

No builder is ever blocked by one that died: a lease names its holder (host, pid and the
process's start time, so a reused pid is not mistaken for it), and a holder on this host
that no longer runs, a lease older than STALE_S (its holder on another host may have died:
no check reaches it), or a lease gone without its object (the holder failed) hands the
kernel to the waiter, who takes the lease and compiles it. A waiter gives up waiting after
WAIT_S in all and compiles what it still lacks.

Leases live in the store's folder: builders on one machine, or on machines sharing that
folder, share work. An HTTP cache has no such primitive (Bazel's remote cache protocol is
plain GET and PUT), so machines that share only a server each compile what none had yet.
"""
from __future__ import annotations

import json
import os
import socket
import time

STALE_S = float(os.environ.get("KILN_LEASE_STALE_S", 900))
WAIT_S = float(os.environ.get("KILN_LEASE_WAIT_S", 1800))
POLL_S = 0.05


def _me() -> dict:
    import psutil  # (here: a build the store answers whole takes no lease and never needs it)
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": psutil.Process().create_time()}


class Leases:
    def __init__(self, store_root: str):
        self.folder = os.path.join(store_root, "leases")
        os.makedirs(self.folder, exist_ok=True)
        self.mine: set[str] = set()
        self._me = _me()

    def _path(self, key: str) -> str:
        return os.path.join(self.folder, key)

    def take(self, key: str) -> bool:
        """Take the lease of `key`: True if this builder is to compile it. A dead or stale
        holder's lease is broken and taken over."""
        for _ in range(2):
            try:
                fd = os.open(self._path(key), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if self.holder_alive(key) is False:
                    self._remove(key)
                    continue
                return False
            except OSError:  # (a read-only or odd store: compile, as without leases)
                return True
            with os.fdopen(fd, "w") as f:
                json.dump(self._me, f)
            self.mine.add(key)
            return True
        return False

    def holder_alive(self, key: str) -> bool | None:
        """None: no lease; False: its holder is gone (or the lease is stale or unreadable)."""
        path = self._path(key)
        try:
            age = time.time() - os.stat(path).st_mtime
        except FileNotFoundError:
            return None
        if age > STALE_S:
            return False
        try:
            with open(path) as f:
                holder = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):  # (a lease being written reads empty for a moment)
            return age < 5
        if holder.get("host") != self._me["host"]:
            return True
        import psutil
        try:
            return abs(psutil.Process(int(holder["pid"])).create_time() - float(holder["started"])) < 1e-3
        except (psutil.Error, KeyError, TypeError, ValueError):
            return False

    def release(self, key: str) -> None:
        if key in self.mine:
            self.mine.discard(key)
            self._remove(key)

    def release_all(self) -> None:
        for key in list(self.mine):
            self.release(key)

    def _remove(self, key: str) -> None:
        try:
            os.remove(self._path(key))
        except OSError:
            pass

    def wait_for(self, keys: list, find) -> tuple[dict, list]:
        """Wait for other builders' objects: ({key: object} that appeared, [keys this builder
        must compile after all: their holder died or failed, or WAIT_S ran out]). `find(key)`
        reads the store."""
        found, left, ours = {}, list(keys), []
        deadline = time.monotonic() + WAIT_S
        while left:
            still = []
            for key in left:
                obj = find(key)
                if obj is not None:
                    found[key] = obj
                elif self.holder_alive(key) is not True:
                    obj = find(key)  # (the holder may have stored it and let go just now)
                    if obj is not None:
                        found[key] = obj
                    elif self.take(key):
                        ours.append(key)
                    else:
                        still.append(key)
                else:
                    still.append(key)
            left = still
            if left and time.monotonic() > deadline:
                return found, ours + left
            if left:
                time.sleep(POLL_S)
        return found, ours
