"""A batch's models planned and linked in forked model hosts (orchestrator/model_hosts.py),
streamed beside their compiles (orchestrator/batch_schedule.py)."""
import os

import pytest

from modelkiln.orchestrator import batch_schedule
from modelkiln.orchestrator.api import build_many
from tests import model_zoo
from tests.conftest import assert_matches_oracle

MODELS = [model_zoo.cnn, model_zoo.mlp, lambda: model_zoo.residual_cnn(size=16, width=16, blocks=1)]


def _batch(executor, monkeypatch, hosts: str, **kw):
    monkeypatch.setenv("KILN_MODEL_HOSTS", hosts)
    models = [make() for make in MODELS]
    return models, build_many(models, executor=executor, cache=None, progress=False, **kw)


def test_hosts_build_the_bytes_the_driver_builds(executor, monkeypatch):
    models, alone = _batch(executor, monkeypatch, "1")
    _, hosted = _batch(executor, monkeypatch, "2")
    assert alone.report["timing"]["model_hosts"] == 0 and hosted.report["timing"]["model_hosts"] == 2
    for a, h, model in zip(alone.results, hosted.results, models):
        assert {n: bytes(v) for n, v in a.files.items()} == {n: bytes(v) for n, v in h.files.items()}
        assert a.graph is not None and h.graph is None  # (the graph stayed in the host)
        assert_matches_oracle(h, model)


def test_the_first_model_compiles_while_the_next_is_planned(executor, monkeypatch):
    """The last model's plan waits for a compile result: it comes only if the first models'
    jobs were sent before every model was planned."""
    import threading
    from modelkiln.orchestrator import compile_stage
    answered, seen = threading.Event(), []
    real_answer, real_plan = compile_stage.CompileStage._answer, batch_schedule.ModelWork.plan

    def answer(self, r):
        answered.set()
        real_answer(self, r)

    def plan(self, i):
        if i == len(MODELS) - 1:
            seen.append(answered.wait(timeout=60))
        return real_plan(self, i)
    monkeypatch.setattr(compile_stage.CompileStage, "_answer", answer)
    monkeypatch.setattr(batch_schedule.ModelWork, "plan", plan)
    models, batch = _batch(executor, monkeypatch, "1")
    assert seen == [True] and batch.ok


def _dies_in_a_host(die_for):
    driver, real_plan = os.getpid(), batch_schedule.ModelWork.plan

    def plan(self, i):
        if os.getpid() != driver and die_for(i):
            os._exit(7)
        return real_plan(self, i)
    return plan


def test_a_host_that_dies_fails_only_the_model_it_was_planning(executor, monkeypatch):
    monkeypatch.setattr(batch_schedule.ModelWork, "plan", _dies_in_a_host(lambda i: i == 1))
    models, batch = _batch(executor, monkeypatch, "2")
    [failure] = batch.failures
    assert failure.index == 1 and failure.stage == "plan"
    assert "model host process" in failure.message and "exit code 7" in failure.message
    for i in (0, 2):  # (planned again elsewhere if the dead host held them)
        assert_matches_oracle(batch.results[i], models[i])


def test_once_every_host_died_the_driver_plans_the_rest(executor, monkeypatch):
    monkeypatch.setattr(batch_schedule.ModelWork, "plan", _dies_in_a_host(lambda i: True))
    models, batch = _batch(executor, monkeypatch, "2")
    assert sorted(f.index for f in batch.failures) == [0, 1]  # (each host's first model)
    assert_matches_oracle(batch.results[2], models[2])


@pytest.mark.parametrize("hosts", ["1", "2"])
def test_models_sharing_kernels_compile_them_once(executor, monkeypatch, hosts):
    monkeypatch.setenv("KILN_MODEL_HOSTS", hosts)
    batch = build_many([model_zoo.cnn(), model_zoo.cnn()], executor=executor, cache=None, progress=False)
    totals = batch.report["totals"]
    assert totals["kernels"] == 6 and totals["compiled"] == 6 and totals["kernel_calls"] == 12
    assert batch.results[0].files["model.so"] == batch.results[1].files["model.so"]


def test_a_host_found_dead_when_sent_work_hands_the_model_on():
    """A host that died before the driver heard of it: the send fails, and the model it was
    being sent is planned elsewhere (here by the driver: no host is left), not failed."""
    from types import SimpleNamespace

    from modelkiln.orchestrator.model_hosts import ForkedHosts

    class Work:
        def plan(self, i):
            return SimpleNamespace(model=i)
    hosts = ForkedHosts(Work(), 1)
    try:
        hosts.hosts[0].proc.kill()
        hosts.hosts[0].proc.join()
        hosts.plan(7)
        events = hosts.events()
        assert [(kind, i) for kind, i, *_ in events] == [("replanned", 7), ("planned", 7)]
        assert events[1][2].model == 7 and events[1][3][2] == "driver"
    finally:
        hosts.close()
