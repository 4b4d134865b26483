"""Loading checks a bundle before it maps it: every damaged or lying file is a KilnError
naming the file, never a signal, a hang or a heap overrun."""
import json
import os
import shutil

import pytest

from modelkiln.artifacts import load
from modelkiln.ir.errors import KilnError
from modelkiln.orchestrator.api import build
from tests import model_zoo
from tests.test_bad_input import kiln


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    from modelkiln.orchestrator.executor_local import LocalExecutor
    with LocalExecutor(workers=2) as ex:
        result = build(model_zoo.cnn(), executor=ex, cache=None, progress=False)
    return result.export(str(tmp_path_factory.mktemp("damaged") / "cnn"))


def _copy(bundle, tmp_path) -> str:
    out = tmp_path / "copy"
    shutil.copytree(bundle, out)
    return str(out)


def _manifest(folder) -> dict:
    return json.loads(open(os.path.join(folder, "manifest.json")).read())


def _write_manifest(folder, m) -> None:
    with open(os.path.join(folder, "manifest.json"), "w") as f:
        json.dump(m, f)


def test_truncated_library(bundle, tmp_path):
    b = _copy(bundle, tmp_path)
    so = os.path.join(b, "model.so")
    os.truncate(so, os.path.getsize(so) // 2)
    with pytest.raises(KilnError, match="model.so"):
        load(b)
    r = kiln("run", b)  # the CLI too: one line, exit 2, no signal
    assert r.returncode == 2 and "model.so" in r.stderr and "Traceback" not in r.stderr


def test_library_replaced_with_same_size(bundle, tmp_path):
    b = _copy(bundle, tmp_path)
    so = os.path.join(b, "model.so")
    data = bytearray(open(so, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(so, "wb").write(bytes(data))
    with pytest.raises(KilnError, match="model.so.*checksum"):
        load(b)


def test_manifest_promising_a_smaller_output(bundle, tmp_path):
    b = _copy(bundle, tmp_path)
    m = _manifest(b)
    m["outputs"][0]["shape"] = [1, 2]  # the library writes 10 floats into a buffer of 2
    _write_manifest(b, m)
    with pytest.raises(KilnError, match="other than the library was built for"):
        load(b)


def test_truncated_weights_with_the_checksum_removed(bundle, tmp_path):
    b = _copy(bundle, tmp_path)
    w = os.path.join(b, "weights.bin")
    os.truncate(w, os.path.getsize(w) - 8)
    with pytest.raises(KilnError, match="weights.bin.*bytes"):
        load(b)
    m = _manifest(b)
    m["weights_bytes"] -= 8
    m.pop("weights_sha256")
    _write_manifest(b, m)
    with pytest.raises(KilnError, match="weights_sha256|checksums"):
        load(b)


def test_weights_replaced_by_a_fifo(bundle, tmp_path):
    b = _copy(bundle, tmp_path)
    w = os.path.join(b, "weights.bin")
    os.remove(w)
    os.mkfifo(w)
    with pytest.raises(KilnError, match="not a regular file"):
        load(b)


def test_library_path_outside_the_bundle(bundle, tmp_path):
    b = _copy(bundle, tmp_path)
    m = _manifest(b)
    m["library"] = "/usr/lib/x86_64-linux-gnu/libm.so.6"
    _write_manifest(b, m)
    with pytest.raises(KilnError, match="not a plain name"):
        load(b)


def test_concurrent_exports_to_one_folder_leave_one_complete_bundle(bundle, tmp_path):
    """Several processes export over the same -o at once: one whole bundle remains, that
    loads and runs, and nothing else (no staging or old folders)."""
    import subprocess
    import sys

    from tests.conftest import ROOT
    code = ("import sys, os\n"
            "from modelkiln.orchestrator.bundle import write_bundle\n"
            "src, dest = sys.argv[1], sys.argv[2]\n"
            "files = {n: open(os.path.join(src, n), 'rb').read() for n in os.listdir(src)}\n"
            "for _ in range(15):\n"
            "    write_bundle(files, dest)\n")
    dest = tmp_path / "out" / "cnn"
    procs = [subprocess.Popen([sys.executable, "-c", code, bundle, str(dest)], cwd=ROOT, stderr=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": ROOT}) for _ in range(4)]
    errors = [p.communicate(timeout=300)[1].decode() for p in procs]
    assert all(p.returncode == 0 for p in procs), errors
    assert os.listdir(tmp_path / "out") == ["cnn"]
    assert sorted(os.listdir(dest)) == sorted(os.listdir(bundle))
    load(str(dest)).run(load(str(dest)).random_inputs())
