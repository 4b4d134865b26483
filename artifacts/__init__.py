"""Artifacts: the content-addressed store, linking, bundles, and loading a built module."""

from .manifest import MANIFEST  # the bundle file that names every other one

__all__ = ["MANIFEST", "load"]


def load(path: str, threads: int | None = None):
    """Load a bundle folder written by `BuildResult.export` / `kiln build`, to run on
    `threads` threads (default: the environment variable KILN_NUM_THREADS, else the usable
    cores, sched_getaffinity)."""
    from .module import Module
    return Module(path, threads)
