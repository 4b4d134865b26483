"""What a build returns, and what it raises: apart from the build API so that the stages that
make them (orchestrator/batch_schedule.py) need not import it."""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field

from ..ir.errors import KilnError

from .bundle import write_bundle
from .target import Target


class BuildError(KilnError):
    def __init__(self, message: str, report: dict | None = None):
        super().__init__(message)
        self.report = report


@dataclass
class BuildResult:
    """A built bundle: `files` maps file names to bytes (on a whole-model hit, large ones are
    artifacts.store.StoredFile: blobs in the store, compared and read like bytes). `graph`
    and `lowered` are None when the bundle came whole from the store
    (report["whole_model_hit"]): nothing was optimized or lowered; and in a batch whose
    models a model host planned (orchestrator/model_hosts.py): they stayed there."""
    target: Target
    graph: object
    lowered: object
    files: dict
    report: dict
    pass_timings: list = field(default_factory=list)

    def export(self, path: str) -> str:
        return write_bundle(self.files, path)

    def load(self, threads: int | None = None):
        """Load the bundle without keeping it on disk: it is exported to a temporary folder
        that is gone again when this returns (the loaded library and weights live on in
        memory). threads: as artifacts.load."""
        from ..artifacts.module import Module
        with tempfile.TemporaryDirectory(prefix="kiln-module-") as tmp:
            return Module(self.export(os.path.join(tmp, "bundle")), threads)
