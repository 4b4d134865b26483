"""Compile jobs that arrive while an executor runs.

A batch's models are planned while the first ones' kernels compile: the driver puts each
model's new jobs into the feed as its plan arrives, and the executor's loop takes them as it
goes. close() says no more will come; cancel() stops the executor's loop early (a fail-fast
batch, Ctrl-C): jobs not sent yet are dropped, those in flight killed. The feed's file descriptor is readable while jobs wait or once it is closed,
so an executor waiting for results wakes for new jobs too.
"""
from __future__ import annotations

import os
import select
import threading
from collections import deque


class Waker:
    """A pipe whose read end is readable once wake() was called, until drain(): a thread's
    way to wake another that waits in select()."""

    def __init__(self):
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)

    def wake(self) -> None:
        os.write(self._w, b"x")

    def drain(self) -> None:
        try:
            while os.read(self._r, 4096):
                pass
        except BlockingIOError:
            pass

    def fileno(self) -> int:
        return self._r

    def close(self) -> None:
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass


class JobFeed:
    def __init__(self, jobs=(), closed: bool = False):
        self._lock = threading.Lock()
        self._jobs = deque(jobs)
        self._closed = closed
        self.cancelled = False
        self._waker = Waker()
        if self._jobs or closed:
            self._waker.wake()

    def put(self, jobs) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("a job put into a closed feed")
            self._jobs.extend(jobs)
        self._waker.wake()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._waker.wake()

    def cancel(self) -> None:
        self.cancelled = True
        self.close()

    def take(self) -> tuple[list, bool]:
        """(the jobs waiting, whether the feed is finished: closed, and nothing left)."""
        self._waker.drain()
        with self._lock:
            jobs, self._jobs = list(self._jobs), deque()
            return jobs, self._closed
    # (finished is read under the lock with the jobs: a put comes before its close, so a
    # feed found closed here has nothing more to give after these)

    def fileno(self) -> int:
        return self._waker.fileno()

    def wait(self, timeout: float | None = None) -> None:
        """Until jobs wait or the feed is closed (or `timeout` seconds)."""
        select.select([self._waker], [], [], timeout)

    def release(self) -> None:
        self._waker.close()
