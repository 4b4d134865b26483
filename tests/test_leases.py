"""Builders that share a store share the work of compiling (artifacts/leases.py): a kernel
one builder is compiling is not compiled by another at the same time, and no builder waits
on one that died."""
import json
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import onnx

from modelkiln.artifacts import leases as leases_mod
from modelkiln.artifacts.leases import Leases
from modelkiln.artifacts.store import Store
from modelkiln.orchestrator.api import build
from tests import model_zoo


def _keys(report: dict) -> list:
    return list(dict.fromkeys(k["key"] for k in report["kernels"]))


def test_concurrent_builders_of_one_model_compile_each_kernel_once(tmp_path):
    """Three `kiln build`s of one model started together on one store: every kernel is
    compiled once among them (without leases each compiled all of them), and every bundle is
    the same bytes and matches onnxruntime."""
    path = tmp_path / "cnn.onnx"
    onnx.save(model_zoo.cnn(), path)
    store = tmp_path / "store"
    procs = [subprocess.Popen([sys.executable, "-m", "modelkiln.orchestrator.cli", "build", str(path), "-o",
                               str(tmp_path / f"out{i}"), "--cache", str(store), "--quiet", "--workers", "1",
                               "--report", str(tmp_path / f"r{i}.json")], stderr=subprocess.PIPE, text=True)
             for i in range(3)]
    for p in procs:
        assert p.wait(timeout=300) == 0, p.stderr.read()
    reports = [json.loads((tmp_path / f"r{i}.json").read_text()) for i in range(3)]
    kernels = _keys(reports[0])
    assert all(_keys(r) == kernels for r in reports)
    assert sum(r["totals"]["compiled"] for r in reports) == len(kernels)
    files = [(tmp_path / f"out{i}" / "model.so").read_bytes() for i in range(3)]
    assert files[0] == files[1] == files[2]
    x = model_zoo.random_inputs(model_zoo.cnn())
    from modelkiln import load
    np.testing.assert_allclose(load(str(tmp_path / "out0")).run(x)["logits"],
                               model_zoo.onnxruntime_outputs(model_zoo.cnn(), x)["logits"], rtol=1e-3, atol=1e-4)
    assert not os.listdir(store / "leases")  # (each builder let go of its own)


def test_a_builder_waits_for_the_kernel_another_is_compiling(tmp_path, monkeypatch):
    """A kernel leased by a live builder: this build compiles the rest, waits, and takes the
    other's object when it arrives, compiling it not at all."""
    model = model_zoo.cnn()
    first = build(model, executor="inprocess", cache=str(tmp_path / "elsewhere"), progress=False)
    key = _keys(first.report)[0]
    obj = Store(str(tmp_path / "elsewhere")).get(key)
    store = str(tmp_path / "store")
    holder = Leases(store)
    assert holder.take(key)  # (this process holds it: alive)
    waiting = threading.Event()
    real_wait = Leases.wait_for

    def wait_for(self, keys, find):
        waiting.set()
        return real_wait(self, keys, find)
    monkeypatch.setattr(Leases, "wait_for", wait_for)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", build(model, executor="inprocess", cache=store,
                                                                  progress=False)))
    t.start()
    assert waiting.wait(timeout=120)
    time.sleep(0.3)
    Store(store).put(key, obj)
    holder.release(key)
    t.join(timeout=120)
    report = out["r"].report
    row = next(k for k in report["kernels"] if k["key"] == key)
    assert row["cache_hit"] and row["worker"] == "another builder"
    assert report["totals"]["compiled"] == len(_keys(report)) - 1


def test_a_dead_or_stale_holder_does_not_block(tmp_path, monkeypatch):
    """A lease whose holder on this host has exited, and one from another host older than
    STALE_S, are taken over at once: the build compiles those kernels itself."""
    model = model_zoo.cnn()
    keys = _keys(build(model, executor="inprocess", cache=str(tmp_path / "elsewhere"), progress=False).report)
    store = tmp_path / "store"
    (store / "leases").mkdir(parents=True)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (store / "leases" / keys[0]).write_text(json.dumps({"host": socket.gethostname(), "pid": int(gone.stdout),
                                                         "started": 1.0}))
    stale = store / "leases" / keys[1]
    stale.write_text(json.dumps({"host": "another-machine", "pid": 1, "started": 1.0}))
    os.utime(stale, (time.time() - leases_mod.STALE_S - 60,) * 2)
    monkeypatch.setattr(leases_mod, "WAIT_S", 30.0)
    t0 = time.monotonic()
    report = build(model, executor="inprocess", cache=str(store), progress=False).report
    assert time.monotonic() - t0 < 30
    assert report["totals"]["compiled"] == len(keys)
    assert not os.listdir(store / "leases")


def test_a_lease_from_another_machine_is_waited_on_while_fresh(tmp_path):
    leases = Leases(str(tmp_path))
    path = os.path.join(leases.folder, "ab" * 32)
    with open(path, "w") as f:
        json.dump({"host": "another-machine", "pid": 1, "started": 1.0}, f)
    assert leases.holder_alive("ab" * 32) is True and not leases.take("ab" * 32)
    os.utime(path, (time.time() - leases_mod.STALE_S - 1,) * 2)
    assert leases.holder_alive("ab" * 32) is False and leases.take("ab" * 32)
