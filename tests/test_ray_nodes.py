"""Nodes that are not the driver, on the shared three-node cluster: a node without Kiln, a node
with another toolchain, a node lost mid-build, every node lost. Each test adds the nodes it
needs (one CPU and a custom resource each, so an executor can be held to them) and removes
them again."""
import contextlib
import os
import threading
import time

import pytest

from modelkiln.artifacts.store import Store
from modelkiln.ir.errors import KilnError
from modelkiln.orchestrator import executor_ray
from modelkiln.orchestrator.api import build
from modelkiln.orchestrator.executor_ray import ANSWER_MARGIN, RayExecutor
from modelkiln.orchestrator.toolchain_identity import local_identity
from tests import model_zoo
from tests.conftest import ROOT, assert_matches_oracle
from tests.test_ray import nodes_of

pytestmark = pytest.mark.slow  # (each test adds and loses nodes of a cluster: 90 s in all)


@contextlib.contextmanager
def extra_nodes(cluster, resource: str, count: int = 1, pythonpath: str = ROOT):
    """`count` more nodes offering `resource`, whose own Kiln is the one on `pythonpath`."""
    env = {"PYTHONPATH": pythonpath, "KILN_CACHE_DIR": os.path.join(cluster.driver_dir, "node-cache")}
    nodes = [cluster.add_node(num_cpus=1, resources={resource: 1}, env_vars=env)
             for _ in range(count)]
    cluster.wait_for_nodes()
    try:
        yield nodes
    finally:
        for node in nodes:
            if node in cluster.worker_nodes:
                cluster.remove_node(node, allow_graceful=False)


def kiln_that_is_not_importable(tmp_path) -> str:
    """A path on which `import modelkiln` fails as it does where Kiln is not installed (it
    shadows the Kiln this machine has installed, which every node would otherwise find)."""
    package = tmp_path / "no-kiln" / "modelkiln"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'modelkiln'\", name='modelkiln')\n")
    return str(package.parent)


def another_kiln(tmp_path) -> str:
    """A path holding a real Kiln whose codegen sources differ from this one's (an older or
    newer install): its toolchain identity differs."""
    from modelkiln.orchestrator.ship import stage_package
    root = stage_package(str(tmp_path / "other-kiln"))
    with open(os.path.join(root, "codegen_worker", "llvm_emit.py"), "a") as f:
        f.write("\n# another Kiln's codegen\n")
    return str(tmp_path / "other-kiln")


def test_a_node_without_kiln_gets_the_drivers_kiln(ray_cluster, ray_session, executor, tmp_path):
    model = model_zoo.cnn()
    with extra_nodes(ray_cluster, "bare", pythonpath=kiln_that_is_not_importable(tmp_path)) as [node]:
        with RayExecutor(resource="bare", kernel_timeout=20) as ex:
            result = build(model, executor=ex, cache=None, progress=False)
            where = ex.describe()
        with RayExecutor(resource="bare", kernel_timeout=20, ship="never") as ex:
            with pytest.raises(KilnError, match=f"node {node.node_id[:8]}: Kiln is not importable on this node"):
                build(model, executor=ex, cache=None, progress=False)
    assert where["nodes"].keys() == {node.node_id} and where["nodes"][node.node_id]["shipped"]
    assert nodes_of(result.report) == {node.node_id[:8]}
    assert result.files["model.so"] == build(model, executor=executor, cache=None, progress=False).files["model.so"]


def test_ship_always_sends_the_drivers_kiln_where_a_node_has_its_own(ray_cluster, ray_session, executor):
    model = model_zoo.cnn()
    with extra_nodes(ray_cluster, "own-kiln") as [node]:
        with RayExecutor(resource="own-kiln", kernel_timeout=20, ship="always") as ex:
            result = build(model, executor=ex, cache=None, progress=False)
            where = ex.describe()["nodes"][node.node_id]
    assert where["shipped"] and "runtime_resources" in where["kiln_path"]  # Ray's unpacked upload, not the node's
    assert result.files["model.so"] == build(model, executor=executor, cache=None, progress=False).files["model.so"]


