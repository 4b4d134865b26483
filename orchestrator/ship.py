"""Kiln's own packages, shipped to Ray nodes that have no Kiln of their own.

The driver stages its Kiln as one `modelkiln` folder (a source checkout keeps the subpackages
beside the package; an install keeps them inside it) and uploads it to the cluster once; an
actor started with the resulting runtime_env imports exactly the driver's Kiln. Ray accepts
local folders in `py_modules` only at `ray.init`, and a driver often joins a Ray someone else
initialized, so the upload is done here, by the function `ray.init` itself uses.
"""
from __future__ import annotations

import importlib.util
import inspect
import os
import shutil
import tempfile

_SUBPACKAGES = ("orchestrator", "ir", "codegen_worker", "artifacts", "configs")
_SHIPPED_SUFFIXES = (".py", ".c", ".json")  # sources, the thread pool's C, target presets


def stage_package(dest: str) -> str:
    """Copy the running Kiln's sources to dest/modelkiln; returns that folder."""
    import modelkiln
    root = os.path.join(dest, "modelkiln")
    os.makedirs(root)
    shutil.copy(modelkiln.__file__, os.path.join(root, "__init__.py"))

    def ignore(folder, names):
        return [n for n in names if n == "__pycache__" or
                (os.path.isfile(os.path.join(folder, n)) and not n.endswith(_SHIPPED_SUFFIXES))]

    for sub in _SUBPACKAGES:
        spec = importlib.util.find_spec(f"modelkiln.{sub}")
        shutil.copytree(list(spec.submodule_search_locations)[0], os.path.join(root, sub), ignore=ignore)
    return root


def upload_runtime_env() -> dict:
    """A runtime_env whose py_modules is the driver's Kiln, uploaded to the connected Ray
    cluster (content-addressed there: a second upload of the same sources is a no-op)."""
    from ray._private.runtime_env.py_modules import upload_py_modules_if_needed
    with tempfile.TemporaryDirectory(prefix="kiln-ship-") as tmp:
        folder = stage_package(tmp)
        kwargs = {"scratch_dir": tmp}
        if "include_gitignore" in inspect.signature(upload_py_modules_if_needed).parameters:
            kwargs["include_gitignore"] = False
        return upload_py_modules_if_needed({"py_modules": [folder]}, **kwargs)
