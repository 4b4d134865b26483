"""The driver's side of a zygote: start `python -m modelkiln.codegen_worker.zygote`, send requests,
read results (codegen_worker.protocol frames), and leave no process behind on close."""
from __future__ import annotations

import os
import select
import subprocess
import sys
from collections import deque

from .. import IMPORT_ROOT  # the zygote imports Kiln from where this process did
from .protocol import FrameReader, OutBuffer, encode

_PACKAGE = __name__.rpartition(".")[0]  # modelkiln.codegen_worker
SIGNAL_POLL_S = 0.5  # the longest a wait for results goes without looking at pending signals
WOKEN = object()  # what receive() returns when `wake` became readable before a result came


class ZygoteClient:
    """One zygote subprocess and the pipes to it. Requests are queued and written only as
    fast as the zygote reads them, while its results are read: neither side ever blocks on
    a full pipe (a large request and a large result in flight at once would deadlock)."""

    def __init__(self):
        env = dict(os.environ)
        env["PYTHONPATH"] = IMPORT_ROOT + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen([sys.executable, "-m", f"{_PACKAGE}.zygote"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, close_fds=True)
        self.pid = self.proc.pid
        self._out = OutBuffer(self.proc.stdin.fileno())
        self._in = FrameReader()
        self._frames: deque = deque()

    def send(self, header: dict, blob: bytes) -> None:
        """Queue a request; it is written while waiting in receive()."""
        self._out.push(encode(header, blob))
        self._out.flush()

    def receive(self, wake=None):
        """The next result frame, None once the zygote has died, or WOKEN once `wake` (anything
        with a fileno(): a JobFeed) is readable first. Raises OSError (a broken pipe) if the
        zygote is gone while requests are still unsent."""
        out_fd, in_fd = self._out.fd, self.proc.stdout.fileno()
        watched = [in_fd] + ([wake.fileno()] if wake is not None else [])
        while not self._frames:
            # (a timeout: a Ctrl-C the kernel hands to another thread, numpy's BLAS threads
            # say, interrupts no select here, and Python raises it only once this returns)
            readable, writable, _ = select.select(watched, [out_fd] if self._out else [], [], SIGNAL_POLL_S)
            if writable:
                self._out.flush()
            if in_fd in readable:
                data = os.read(in_fd, 1 << 20)
                if not data:
                    return None
                self._frames.extend(self._in.feed(data))
            elif readable:
                return WOKEN
        return self._frames.popleft()

    def close(self) -> None:
        # Each job runs in its own process group, so a job still running (a hung one, or
        # the jobs of a build being torn down) would outlive its zygote: reap them too.
        import psutil  # here, not at the top: a build served from the store never needs it
        try:
            jobs = psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            jobs = []
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except Exception:  # noqa: BLE001 - a zygote that will not go quietly is killed
            self.proc.kill()
            self.proc.wait()
        for job in jobs:
            try:
                job.kill()
            except psutil.Error:
                pass