def test_a_node_with_another_toolchain_is_never_given_work(ray_cluster, ray_session, ray_executor, executor,
                                                           tmp_path):
    """Four nodes, one with another Kiln: it gets no job, the others build the same bytes as
    local, and the report names the refused node and why."""
    model = model_zoo.resnet18()
    ray_executor.close()  # free the three regular nodes' CPUs
    with extra_nodes(ray_cluster, "other", pythonpath=another_kiln(tmp_path)) as [node]:
        with RayExecutor(kernel_timeout=20) as ex:
            result = build(model, executor=ex, cache=str(tmp_path / "store"), progress=False)
    assert "toolchain differs (kiln_codegen" in result.report["cluster"]["rejected"][node.node_id]
    assert node.node_id[:8] not in nodes_of(result.report) and len(nodes_of(result.report)) >= 2
    assert {k["toolchain"] for k in result.report["kernels"]} == {local_identity()["digest"]}
    assert result.files["model.so"] == build(model, executor=executor, cache=None, progress=False).files["model.so"]


def test_with_only_other_toolchains_the_build_fails_naming_them_or_compiles_locally(ray_cluster, ray_session,
                                                                                   executor, tmp_path):
    model = model_zoo.cnn()
    with extra_nodes(ray_cluster, "other", pythonpath=another_kiln(tmp_path)) as [node]:
        with RayExecutor(resource="other", kernel_timeout=20) as ex:
            with pytest.raises(KilnError, match=f"(?s)no Kiln codegen actor is left.*node {node.node_id[:8]}: "
                                                r"toolchain differs \(kiln_codegen"):
                build(model, executor=ex, cache=None, progress=False)
        with RayExecutor(resource="other", kernel_timeout=20, local_fallback=True) as ex:
            with pytest.warns(UserWarning, match="compile locally instead"):
                result = build(model, executor=ex, cache=None, progress=False)
    assert all(k["worker"].startswith("local:") for k in result.report["kernels"])
    assert_matches_oracle(result, model)


def test_an_answer_from_another_toolchain_never_enters_the_store(ray_cluster, ray_session, tmp_path, monkeypatch):
    """Even if the hello check were wrong and let a worker of another toolchain in, its answers
    carry its digest: they count as failed attempts, and nothing it compiled is stored."""
    monkeypatch.setattr(executor_ray, "identity_difference", lambda ours, theirs: "")
    store = tmp_path / "store"
    with extra_nodes(ray_cluster, "other", pythonpath=another_kiln(tmp_path)) as [node]:
        with RayExecutor(resource="other", kernel_timeout=20) as ex:
            with pytest.raises(KilnError, match=f"node {node.node_id[:8]}: it answered with objects of toolchain"):
                build(model_zoo.cnn(), executor=ex, cache=str(store), progress=False)
    assert Store(str(store)).stats()["entries"] == 0


def kill_at_its_first_job(cluster, ex, node) -> threading.Thread:
    """A started thread that removes `node` as soon as the executor has sent it a job."""
    def kill():
        deadline = time.monotonic() + 60
        while not ex.sent[node.node_id] and time.monotonic() < deadline:
            time.sleep(0.01)
        cluster.remove_node(node, False)
    killer = threading.Thread(target=kill)
    killer.start()
    return killer


