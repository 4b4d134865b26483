"""A one-line progress display for builds: on a terminal only, quiet in CI logs."""
from __future__ import annotations

import os
import sys
import time


class Progress:
    def __init__(self, total: int, workers: int, enabled: bool | None = None, stream=sys.stderr):
        if enabled is None:
            enabled = stream.isatty() and not os.environ.get("CI")
        self.enabled, self.stream = enabled, stream
        self.total, self.workers = total, workers
        self.compiled = self.cached = self.failed = 0
        self.start = time.perf_counter()

    def update(self, compiled: int = 0, cached: int = 0, failed: int = 0) -> None:
        self.compiled += compiled
        self.cached += cached
        self.failed += failed
        if self.enabled:
            done = self.compiled + self.cached + self.failed
            width = 30
            fill = width * done // max(self.total, 1)
            self.stream.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{self.total} kernels: "
                              f"{self.compiled} compiled, {self.cached} cached, {self.failed} failed | "
                              f"{self.workers} workers | {time.perf_counter() - self.start:5.1f}s")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()
