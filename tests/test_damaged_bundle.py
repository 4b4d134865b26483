"""Loading checks a bundle before it maps it: every damaged or lying file is a KilnError
naming the file, never a signal, a hang or a heap overrun."""
import os

import pytest

from modelkiln.artifacts import load
from modelkiln.ir.errors import KilnError
from tests.conftest import bundle_copy
from tests.test_bad_input import kiln


def test_truncated_library(cnn_bundle, tmp_path):
    b = bundle_copy(cnn_bundle, tmp_path)
    so = os.path.join(b, "model.so")
    os.truncate(so, os.path.getsize(so) // 2)
    with pytest.raises(KilnError, match="model.so"):
        load(b)
    r = kiln("run", b)  # the CLI too: one line, exit 2, no signal
    assert r.returncode == 2 and "model.so" in r.stderr and "Traceback" not in r.stderr


def test_library_replaced_with_same_size(cnn_bundle, tmp_path):
    b = bundle_copy(cnn_bundle, tmp_path)
    so = os.path.join(b, "model.so")
    data = bytearray(open(so, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(so, "wb").write(bytes(data))
    with pytest.raises(KilnError, match="model.so.*checksum"):
        load(b)


def test_manifest_promising_a_smaller_output(cnn_bundle, tmp_path):
    b = bundle_copy(cnn_bundle, tmp_path,  # the library writes 10 floats into a buffer of 2
                    lambda m: m["outputs"][0].update(shape=[1, 2]))
    with pytest.raises(KilnError, match="other than the library was built for"):
        load(b)


def test_truncated_weights_with_the_checksum_removed(cnn_bundle, tmp_path):
    b = bundle_copy(cnn_bundle, tmp_path)
    w = os.path.join(b, "weights.bin")
    os.truncate(w, os.path.getsize(w) - 8)
    with pytest.raises(KilnError, match="weights.bin.*bytes"):
        load(b)

    def claim_the_truncated_size_and_drop_the_checksum(m):
        m["weights_bytes"] -= 8
        del m["weights_sha256"]
    b = bundle_copy(cnn_bundle, tmp_path / "unchecked", claim_the_truncated_size_and_drop_the_checksum)
    os.truncate(os.path.join(b, "weights.bin"), os.path.getsize(os.path.join(b, "weights.bin")) - 8)
    with pytest.raises(KilnError, match="weights_sha256|checksums"):
        load(b)


def test_weights_replaced_by_a_fifo(cnn_bundle, tmp_path):
    b = bundle_copy(cnn_bundle, tmp_path)
    w = os.path.join(b, "weights.bin")
    os.remove(w)
    os.mkfifo(w)
    with pytest.raises(KilnError, match="not a regular file"):
        load(b)


def test_library_path_outside_the_bundle(cnn_bundle, tmp_path):
    b = bundle_copy(cnn_bundle, tmp_path, lambda m: m.update(library="/usr/lib/x86_64-linux-gnu/libm.so.6"))
    with pytest.raises(KilnError, match="not a plain name"):
        load(b)


def test_concurrent_exports_to_one_folder_leave_one_complete_bundle(cnn_bundle, tmp_path):
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
    procs = [subprocess.Popen([sys.executable, "-c", code, cnn_bundle, str(dest)], cwd=ROOT, stderr=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": ROOT}) for _ in range(4)]
    errors = [p.communicate(timeout=300)[1].decode() for p in procs]
    assert all(p.returncode == 0 for p in procs), errors
    assert os.listdir(tmp_path / "out") == ["cnn"]
    assert sorted(os.listdir(dest)) == sorted(os.listdir(cnn_bundle))
    load(str(dest)).run(load(str(dest)).random_inputs())
