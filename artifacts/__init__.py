"""Artifacts: the content-addressed store, linking, bundles, and loading a built module."""

from .manifest import MANIFEST  # the bundle file that names every other one

__all__ = ["MANIFEST", "load"]


def load(path: str):
    """Load a bundle folder written by `BuildResult.export` / `kiln build`."""
    from .module import Module
    return Module(path)
