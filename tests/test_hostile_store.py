"""A store that trusts nothing on disk: what a restored or shared CI cache, or a careless
hand, can leave in it ends as a clean miss or a reported bad entry, never a hang, a crash,
a read without end, or a deletion outside the store."""
import os
import shutil
import subprocess
import sys
import time

import pytest

from modelkiln.artifacts.store import ORPHAN_AGE_S, Store
from modelkiln.orchestrator.api import build
from modelkiln.orchestrator.cache_policy import open_store
from tests import model_zoo
from tests.conftest import ROOT, assert_matches_oracle
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


def _digest_records(store) -> list:
    return sorted(os.path.join(store.digests, n) for n in os.listdir(store.digests) if n.endswith(".json"))


@pytest.mark.parametrize("attack", ["fifo", "dev_zero_link", "directory", "link_outside", "garbage"])
def test_a_digest_record_that_is_not_one_is_rebuilt_not_waited_on(tmp_path, attack):
    """The whole-model lookup's file digest records (digests/*.json) are read as store entries
    are: a FIFO there blocked a plain open() forever, a link to /dev/zero read without end.
    Each attack ends in a build that completes, a real record in its place, and a clean
    verify; nothing outside the store is touched."""
    model = tmp_path / "cnn.onnx"
    model.write_bytes(model_zoo.cnn().SerializeToString())
    cache = tmp_path / "store"
    assert kiln("build", str(model), "-o", str(tmp_path / "out"), "--cache", str(cache), "--quiet").returncode == 0
    store = Store(str(cache))
    [record] = _digest_records(store)
    outside = tmp_path / "outside.json"
    outside.write_text("must survive")
    os.remove(record)
    {"fifo": os.mkfifo, "dev_zero_link": lambda p: os.symlink("/dev/zero", p), "directory": os.mkdir,
     "link_outside": lambda p: os.symlink(outside, p), "garbage": lambda p: open(p, "w").write('{"stamp": [')}[attack](record)
    again = subprocess.run([sys.executable, "-m", "modelkiln.orchestrator.cli", "build", str(model), "-o",
                            str(tmp_path / "out"), "--cache", str(cache), "--quiet"], capture_output=True, text=True,
                           timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert again.returncode == 0, again.stderr
    assert outside.read_text() == "must survive" and os.path.exists("/dev/zero")
    bad = store.verify()
    if attack == "directory":  # (a build cannot replace a folder: verify reports and removes it)
        assert [p for p, _ in bad] == [record] and not os.path.exists(record)
    else:  # a real record again
        assert bad == [] and os.path.isfile(record) and not os.path.islink(record)


def test_verify_and_gc_treat_the_digest_folder_like_the_rest_of_the_store(tmp_path):
    """verify reports and removes what is not a digest record in digests/ (a FIFO, a link, a
    folder, a record that is not one); gc sweeps the temp files a killed build left there;
    a digests/ that is a link is reported and never entered or written through."""
    store = Store(str(tmp_path / "store"))
    os.makedirs(store.digests)
    good = os.path.join(store.digests, "a" * 32 + ".json")
    with open(good, "w") as f:
        f.write('{"stamp": [1, 2, 3, 4], "recorded_ns": 5, "value": {"sha256": "00"}}')
    os.mkfifo(os.path.join(store.digests, "b" * 32 + ".json"))
    os.symlink("/dev/zero", os.path.join(store.digests, "c" * 32 + ".json"))
    os.mkdir(os.path.join(store.digests, "d" * 32 + ".json"))
    with open(os.path.join(store.digests, "e" * 32 + ".json"), "w") as f:
        f.write("not json")
    orphan = os.path.join(store.digests, ".tmp-killed-build")
    with open(orphan, "w") as f:
        f.write("{")
    old = time.time() - ORPHAN_AGE_S - 60
    os.utime(orphan, (old, old))
    assert store.stats()["orphaned_temp_files"] == 1
    bad = sorted(os.path.basename(p)[0] for p, _ in store.verify())
    assert bad == ["b", "c", "d", "e"] and os.listdir(store.digests) != [] and os.path.isfile(good)
    store.gc(max_bytes=1 << 30)
    assert sorted(os.listdir(store.digests)) == [os.path.basename(good)]

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.json").write_text("mine")
    shutil.rmtree(store.digests)
    os.symlink(outside, store.digests)
    assert [p for p, _ in store.verify()] == [store.digests]
    assert os.listdir(outside) == ["keep.json"]
