"""Kiln's driver: targets, compile jobs, executors, the build API and the CLI."""


def build(*args, **kwargs):
    """See orchestrator.build.build."""
    from .build import build as _build
    return _build(*args, **kwargs)
