"""Digests remembered by stat (git's index, ccache's direct mode): trusted only while the
file is provably unchanged."""
import os

from modelkiln.orchestrator import file_digests
from modelkiln.orchestrator.file_digests import remembered


def _counting(path):
    calls = []

    def compute():
        calls.append(1)
        return {"bytes": open(path, "rb").read().hex()}
    return compute, calls


def test_an_unchanged_file_is_not_read_again(tmp_path, monkeypatch):
    monkeypatch.setattr(file_digests, "RACY_NS", 0)
    f, memo = tmp_path / "m.onnx", str(tmp_path / "memo")
    f.write_bytes(b"abc")
    compute, calls = _counting(f)
    assert remembered(memo, str(f), compute) == remembered(memo, str(f), compute) == {"bytes": "616263"}
    assert len(calls) == 1
    f.write_bytes(b"xyz")  # same size, new content: the ctime moves, the record is not trusted
    assert remembered(memo, str(f), compute) == {"bytes": "78797a"} and len(calls) == 2
    st = os.stat(f)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns - 10**10))  # an mtime put back: the ctime still moved
    assert remembered(memo, str(f), compute) == {"bytes": "78797a"} and len(calls) == 3


def test_a_record_made_right_after_a_write_is_not_trusted(tmp_path):
    f, memo = tmp_path / "m.onnx", str(tmp_path / "memo")
    f.write_bytes(b"abc")  # written within RACY_NS of the record: it could change again unseen
    compute, calls = _counting(f)
    remembered(memo, str(f), compute)
    remembered(memo, str(f), compute)
    assert len(calls) == 2