def test_a_node_lost_mid_build(ray_cluster, ray_session, ray_executor):
    """A fourth node's raylet is killed while its actor compiles: the build ends correct on the
    other three, within the kernel deadline plus the margin, and the report shows the retry.
    The node dies as soon as a job has been sent there; every job sleeps a second first
    (`slow`), so that job is certainly still in flight."""
    model = model_zoo.resnet18()
    ray_executor.close()
    with extra_nodes(ray_cluster, "doomed") as [node]:
        with RayExecutor(kernel_timeout=20) as ex:
            t0 = time.monotonic()
            killer = kill_at_its_first_job(ray_cluster, ex, node)
            result = build(model, executor=ex, cache=None, progress=False, inject={"": "slow:always"})
            elapsed = time.monotonic() - t0
            killer.join()
            lost, sent = ex.describe()["lost"], ex.sent[node.node_id]
    assert_matches_oracle(result, model)
    assert sent >= 1 and any(f"node {node.node_id[:8]} is gone" in why for why in lost)
    cut = [k for k in result.report["kernels"] if any(a["worker"] == "ray:dead-actor" for a in k["attempt_log"])]
    assert cut and result.report["totals"]["retried"] >= 1
    # Every job the loss cut short was compiled again elsewhere.
    assert all(k["worker"].startswith("ray:") and k["worker"].split(":")[2] != node.node_id[:8] for k in cut)
    assert elapsed < 20 + ANSWER_MARGIN + 30


def test_every_node_lost_fails_in_bounded_time_and_keeps_what_was_compiled(ray_cluster, ray_session, executor,
                                                                          tmp_path):
    model = model_zoo.resnet18()
    store = str(tmp_path / "store")
    with extra_nodes(ray_cluster, "doomed", count=2) as nodes:
        def kill_once_something_is_stored():
            deadline = time.monotonic() + 60
            while Store(store).stats()["entries"] < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            for node in nodes:
                ray_cluster.remove_node(node, allow_graceful=False)

        with RayExecutor(resource="doomed", kernel_timeout=20, start_timeout=10) as ex:
            killer = threading.Thread(target=kill_once_something_is_stored)
            t0 = time.monotonic()
            killer.start()
            with pytest.raises(KilnError, match="(?s)no Kiln codegen actor is left.*is gone"):
                build(model, executor=ex, cache=store, progress=False, inject={"": "slow:always"})
            elapsed = time.monotonic() - t0
            killer.join()
    assert elapsed < 20 + ANSWER_MARGIN + 30
    kept = Store(store).stats()["entries"]
    assert kept >= 2 and Store(store).verify() == []
    again = build(model, executor=executor, cache=store, progress=False)  # the next build starts from them
    assert again.report["totals"]["cached"] == kept
    assert_matches_oracle(again, model)


def test_a_tune_on_the_cluster_survives_a_lost_node(ray_cluster, ray_session, ray_executor, executor, tmp_path):
    """`kiln tune` compiles on the cluster's actors. A fourth node dies as soon as a job of the
    tune has been sent there (every job sleeps a second first, `slow`, so it is certainly in
    flight): only that job is lost and compiled again elsewhere; the tune runs all its trials,
    none failed, and ends with its records, which a build then follows."""
    from modelkiln.orchestrator.tuner import tune
    model, store = model_zoo.cnn(), str(tmp_path / "store")
    ray_executor.close()
    with extra_nodes(ray_cluster, "doomed") as [node]:
        with RayExecutor(kernel_timeout=20) as ex:
            killer = kill_at_its_first_job(ray_cluster, ex, node)
            report = tune([model], trials=12, threads=1, executor=ex, cache=store, progress=False,
                          inject={"": "slow:always"}).report
            killer.join()
            lost = ex.describe()["lost"]
    # (last in this file: the tests after it start actors at once, so let the cluster count the node out)
    deadline = time.monotonic() + 30
    while ray_session.available_resources().get("CPU") != ray_session.cluster_resources().get("CPU") \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ex.sent[node.node_id] >= 1 and any(f"node {node.node_id[:8]} is gone" in why for why in lost)
    assert report["trials"] == 12 and report["failed"] == 0 and report["kernels_tuned"] >= 1
    result = build(model, executor=executor, cache=store, progress=False, tuning_threads=1)
    assert result.report["tuning"]["tuned_kernels"] >= 1
    assert_matches_oracle(result, model)
