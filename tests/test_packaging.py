"""The wheel is what users install: build it, install it into a fresh venv, and run the
README's example from there, away from the checkout."""
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile

from tests.conftest import ROOT

TOP_LEVEL = ("orchestrator", "ir", "codegen_worker", "artifacts", "configs")


def _run(cmd, **kwargs):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kwargs)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r


def test_wheel_installs_into_a_fresh_venv_and_builds_the_example(tmp_path):
    # Built from a copy: setuptools writes build/ and *.egg-info beside the sources.
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".ci-venv", "build", "*.egg-info", "__pycache__",
                                                             "out"))
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(src)])
    wheel = next(p for p in os.listdir(tmp_path) if p.endswith(".whl"))
    with zipfile.ZipFile(tmp_path / wheel) as z:
        shipped = {os.path.dirname(n) for n in z.namelist() if n.endswith("__init__.py")}
    for top in TOP_LEVEL:  # every package of the source tree is in the wheel (ir.lower once was not)
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            if "__init__.py" in files:
                assert os.path.relpath(folder, ROOT) in shipped, folder
    assert "configs/examples/cnn.onnx" in z.namelist()

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
    where = _run([str(py), "-c", "import orchestrator, artifacts; print(orchestrator.__file__, artifacts.__file__)"],
                 cwd=work).stdout
    assert all(p.startswith(str(venv)) for p in where.split()), where
    example = _run([str(py), "-c", "import configs, os; print(os.path.join(os.path.dirname(configs.__file__), "
                                   "'examples', 'cnn.onnx'))"], cwd=work).stdout.strip()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    _run([str(venv / "bin" / "kiln"), "build", example, "-o", "out", "--no-cache", "--quiet"], cwd=work, env=env)
    r = _run([str(venv / "bin" / "kiln"), "run", "out"], cwd=work, env=env)
    assert "logits" in r.stdout
