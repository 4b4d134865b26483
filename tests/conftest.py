"""Shared fixtures: one local executor (one zygote) for the session, a private cache dir,
and the oracle comparison every model test uses. Ray is started only by tests that ask
for the `ray_session` fixture."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests import model_zoo  # noqa: E402

RTOL, ATOL = 1e-3, 1e-4


@pytest.fixture(scope="session")
def executor():
    from orchestrator.executor_local import LocalExecutor
    ex = LocalExecutor(workers=2)
    yield ex
    ex.close()


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    """No test touches the user's real cache."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "kiln-cache"))


def assert_matches_oracle(result, model, seed: int = 0):
    """Run a BuildResult's module on random inputs; compare every output with onnxruntime."""
    module = result.load()
    inputs = model_zoo.random_inputs(model, seed)
    got = module.run(inputs)
    want = model_zoo.onnxruntime_outputs(model, inputs)
    assert set(got) == set(want)
    for name in want:
        assert got[name].shape == want[name].shape, name
        np.testing.assert_allclose(got[name], want[name], rtol=RTOL, atol=ATOL, err_msg=name)
    return module


def build_and_compare(model, executor, seed: int = 0, **build_kwargs):
    """Build `model`, run it on random inputs, and compare every output with onnxruntime."""
    from orchestrator.api import build
    result = build(model, executor=executor, cache=None, progress=False, **build_kwargs)
    return result, assert_matches_oracle(result, model, seed)


@pytest.fixture(scope="session")
def ray_session():
    """One Ray for the whole session (it takes ~6 s and ~700 MiB to start), 2 CPUs."""
    import ray
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def ray_executor(ray_session):
    from orchestrator.executor_ray import RayExecutor
    ex = RayExecutor(workers=2, kernel_timeout=20)
    yield ex
    ex.close()
