"""The Ray executor on a real three-node cluster (tests/conftest.py, `ray_cluster`): the same
bytes as local, jobs on several nodes, the same fault handling; an actor killed mid-build is
replaced without losing the build. Nodes that lack Kiln, carry another toolchain, or die
mid-build are in tests/test_ray_nodes.py."""
import onnx
import pytest

from modelkiln.orchestrator.api import BuildError, build, build_many
from tests import model_zoo
from tests.conftest import assert_matches_oracle
from tests.test_faults import fallback_never_answers_a_normal_lookup, faulty_build


def nodes_of(report) -> set:
    """The nodes (id prefixes) that compiled a report's objects: workers are ray:HOST:NODE:PID:CHILD."""
    return {k["worker"].split(":")[2] for k in report["kernels"] if k["worker"].startswith("ray:")}


def test_ray_and_local_builds_are_byte_identical(ray_executor, executor):
    """On three nodes: the same bytes as local, jobs spread over more than one node, and every
    object's node and toolchain in the report."""
    from modelkiln.orchestrator.toolchain_identity import local_identity
    for model in (model_zoo.resnet18(), model_zoo.transformer_encoder()):
        on_ray = build(model, executor=ray_executor, cache=None, progress=False)
        local = build(model, executor=executor, cache=None, progress=False)
        assert on_ray.files["model.so"] == local.files["model.so"]
        assert all(k["worker"].startswith("ray:") for k in on_ray.report["kernels"])
        assert {k["toolchain"] for k in on_ray.report["kernels"]} == {local_identity()["digest"]}
        assert len(nodes_of(on_ray.report)) >= 2
        assert len(on_ray.report["cluster"]["nodes"]) == 3 and not on_ray.report["cluster"]["rejected"]
    assert_matches_oracle(on_ray, model)


@pytest.mark.parametrize("fault,kind", [("crash", "crash"), pytest.param("hang", "timeout", marks=pytest.mark.slow),
                                        ("corrupt", "bad_output")])
def test_faults_on_ray_are_retried(ray_executor, fault, kind):
    result, model, row = faulty_build(ray_executor, fault)
    assert_matches_oracle(result, model)
    assert row["attempts"] == 2 and row["attempt_log"][0]["kind"] == kind


def test_fallback_on_ray(ray_executor):
    result, model, row = faulty_build(ray_executor, "crash:nofallback")
    assert_matches_oracle(result, model)
    assert row["fallback"] and result.report["totals"]["fallback"] == 1


def test_fallback_never_poisons_the_store_on_ray(ray_executor, tmp_path):
    fallback_never_answers_a_normal_lookup(ray_executor, tmp_path)


def test_actor_killed_mid_build_is_replaced(ray_executor):
    replaced = ray_executor.replaced
    result, model, row = faulty_build(ray_executor, "kill_actor")
    assert_matches_oracle(result, model)
    assert ray_executor.replaced == replaced + 1
    assert row["attempts"] == 2 and row["attempt_log"][0]["worker"] == "ray:dead-actor"
    assert result.report["totals"]["retried"] >= 1


def test_failing_kernel_fails_the_build_on_ray(ray_executor):
    with pytest.raises(BuildError, match="fused_gemm"):
        faulty_build(ray_executor, "crash:always")


@pytest.mark.parametrize("which", ["local", pytest.param("ray", marks=pytest.mark.slow)])
def test_conflicting_target_options_do_not_leak(which, ray_executor, executor):
    """One batch, two targets whose LLVM options conflict: each target's module is byte-equal
    to a build of that target alone."""
    ex = ray_executor if which == "ray" else executor
    model = model_zoo.transformer_encoder(seq=16, d=32, heads=2, ffn=64)
    targets = ["llvm -cl-opt=-force-vector-width=4", "llvm -cl-opt=-unroll-threshold=0", "llvm"]
    batch = build_many([(model, t) for t in targets], executor=ex, cache=None, progress=False)
    alone = [build(model, target=t, executor=ex, cache=None, progress=False) for t in targets]
    for together, single in zip(batch.results, alone):
        assert together.files["model.so"] == single.files["model.so"]
    assert batch.results[0].files["model.so"] != alone[2].files["model.so"]  # the options do change code


