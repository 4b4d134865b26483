"""The wheel is what users install: build it, install it into a fresh venv, and run the
README's example from there, away from the checkout."""
import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile

import pytest

from tests.conftest import ROOT

TOP_LEVEL = ("orchestrator", "ir", "codegen_worker", "artifacts", "configs")


def _run(cmd, **kwargs):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kwargs)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.mark.slow
@pytest.mark.xdist_group("ray")  # (it starts a Ray of its own: beside the cluster's tests, not at once)
def test_wheel_installs_into_a_fresh_venv_and_builds_the_example(tmp_path):
    # Built from a copy: setuptools writes build/ and *.egg-info beside the sources.
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".ci-venv", "build", "*.egg-info", "__pycache__",
                                                             "out"))
    # (-v: the build backend's own output, where setuptools prints its warnings)
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-v", "-w", str(tmp_path), str(src)])
    said = built.stdout + built.stderr
    # The first thing a new user sees is no page of warnings about the package layout.
    assert "absent from the `packages` configuration" not in said and "would be ignored" not in said, said[-3000:]
    wheel = next(p for p in os.listdir(tmp_path) if p.endswith(".whl"))
    with zipfile.ZipFile(tmp_path / wheel) as z:
        names = z.namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"modelkiln"}, tops  # nothing else lands at the top of site-packages
    shipped = {os.path.dirname(n) for n in names if n.endswith("__init__.py")}
    for top in TOP_LEVEL:  # every package of the source tree is in the wheel (ir.lower once was not)
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            if "__init__.py" in files:
                assert "modelkiln/" + os.path.relpath(folder, ROOT) in shipped, folder
    assert "modelkiln/configs/examples/cnn.onnx" in names

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    py = venv / "bin" / "python"
    _run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(tmp_path / wheel)])
    # Kiln's dependencies come from this environment, after the venv's own packages (a .pth
    # line adds a path without running that folder's own .pth hooks, so an editable Kiln
    # installed here stays invisible).
    venv_site = _run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()}
    with open(os.path.join(venv_site, "kiln_test_deps.pth"), "w") as f:
        f.write("\n".join(sorted(deps)) + "\n")

    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = _run([str(py), "-c", "import modelkiln as kiln, modelkiln.orchestrator.api as api; "
                                 "print(kiln.__file__, api.__file__, kiln.IMPORT_ROOT)"], cwd=work, env=env).stdout
    assert all(p.startswith(str(venv)) for p in where.split()), where
    example = _run([str(py), "-c", "import modelkiln.configs as c, os; print(os.path.join(os.path.dirname(c.__file__), "
                                   "'examples', 'cnn.onnx'))"], cwd=work, env=env).stdout.strip()
    _run([str(venv / "bin" / "kiln"), "build", example, "-o", "out", "--no-cache", "--quiet"], cwd=work, env=env)
    r = _run([str(venv / "bin" / "kiln"), "run", "out"], cwd=work, env=env)
    assert "logits" in r.stdout
    # The Python API from the wheel, its codegen in the zygote it starts (imported from the wheel too)
    api = ("import modelkiln as kiln, numpy as np, sys\n"
           f"r = kiln.build({example!r}, cache=None, progress=False)\n"
           "m = r.load()\n"
           "out = m.run({'x': np.zeros((1, 3, 32, 32), np.float32)})\n"
           "assert out['logits'].shape == (1, 10) and r.report['totals']['compiled'] > 0\n"
           "assert not [n for n in sys.modules if n.split('.')[0] in ('orchestrator', 'ir', 'artifacts')]\n")
    _run([str(py), "-c", api], cwd=work, env=env)
    # Ray workers import Kiln from the wheel as well (the actor's class and its zygote)
    r = _run([str(venv / "bin" / "kiln"), "build", example, "-o", "out-ray", "--no-cache", "--executor", "ray",
              "--workers", "1", "--report", "ray.json"], cwd=work, env=env)
    kernels = json.loads((work / "ray.json").read_text())["kernels"]
    assert kernels and all(k["worker"].startswith("ray:") for k in kernels)
