"""The content-addressed store: hits, partial rebuilds, damaged entries, concurrency, CLI."""
import os
import subprocess
import sys
import warnings

import numpy as np
import onnx
import pytest

from modelkiln.artifacts.store import Store
from modelkiln.ir.errors import KilnError
from modelkiln.orchestrator.api import BuildError, build
from modelkiln.orchestrator.cache_key import key_of, key_parts
from modelkiln.orchestrator.target import parse_target
from tests import model_zoo
from tests.conftest import assert_matches_oracle
from tests.test_bad_input import ROOT, kiln


def _build(model, store, executor, **kw):
    return build(model, cache=store, executor=executor, progress=False, **kw)


def _same_kernels(model):
    """The same graph under different model bytes: a whole-model miss whose kernels all hit."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    copy.doc_string = "rebuilt"
    return copy


def _entries(store):
    return {key for key, *_ in store.entries()}


def test_unchanged_model_compiles_nothing(tmp_path, executor, monkeypatch):
    store = Store(str(tmp_path))
    first = _build(model_zoo.resnet18(), store, executor)

    def no_link(*args):
        raise AssertionError("a warm build must not run the linker")
    monkeypatch.setattr("modelkiln.orchestrator.bundle.link_shared", no_link)
    second = _build(model_zoo.resnet18(), store, executor)
    t1, t2 = first.report["totals"], second.report["totals"]
    assert t1["compiled"] == t1["kernels"] and t2["compiled"] == 0 and t2["cached"] == t2["kernels"]
    assert second.report["whole_model_hit"]  # an unchanged model is one lookup
    assert first.files == second.files
    third = _build(_same_kernels(model_zoo.resnet18()), store, executor)  # kernels and module hit, no link
    assert third.report["totals"]["compiled"] == 0 and not third.report.get("whole_model_hit")
    assert third.files["model.so"] == first.files["model.so"]  # deterministic output


def test_new_weights_compile_nothing(tmp_path, executor):
    """Weights are data, not code: a retrained model reuses every kernel."""
    store = Store(str(tmp_path))
    _build(model_zoo.cnn(), store, executor)
    retrained = model_zoo.cnn()
    for init in retrained.graph.initializer:
        arr = onnx.numpy_helper.to_array(init)
        if arr.dtype == np.float32:
            init.CopyFrom(onnx.numpy_helper.from_array(arr * 1.5 + 0.1, init.name))
    result = _build(retrained, store, executor)
    assert result.report["totals"]["compiled"] == 0
    assert_matches_oracle(result, retrained)


def test_changing_one_layer_recompiles_only_its_kernels(tmp_path, executor):
    store = Store(str(tmp_path))
    before = _build(model_zoo.cnn(), store, executor)
    changed = model_zoo.cnn()
    for node in changed.graph.node:  # the average pool: 3x3 -> 2x2 window
        if node.op_type == "AveragePool":
            for a in node.attribute:
                if a.name == "kernel_shape":
                    a.ints[:] = [2, 2]
    after = _build(changed, store, executor)
    recompiled = [k for k in after.report["kernels"] if not k["cache_hit"]]
    assert [k["ops"] for k in recompiled] == [["AveragePool"], ["GlobalAveragePool"]]  # the pool and its consumer
    assert len(after.report["kernels"]) == len(before.report["kernels"])
    assert_matches_oracle(after, changed)


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "foreign", "other_key"])
def test_damaged_entry_is_rebuilt_not_trusted(tmp_path, executor, damage):
    store = Store(str(tmp_path))
    model = model_zoo.cnn()
    kernels = [k["key"] for k in _build(model, store, executor).report["kernels"]]
    path = store.path(kernels[0])
    data = open(path, "rb").read()
    size = len(data)
    if damage == "corrupt":
        data = data[:-40] + bytes(b ^ 0xFF for b in data[-40:])
    elif damage == "truncate":
        data = data[: size // 2]
    elif damage == "foreign":
        data = b"\x7fELF this is not a kiln entry" * 10
    else:  # a valid entry, but for another key: must not be served under this one
        data = open(store.path(kernels[1]), "rb").read()
    with open(path, "wb") as f:
        f.write(data)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = _build(_same_kernels(model), store, executor)
    assert result.report["totals"]["compiled"] == 1
    assert any("invalid" in str(w.message) for w in caught)
    assert store.verify() == []  # the rebuilt entry is valid again
    assert_matches_oracle(result, model)


def test_concurrent_builds_share_one_store(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(model_zoo.mobilenet_v2(), path)
    store = str(tmp_path / "store")
    procs = [subprocess.Popen([sys.executable, "-m", "modelkiln.orchestrator.cli", "build", str(path), "-o",
                               str(tmp_path / f"out{i}"), "--cache", store, "--quiet", "--workers", "1"],
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, stderr=subprocess.PIPE)
             for i in range(2)]
    for p in procs:
        assert p.wait(timeout=300) == 0, p.stderr.read().decode()
    s = Store(store)
    assert s.verify() == [] and s.stats()["entries"] > 0
    assert not [n for d in os.listdir(s.objects) for n in os.listdir(os.path.join(s.objects, d)) if n.startswith(".tmp")]
    a, b = (open(tmp_path / f"out{i}" / "model.so", "rb").read() for i in range(2))
    assert a == b


def test_readonly_store_reads_but_never_writes(tmp_path, executor):
    store_dir = str(tmp_path / "s")
    _build(model_zoo.cnn(), Store(store_dir), executor)
    before = _entries(Store(store_dir))
    ro = Store(store_dir, readonly=True)
    hit = _build(model_zoo.cnn(), ro, executor)
    assert hit.report["totals"]["cached"] == hit.report["totals"]["kernels"]
    miss = _build(model_zoo.mlp(1), ro, executor)
    assert miss.report["totals"]["compiled"] == miss.report["totals"]["kernels"]
    assert _entries(Store(store_dir)) == before


def test_verify_cache_catches_a_stale_object(tmp_path, executor):
    store = Store(str(tmp_path))
    first = _build(model_zoo.cnn(), store, executor)
    ok = _build(model_zoo.cnn(), store, executor, verify_cache=True)  # deterministic: passes
    assert ok.report["totals"]["cached"] == ok.report["totals"]["kernels"]
    key, other = (k["key"] for k in first.report["kernels"][:2])
    store.put(key, store.get(other))  # a well-formed entry holding the wrong object
    with pytest.raises(BuildError, match="different bytes than the cached object"):
        _build(model_zoo.cnn(), store, executor, verify_cache=True)


def test_key_parts_contract():
    host = parse_target("llvm")
    base = key_parts(b"kernel", host, 3)
    assert key_of(base) == key_of(key_parts(b"kernel", host, 3))
    for changed in (key_parts(b"kernel2", host, 3), key_parts(b"kernel", host, 2),
                    key_parts(b"kernel", parse_target("llvm -cl-opt=-unroll-threshold=100"), 3),
                    key_parts(b"kernel", parse_target("x86-64-v3"), 3), key_parts(b"kernel", host, 3, salt="x"),
                    key_parts(b"kernel", host, 3, fallback=True)):
        assert key_of(changed) != key_of(base)
    assert {"llvmlite", "llvm", "kiln_codegen", "artifact_format"} <= set(base)


def test_unknown_llvm_option_rejected_before_any_job(tmp_path, executor):
    store = Store(str(tmp_path))
    with pytest.raises(KilnError, match="unknown LLVM option '-unrol-threshold=50'"):
        _build(model_zoo.cnn(), store, executor, target="llvm -cl-opt=-unrol-threshold=50")
    assert store.stats()["entries"] == 0


def test_gc_removes_least_recently_used(tmp_path, executor):
    store = Store(str(tmp_path))
    _build(model_zoo.mlp(1), store, executor)
    old = _entries(store)
    for _, path, _, _ in store.entries():
        os.utime(path, (1, 1))  # long ago
    _build(model_zoo.cnn(), store, executor)
    new = _entries(store) - old
    # what the second build wrote or read (the thread pool's object, an old entry it used)
    used = {key for key, _, _, mtime in store.entries() if mtime > 1}
    assert new < used and len(used - new) == 1
    keep = sum(size for key, _, size, _ in store.entries() if key in used)
    store.gc(keep)
    assert _entries(store) == used


def test_cache_cli_stats_verify_gc_and_explain(tmp_path):
    store = str(tmp_path / "store")
    example = os.path.join(ROOT, "configs", "examples", "cnn.onnx")
    assert kiln("build", example, "-o", str(tmp_path / "b"), "--cache", store, "--quiet").returncode == 0
    r = kiln("cache", "stats", "--cache", store)
    # 6 kernels, the thread pool's object, the linked module, the finished bundle
    assert r.returncode == 0 and "9 entries" in r.stdout and "hit rate" in r.stdout
    assert kiln("cache", "verify", "--cache", store).returncode == 0
    some = Store(store).path(next(iter(_entries(Store(store)))))
    with open(some, "r+b") as f:
        f.seek(60)
        f.write(b"\0\0\0\0")
    r = kiln("cache", "verify", "--cache", store)
    assert r.returncode == 1 and "bad entry" in r.stdout and not os.path.exists(some)
    # explain says which key part changed for a kernel that would miss
    r = kiln("explain", example, "--cache", store, "--target", "llvm -cl-opt=-unroll-threshold=100")
    assert r.returncode == 0 and "changed since the last build: llvm_options: [] -> ['-unroll-threshold=100']" in r.stdout
    r = kiln("cache", "gc", "--cache", store, "--max-size", "0")
    assert r.returncode == 0 and Store(store).stats()["entries"] == 0


def test_whole_model_key_contract(tmp_path):
    from modelkiln.orchestrator.model_cache import model_key, pack, unpack
    m = model_zoo.cnn()
    host = parse_target("llvm")
    base = model_key(m, host, 3, None, "")
    path = tmp_path / "m.onnx"
    onnx.save(m, path)
    assert base == model_key(m, host, 3, None, "") == model_key(str(path), host, 3, None, "")
    for other in (model_key(_same_kernels(m), host, 3, None, ""), model_key(m, parse_target("x86-64-v3"), 3, None, ""),
                  model_key(m, host, 2, None, ""), model_key(m, host, 3, {"x": [2, 3, 32, 32]}, ""),
                  model_key(m, host, 3, None, "salt")):
        assert other != base
    files = {"a": b"1", "model.so": b"\x7fELF", "empty": b""}
    assert unpack(pack(files, {"r": 1})) == (files, {"r": 1})
    with pytest.raises(ValueError):
        unpack(pack(files, {})[:-1])


def test_whole_model_hit_hard_links_large_files_from_verified_blobs(tmp_path, executor):
    """The weights of a bundle found whole are a read-only blob in the store, exported by hard
    link; a blob changed in place is noticed (its stamp no longer matches), hashed, found
    damaged, and the model rebuilt; `cache verify` hashes every blob regardless of stamps."""
    model = model_zoo.resnet18()
    store = Store(str(tmp_path / "store"))
    _build(model, store, executor)
    hit = _build(model, store, executor)
    assert hit.report["whole_model_hit"]
    out = hit.export(str(tmp_path / "out"))
    weights = os.path.join(out, "weights.bin")
    blob = hit.files["weights.bin"].path
    assert os.stat(weights).st_ino == os.stat(blob).st_ino  # a hard link: nothing was written
    assert os.stat(blob).st_mode & 0o777 == 0o444  # read-only: not to be edited in place
    assert_matches_oracle(hit, model)

    os.chmod(blob, 0o644)
    with open(blob, "r+b") as f:  # someone edits the exported file in place
        f.seek(1000)
        f.write(b"\xff" * 16)
    with pytest.warns(UserWarning, match="does not match its name"):
        again = _build(model, store, executor)
    assert not again.report.get("whole_model_hit") and again.report["totals"]["compiled"] == 0
    assert_matches_oracle(again, model)

    blob = _build(model, store, executor).files["weights.bin"].path
    st = os.stat(blob)
    os.chmod(blob, 0o644)
    with open(blob, "r+b") as f:  # bit rot: content changes, mtime does not
        f.write(b"\0" * 8)
    os.utime(blob, ns=(st.st_atime_ns, st.st_mtime_ns))
    bad = store.verify()
    assert [path for path, _ in bad] == [blob] and not os.path.exists(blob)


def test_the_thread_pool_object_comes_from_the_store(tmp_path, executor, monkeypatch):
    """A builder that finds the pool's object in the store links it without running the C
    compiler on thread_pool.c (a new process: nothing remembered in memory)."""
    from modelkiln.artifacts import link
    store = Store(str(tmp_path))
    _build(model_zoo.mlp(), store, executor)
    monkeypatch.setattr(link, "_POOL_OBJECTS", {})

    def no_compile(cc):
        raise AssertionError("thread_pool.c compiled again")
    monkeypatch.setattr(link, "_compile_thread_pool", no_compile)
    model = model_zoo.cnn()
    assert_matches_oracle(_build(model, store, executor), model)
