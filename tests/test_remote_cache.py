"""The shared HTTP cache (artifacts.remote_store): a real nginx with WebDAV PUT for the protocol,
and a standard-library server for the faults (tests/cache_servers.py)."""
import json
import time

import pytest

from modelkiln.artifacts import remote_store
from modelkiln.ir.transform import PassContext
from modelkiln.orchestrator.api import build
from tests import model_zoo
from tests.cache_servers import FaultyServer, Nginx
from tests.conftest import assert_matches_oracle
from tests.test_bad_input import kiln


@pytest.fixture(scope="module")
def nginx(tmp_path_factory):
    server = Nginx(str(tmp_path_factory.mktemp("nginx")))
    yield server
    server.stop()


@pytest.fixture
def faulty():
    server = FaultyServer()
    yield server
    server.stop()


def test_a_second_machine_builds_from_the_shared_cache(nginx, executor, tmp_path, monkeypatch):
    """Machine A builds and fills the server; machine B (an empty local folder) gets the whole
    bundle from it (weights from /cas, the packed bundle from /ac) without compiling, and,
    when it must look kernel by kernel, every object from it."""
    model = model_zoo.resnet18()
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "machine-a"))
    a = build(model, executor=executor, cache=nginx.url + "/", progress=False)
    assert a.report["totals"]["compiled"] > 0
    assert nginx.files("ac") and nginx.files("cas")

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "machine-b"))
    b = build(model, executor=executor, cache=nginx.url, progress=False)
    assert b.report.get("whole_model_hit") and b.report["totals"]["compiled"] == 0
    assert b.files["model.so"] == a.files["model.so"] and bytes(b.files["weights.bin"]) == bytes(a.files["weights.bin"])

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "machine-c"))
    c = build(model, executor=executor, cache=nginx.url, progress=False, pass_context=PassContext(opt_level=3))
    assert c.report["totals"]["compiled"] == 0 and c.report["totals"]["cached"] == c.report["totals"]["kernels"]
    assert c.files["model.so"] == a.files["model.so"]
    assert_matches_oracle(c, model)


def test_read_only_use_never_writes_to_the_server(nginx, executor, tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "untrusted"))
    before = (nginx.files("ac"), nginx.files("cas"))
    result = build(model_zoo.mlp(), executor=executor, cache=nginx.url, cache_readonly=True, progress=False)
    assert result.report["totals"]["compiled"] > 0
    assert (nginx.files("ac"), nginx.files("cas")) == before


def test_kiln_cache_url_selects_the_server_for_the_cli(nginx, tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "first"))
    import os

    from tests.test_bad_input import ROOT
    monkeypatch.setenv("KILN_CACHE_URL", nginx.url)
    example = os.path.join(ROOT, "configs", "examples", "cnn.onnx")
    before = len(nginx.files("ac"))
    r = kiln("build", example, "-o", str(tmp_path / "b"), "--report", str(tmp_path / "r.json"), "--quiet")
    assert r.returncode == 0, r.stderr[-2000:]
    assert len(nginx.files("ac")) > before
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "empty"))
    r = kiln("build", example, "-o", str(tmp_path / "c"), "--report", str(tmp_path / "r2.json"), "--quiet")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((tmp_path / "r2.json").read_text()).get("whole_model_hit")


def test_corrupt_bytes_from_the_server_are_a_miss(faulty, executor, tmp_path, monkeypatch):
    model = model_zoo.cnn()
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "first"))
    build(model, executor=executor, cache=faulty.url, progress=False)
    faulty.fault = "corrupt"
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "other-machine"))
    with pytest.warns(UserWarning, match="is invalid"):
        result = build(model, executor=executor, cache=faulty.url, progress=False)
    assert result.report["totals"]["compiled"] == result.report["totals"]["kernels"]
    assert_matches_oracle(result, model)


def test_a_stalled_server_costs_one_timeout_not_a_hang(faulty, executor, tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "local"))
    faulty.fault = "stall"
    monkeypatch.setenv("KILN_CACHE_TIMEOUT", "1")
    model = model_zoo.resnet18()
    t0 = time.monotonic()
    with pytest.warns(UserWarning, match="does not answer"):
        result = build(model, executor=executor, cache=faulty.url, progress=False)
    elapsed = time.monotonic() - t0
    assert result.report["totals"]["compiled"] > 0
    assert elapsed < 60
    assert len(faulty.requests) == 1  # asked once, then left alone
    assert_matches_oracle(result, model)


def test_a_server_that_refuses_writes_is_only_read(faulty, executor, tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "local"))
    faulty.fault = "refuse_writes"
    with pytest.warns(UserWarning, match="refused a write"):
        result = build(model_zoo.cnn(), executor=executor, cache=faulty.url, progress=False)
    assert result.report["totals"]["compiled"] > 0 and not faulty.entries
    assert sum(r.startswith("PUT") for r in faulty.requests) == 1  # refused once, not asked again


def test_a_server_that_is_down_is_a_warning(executor, tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "local"))
    from tests.cache_servers import _free_port
    with pytest.warns(UserWarning, match="does not answer"):
        result = build(model_zoo.cnn(), executor=executor, cache=f"http://127.0.0.1:{_free_port()}/kiln",
                       progress=False)
    assert result.report["totals"]["compiled"] > 0


def test_a_bad_url_or_timeout_is_a_warning_not_a_failure(executor, tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "local"))
    monkeypatch.setenv("KILN_CACHE_TIMEOUT", "soon")
    with pytest.warns(UserWarning, match="KILN_CACHE_TIMEOUT='soon' is not a positive number"):
        from modelkiln.artifacts.remote_store import HttpCache
        assert HttpCache("http://127.0.0.1:1/kiln").timeout == 5.0
    with pytest.warns(UserWarning, match="not an http\\(s\\) cache URL"):
        result = build(model_zoo.cnn(), executor=executor, cache="http://", progress=False)
    assert result.report["totals"]["compiled"] > 0


def test_a_build_asks_the_server_for_its_kernels_at_once(faulty, executor, tmp_path, monkeypatch):
    """An empty local folder asks the server for every kernel of a model on several
    connections at once, not one request after another; what comes back is what lookups one
    at a time give: the same objects, nothing compiled."""
    model = model_zoo.cnn()
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "machine-a"))
    a = build(model, executor=executor, cache=faulty.url, progress=False)
    kernels = {k["key"] for k in a.report["kernels"]}
    assert len(kernels) > 2
    faulty.get_delay_s = 0.05
    by_kernel = PassContext(opt_level=3)  # (not found whole: looked up kernel by kernel)
    for machine, lanes in (("machine-b", remote_store.PREFETCH_CONNECTIONS), ("machine-c", 1)):
        monkeypatch.setattr(remote_store, "PREFETCH_CONNECTIONS", lanes)
        monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / machine))
        faulty.most_in_flight, faulty.requests[:] = 0, []
        got = build(model, executor=executor, cache=faulty.url, progress=False, pass_context=by_kernel)
        assert got.report["totals"]["compiled"] == 0 and got.files["model.so"] == a.files["model.so"]
        asked = [r.rsplit("/", 1)[1] for r in faulty.requests if r.startswith("GET") and "/ac/" in r]
        assert sorted(k for k in asked if k in kernels) == sorted(kernels), "each kernel asked for once"
        if lanes == 1:
            assert faulty.most_in_flight == 1
        else:
            assert faulty.most_in_flight > 1, "the lookups went one after another"
