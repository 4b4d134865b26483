"""Artifacts: the content-addressed store, linking, bundles, and loading a built module."""

MANIFEST = "manifest.json"  # the bundle file that names every other one


def load(path: str):
    """Load a bundle folder written by `BuildResult.export` / `kiln build`."""
    from .module import Module
    return Module(path)