@pytest.mark.slow
@pytest.mark.xdist_group("ray")  # (a second Ray on the machine: beside the cluster's tests, not at once)
def test_cli_executor_ray_starts_its_own_ray(tmp_path):
    """`kiln build --executor ray` with no address starts a local Ray with num_cpus = workers."""
    import json
    import os

    from tests.test_bad_input import ROOT, kiln
    example = os.path.join(ROOT, "configs", "examples", "cnn.onnx")
    r = kiln("build", example, "-o", str(tmp_path / "b"), "--executor", "ray", "--workers", "1", "--no-cache",
             "--report", str(tmp_path / "r.json"), "--quiet")
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["executor"] == "ray" and report["workers"] == 1
    assert all(k["worker"].startswith("ray:") for k in report["kernels"])


@pytest.mark.slow
def test_cli_joins_an_existing_cluster(ray_session, ray_executor, tmp_path):
    """--ray-address joins a running cluster (here: this session's) instead of starting one."""
    import json
    import os

    from tests.test_bad_input import ROOT, kiln
    ray_executor.close()  # free the cluster's CPUs (its actors come back on its next build)
    address = ray_session.get_runtime_context().gcs_address
    example = os.path.join(ROOT, "configs", "examples", "cnn.onnx")
    r = kiln("build", example, "-o", str(tmp_path / "b"), "--executor", "ray", "--ray-address", address,
             "--no-cache", "--report", str(tmp_path / "r.json"), "--quiet")
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["executor"] == "ray" and report["workers"] == 3  # the cluster's CPUs, not a new Ray's


@pytest.mark.slow
def test_a_batch_on_the_cluster_plans_in_model_hosts_and_builds_the_local_bytes(ray_session, ray_executor,
                                                                                  tmp_path):
    """`kiln build-many --executor ray` from a new process: its models planned and linked in
    forked model hosts, their kernels compiled on the cluster, the bundles those of a local
    batch built in this process, byte for byte."""
    import json
    import os

    from modelkiln.artifacts.store import read_regular
    from tests.test_bad_input import kiln
    ray_executor.close()  # free the cluster's CPUs (its actors come back on its next build)
    address = ray_session.get_runtime_context().gcs_address
    models = []
    for name, make in (("cnn", model_zoo.cnn), ("mlp", model_zoo.mlp)):
        models.append(str(tmp_path / f"{name}.onnx"))
        onnx.save(make(), models[-1])
    r = kiln("build-many", *models, "-o", str(tmp_path / "out"), "--executor", "ray", "--ray-address", address,
             "--no-cache", "--report", str(tmp_path / "r.json"), "--quiet")
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["executor"] == "ray" and report["timing"]["model_hosts"] == 2
    local = build_many(models, cache=None, progress=False)
    for path, built in zip(models, local.results):
        folder = tmp_path / "out" / os.path.splitext(os.path.basename(path))[0]
        assert read_regular(str(folder / "model.so")) == built.files["model.so"]


@pytest.mark.slow
def test_actors_that_cannot_start_are_an_error_not_a_hang(ray_session, ray_executor):
    """A cluster with no free CPU: the build fails clearly instead of waiting forever."""
    from modelkiln.ir.errors import KilnError
    from modelkiln.orchestrator.executor_ray import RayExecutor
    ray_executor.run([])  # make sure the session executor's actors hold every CPU
    ex = RayExecutor(workers=1, start_timeout=3)
    with pytest.raises(KilnError, match="(?s)no Kiln codegen actor is left.*did not start within 3 s"):
        build(model_zoo.cnn(), executor=ex, cache=None, progress=False)
    ex.close()


@pytest.mark.slow
def test_a_silent_actor_is_taken_for_dead_in_bounded_time(ray_session, ray_executor, monkeypatch):
    """An actor that is alive but never answers: its batch fails after the kernel deadline
    plus a margin, a replacement finishes the build, and the report shows the retry."""
    import time

    from modelkiln.orchestrator import executor_ray
    from modelkiln.orchestrator.executor_ray import RayExecutor
    monkeypatch.setattr(executor_ray, "ANSWER_MARGIN", 2.0)
    ray_executor.close()  # free the session's 2 CPUs for this executor's actors
    with RayExecutor(workers=2, kernel_timeout=3) as ex:
        t0 = time.monotonic()
        result, model, row = faulty_build(ex, "silent_actor")
        elapsed = time.monotonic() - t0
    assert_matches_oracle(result, model)
    assert row["attempts"] == 2 and row["attempt_log"][0]["kind"] == "timeout"
    assert "did not answer" in row["attempt_log"][0]["message"]
    assert elapsed < 60
