"""Kiln: ONNX models in, native shared libraries out.

    import modelkiln as kiln
    result = kiln.build("model.onnx")            # or kiln.build_many([...]) for a batch
    result.export("out/model")
    module = kiln.load("out/model")              # numpy + ctypes only
    outputs = module.run({"x": x})

The rest lives in the subpackages: modelkiln.orchestrator (build API, executors, CLI),
modelkiln.ir (frontend, passes, ops, lowering), modelkiln.codegen_worker (LLVM in a fresh
process), modelkiln.artifacts (store, link, bundles, loading), modelkiln.configs (presets).
Names load on first use: `import modelkiln` stays cheap.
"""
import os

# In a source checkout the subpackages are the repository's top-level folders beside this
# one (installed, they are inside it): let the package find them there.
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not os.path.isdir(os.path.join(os.path.dirname(__file__), "orchestrator")) and \
        os.path.isfile(os.path.join(_CHECKOUT, "orchestrator", "__init__.py")):
    __path__.append(_CHECKOUT)  # noqa: F821 - a package's __path__

# The folder that holds this package: what a subprocess (the zygote, a Ray worker) needs on
# its path to import Kiln the way this process did.
IMPORT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_API = {
    "build": "orchestrator.api", "build_many": "orchestrator.api", "BuildOptions": "orchestrator.options",
    "tune": "orchestrator.tuner",
    "BuildResult": "orchestrator.api", "BuildError": "orchestrator.api", "BatchResult": "orchestrator.api",
    "ModelFailure": "orchestrator.api", "BatchEntry": "orchestrator.batch_manifest",
    "read_manifest": "orchestrator.batch_manifest", "Target": "orchestrator.target",
    "parse_target": "orchestrator.target", "load": "artifacts", "Module": "artifacts.module",
    "KilnError": "artifacts.errors", "PassContext": "ir.transform", "graph_pass": "ir.transform",
    "Sequential": "ir.transform", "PassTimingInstrument": "ir.transform", "DumpIR": "ir.transform",
}
__all__ = sorted(_API) + ["IMPORT_ROOT"]


def __getattr__(name):
    if name in _API:
        import importlib
        return getattr(importlib.import_module(f".{_API[name]}", __name__), name)
    raise AttributeError(f"module 'modelkiln' has no attribute '{name}'")


def __dir__():
    return __all__
