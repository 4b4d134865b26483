"""The package's public names: a function is never shadowed by a submodule of the same name."""
import subprocess
import sys

from tests.conftest import ROOT

PACKAGES = ("modelkiln", "modelkiln.orchestrator", "modelkiln.artifacts", "modelkiln.ir", "modelkiln.codegen_worker",
            "modelkiln.configs")


def test_orchestrator_build_can_be_called_twice():
    # The first call imports the build machinery; before the fix that import replaced the
    # function `orchestrator.build` with a module, and the second call was a TypeError.
    code = ("from modelkiln import orchestrator\n"
            "for path in ('configs/examples/cnn.onnx', 'configs/examples/cnn.onnx'):\n"
            "    r = orchestrator.build(path, cache=None, progress=False)\n"
            "    assert r.report['totals']['failed'] == 0\n"
            "print('ok', callable(orchestrator.build), callable(orchestrator.build_many))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok True True"


_CLASHES = """
import importlib, pkgutil, sys, types
clashes = []
for name in sys.argv[1:]:
    pkg = importlib.import_module(name)
    exported = set(getattr(pkg, "_API", ())) | set(getattr(pkg, "_EXPORTS", {}))
    public = {n: getattr(pkg, n) for n in exported | {n for n in vars(pkg) if not n.startswith("_")}}
    for mod in pkgutil.iter_modules(pkg.__path__):
        if mod.name in public and not isinstance(public[mod.name], types.ModuleType):
            clashes.append(f"{name}.{mod.name}")
print(" ".join(clashes))
"""


def test_no_public_name_is_both_a_function_and_a_module():
    # In a fresh interpreter: what a package offers before any submodule is imported.
    r = subprocess.run([sys.executable, "-c", _CLASHES, *PACKAGES], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "", f"names that are both a submodule and another object: {r.stdout}"
