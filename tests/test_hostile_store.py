"""A store that trusts nothing on disk: what a restored or shared CI cache, or a careless
hand, can leave in it ends as a clean miss or a reported bad entry, never a hang, a crash,
a read without end, or a deletion outside the store."""
import os
import time

import pytest

from modelkiln.artifacts.store import ORPHAN_AGE_S, Store
from modelkiln.orchestrator.api import build
from modelkiln.orchestrator.cache_policy import open_store
from tests import model_zoo
from tests.conftest import assert_matches_oracle
from tests.test_cache import _same_kernels
from tests.test_bad_input import kiln


@pytest.fixture
def filled(tmp_path, executor):
    """A store holding the cnn's build; the keys of its kernel objects."""
    store = Store(str(tmp_path / "store"))
    result = build(model_zoo.cnn(), executor=executor, cache=store, progress=False)
    return store, [k["key"] for k in result.report["kernels"]]


def _replace(store, key, make):
    path = store.path(key)
    os.remove(path)
    make(path)
    return path


@pytest.mark.parametrize("attack", ["fifo", "dev_zero_link", "directory", "link_outside"])
def test_an_entry_that_is_not_a_file_is_a_miss_and_reported(filled, tmp_path, executor, attack):
    store, keys = filled
    outside = tmp_path / "outside.txt"
    outside.write_text("must survive")
    make = {"fifo": os.mkfifo, "dev_zero_link": lambda p: os.symlink("/dev/zero", p),
            "directory": os.mkdir, "link_outside": lambda p: os.symlink(outside, p)}[attack]
    path = _replace(store, keys[0], make)
    t0 = time.monotonic()
    retrained = _same_kernels(model_zoo.cnn())  # new weights: the kernels are looked up one by one
    with pytest.warns(UserWarning, match="is invalid"):
        again = build(retrained, executor=executor, cache=store, progress=False)
    assert time.monotonic() - t0 < 60
    assert again.report["totals"]["compiled"] == 1  # the attacked kernel, rebuilt
    assert_matches_oracle(again, retrained)
    assert os.path.isfile(path) and not os.path.islink(path)  # a real entry again
    assert outside.read_text() == "must survive" and os.path.exists("/dev/zero")
    assert store.verify() == []


def test_a_linked_shard_folder_is_never_entered_or_emptied(filled, tmp_path):
    store, keys = filled
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / ("0" * 62)).write_bytes(b"someone else's file")
    os.symlink(victim, os.path.join(store.objects, "zz"))
    bad = store.verify()
    assert [p for p, _ in bad] == [os.path.join(store.objects, "zz")]
    store.gc(0)
    assert (victim / ("0" * 62)).read_bytes() == b"someone else's file"


def test_orphaned_temp_files_are_counted_and_swept(filled):
    store, keys = filled
    orphan = os.path.join(os.path.dirname(store.path(keys[0])), ".tmp-killed-build")
    with open(orphan, "wb") as f:
        f.write(b"\0" * 4096)
    old = time.time() - ORPHAN_AGE_S - 10
    os.utime(orphan, (old, old))
    fresh = orphan + "-still-writing"
    open(fresh, "wb").close()
    s = store.stats()
    assert s["orphaned_temp_files"] == 1 and s["orphaned_bytes"] == 4096
    store.gc(1 << 40)
    assert not os.path.exists(orphan) and os.path.exists(fresh)  # a write in progress is left alone


def test_garbage_in_the_build_log_does_not_break_stats_or_explain(filled):
    store, _ = filled
    with open(os.path.join(store.root, "builds.jsonl"), "ab") as f:
        f.write(b"\xff\xfe not json \x80\n[1, 2]\n{\"hits\": \"x\"}\n")
    example = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "examples",
                           "cnn.onnx")
    for args in (["cache", "stats", "--cache", store.root], ["explain", example, "--cache", store.root]):
        r = kiln(*args)
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr


def test_a_store_that_cannot_be_created_degrades_to_no_cache(tmp_path, executor):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.warns(UserWarning, match="building without a cache"):
        assert open_store(str(blocker / "store")) is None
    with pytest.warns(UserWarning, match="building without a cache"):
        result = build(model_zoo.cnn(), executor=executor, cache=str(blocker / "store"), progress=False)
    assert_matches_oracle(result, model_zoo.cnn())
    r = kiln("build", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                                   "examples", "cnn.onnx"), "-o", str(tmp_path / "out"), "--cache",
             str(blocker / "store"), "--quiet")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
