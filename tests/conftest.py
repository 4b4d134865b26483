"""Shared fixtures: one local executor (one zygote) for the session, a private cache dir,
and the oracle comparison every model test uses. Ray is started only by tests that ask
for the `ray_session` fixture."""
from __future__ import annotations

import os
import shutil
import sys
import tempfile

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests import model_zoo  # noqa: E402

RTOL, ATOL = 1e-3, 1e-4
# ... and at least this much of the output's largest magnitude: two float32 sums of the same
# terms in different orders differ by rounding of the size of their largest terms, on small
# elements too (ResNet-18's logits reach 300; its 0.27 came out 4e-4 apart on AVX2).
ATOL_OF_SCALE = 1e-5


@pytest.fixture(scope="session")
def executor():
    from modelkiln.orchestrator.executor_local import LocalExecutor
    ex = LocalExecutor(workers=2)
    yield ex
    ex.close()


@pytest.fixture
def no_winograd(monkeypatch):
    """The rule never takes Winograd (tests of the GEMM paths, whose shapes it would take;
    tests/test_winograd.py tests it)."""
    from modelkiln.ir.lower import conv
    monkeypatch.setattr(conv, "winograd_pays", lambda *args: False)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    """No test touches the user's real cache."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "kiln-cache"))


_SHARED_STORE: list = []


@pytest.fixture(scope="session", autouse=True)
def _shared_store_folder(tmp_path_factory):
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # (each test process's basetemp is a folder of the run's)
        root = root.parent
    path = root / "shared-store"
    path.mkdir(exist_ok=True)
    _SHARED_STORE[:] = [str(path)]


def shared_cache() -> str:
    """One store for every test process of this run, for builds whose module is all a test
    asserts about (`build(...).load()`): a kernel an earlier test compiled comes from it, the
    same bytes a compile gives (the code under test does not change within a run), and an
    identical model comes whole. Tests of what a build compiles, caches or lowers keep
    `cache=None` or a store of their own. (2026-12-02, Zen 5: 22 GroupQueryAttention variants
    20 -> 5 s; onnx's node cases 202 -> 127 s.)"""
    return _SHARED_STORE[0]


def assert_matches_oracle(result, model, seed: int = 0):
    """Run a BuildResult's module on random inputs; compare every output with onnxruntime."""
    module = result.load()
    inputs = model_zoo.random_inputs(model, seed)
    got = module.run(inputs)
    want = model_zoo.onnxruntime_outputs(model, inputs)
    assert set(got) == set(want)
    for name in want:
        assert got[name].shape == want[name].shape, name
        finite = want[name][np.isfinite(want[name])] if want[name].dtype.kind == "f" else np.zeros(0)
        scale = float(np.abs(finite).max()) if finite.size else 0.0
        np.testing.assert_allclose(got[name], want[name], rtol=RTOL, atol=max(ATOL, ATOL_OF_SCALE * scale),
                                   err_msg=name)
    return module


def build_and_compare(model, executor, seed: int = 0, **build_kwargs):
    """Build `model`, run it on random inputs, and compare every output with onnxruntime."""
    from modelkiln.orchestrator.api import build
    result = build(model, executor=executor, cache=None, progress=False, **build_kwargs)
    return result, assert_matches_oracle(result, model, seed)


def build_and_compare_for(model, executor, target, instructions=None, seed: int = 0, **build_kwargs):
    """Build `model` for an explicit target; where this host runs the target, compare every
    output with onnxruntime, else check the kernels' assembly (tests/isa.py). Returns the build."""
    from modelkiln.orchestrator.api import build
    from tests.isa import run_or_inspect
    result = build(model, target=target, executor=executor, cache=None, progress=False, **build_kwargs)
    run_or_inspect(result, lambda: assert_matches_oracle(result, model, seed), instructions)
    return result


def kernel_statements(body):
    """Every statement of a kernel body, nested ones included (to ask which path lowering took)."""
    for s in body:
        yield s
        for part in ("body", "then", "orelse"):
            yield from kernel_statements(getattr(s, part, ()) or ())


def copies_rows_as_it_goes(kernel) -> bool:
    """Whether some loop (over output rows) both copies input rows (a loop that stores, not an
    output row's) and computes an output row (a `vector_masked` loop): a window kernel copying
    into a ring of rows (ir/lower/planes.py, RING_MIN_PLANE_BYTES)."""
    from modelkiln.ir.loop import Deinterleave, For, Store

    def output_row(t) -> bool:
        return isinstance(t, For) and t.kind == "vector_masked"

    def copies(t) -> bool:
        return isinstance(t, For) and not output_row(t) and any(
            isinstance(u, (Store, Deinterleave)) for u in kernel_statements(t.body))
    return any(isinstance(s, For) and any(copies(t) for t in s.body) and any(output_row(t) for t in s.body)
               for s in kernel_statements(kernel.body))


KILN_TEMP_PREFIX = "kiln-"  # every temp file and folder Kiln (and this suite) makes is named so


def _kiln_temp_names() -> set:
    """Kiln's names in the temp dir (only those: other processes on the machine may come and
    go there while the suite runs)."""
    return {name for name in os.listdir(tempfile.gettempdir()) if name.startswith(KILN_TEMP_PREFIX)}


def _is_xdist_worker(config) -> bool:
    return hasattr(config, "workerinput")


def pytest_sessionstart(session):
    if not _is_xdist_worker(session.config):
        session.config.kiln_temp_before = _kiln_temp_names()


def pytest_sessionfinish(session, exitstatus):
    """A full test run leaves the temp dir as it found it: nothing Kiln (or a test) creates
    there may outlive its owner. Checked once, by the process that started the run, after
    every worker (and every fixture) is gone."""
    if _is_xdist_worker(session.config) or not hasattr(session.config, "kiln_temp_before"):
        return
    left = sorted(_kiln_temp_names() - session.config.kiln_temp_before)
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_line(f"FAILED: the test run left these in {tempfile.gettempdir()}: {left}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject.toml): one test process per CPU this run may use, not per CPU of
    the machine."""
    return len(os.sched_getaffinity(0))


RAY_FIXTURES = {"ray_cluster", "ray_session", "ray_executor"}


def pytest_collection_modifyitems(config, items):
    """Tests on the shared Ray cluster run in one test process, one after another: the cluster
    is started once, and its node-loss timings are not shared with a second test's load."""
    for item in items:
        if RAY_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.xdist_group("ray"))


@pytest.fixture(scope="session")
def ray_cluster():
    """A real Ray cluster of three nodes on this machine: a head and two worker nodes, one CPU
    each, each with its own raylet, all of them gone at the end. Each node's own Kiln is this
    checkout (its PYTHONPATH). Started once (~8 s, ~1 GiB) for every test that needs Ray;
    node-death detection is shortened so that lost-node tests finish in seconds."""
    from ray.cluster_utils import Cluster
    ray_tmp = tempfile.mkdtemp(prefix="kiln-ray-")
    saved = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = ray_tmp  # Ray's address file too: nothing lands in /tmp/ray
    node_env = {"PYTHONPATH": ROOT, "KILN_CACHE_DIR": os.path.join(ray_tmp, "kiln-cache")}  # not the user's
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "env_vars": node_env,
        "_system_config": {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}})
    for _ in range(2):
        cluster.add_node(num_cpus=1, env_vars=node_env)
    cluster.wait_for_nodes()
    cluster.driver_dir = tempfile.mkdtemp(dir=ray_tmp)  # see ray_session
    yield cluster
    import ray
    ray.shutdown()
    cluster.shutdown()
    if saved is None:
        os.environ.pop("RAY_TMPDIR", None)
    else:
        os.environ["RAY_TMPDIR"] = saved
    shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def ray_session(ray_cluster):
    """This process as a driver on the shared cluster (the `ray` module). Ray puts the driver's
    working folder on every worker's path; joined from this checkout, that would hand every
    node this Kiln, and the tests of nodes without one would test nothing. So the driver joins
    from a folder of its own, as one on another machine would."""
    import ray
    if not ray.is_initialized():
        here = os.getcwd()
        os.chdir(ray_cluster.driver_dir)
        try:
            ray.init(address=ray_cluster.address, log_to_driver=False)
        finally:
            os.chdir(here)
    return ray


@pytest.fixture(scope="session")
def ray_executor(ray_session):
    from modelkiln.orchestrator.executor_ray import RayExecutor
    ex = RayExecutor(kernel_timeout=20)  # one actor per CPU: one on each node
    yield ex
    ex.close()


@pytest.fixture(scope="session")
def cnn_bundle(tmp_path_factory, executor):
    """The bundled example, built once: tests that damage a bundle damage copies of it."""
    from modelkiln.orchestrator.api import build
    result = build(model_zoo.cnn(), executor=executor, cache=None, progress=False)
    return result.export(str(tmp_path_factory.mktemp("cnn-bundle") / "cnn"))


def bundle_copy(bundle: str, tmp_path, edit_manifest=None) -> str:
    """A copy of `bundle`; edit_manifest(raw dict) may change the manifest in place, or
    return text to write instead of it."""
    import json
    out = tmp_path / "copy"
    shutil.copytree(bundle, out)
    if edit_manifest is not None:
        raw = json.loads((out / "manifest.json").read_text())
        text = edit_manifest(raw)
        (out / "manifest.json").write_text(text if isinstance(text, str) else json.dumps(raw))
    return str(out)
