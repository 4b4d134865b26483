"""Failures are data: a crashed, hung, dying or lying worker is retried in a fresh process,
then with the safe fallback schedule; only then does the build fail, naming the kernel.
The same scenarios run on the local executor here and on Ray in test_ray.py."""
import pytest

from modelkiln.artifacts.store import Store
from modelkiln.orchestrator.api import BuildError, build
from modelkiln.orchestrator.executor_local import LocalExecutor
from tests import model_zoo
from tests.conftest import assert_matches_oracle


def faulty_build(executor, fault, store=None, model=None):
    model = model or model_zoo.cnn()
    result = build(model, executor=executor, cache=store, progress=False, inject={"fused_gemm": fault})
    return result, model, next(k for k in result.report["kernels"] if k["name"] == "fused_gemm")


@pytest.mark.parametrize("fault,kind", [("crash", "crash"), ("oom", "crash"), ("exit", "crash"),
                                        ("corrupt", "bad_output"), ("hang", "timeout")])
def test_first_attempt_fault_is_retried_in_a_fresh_process(fault, kind):
    with LocalExecutor(workers=2, kernel_timeout=3) as ex:
        result, model, row = faulty_build(ex, fault)
    assert_matches_oracle(result, model)
    assert row["attempts"] == 2 and row["attempt_log"][0]["kind"] == kind and row["attempt_log"][1]["ok"]
    assert row["attempt_log"][0]["worker"] != row["attempt_log"][1]["worker"]  # another process
    assert result.report["totals"]["retried"] == 1 and result.report["totals"]["fallback"] == 0


def test_fault_until_fallback_uses_the_safe_schedule(executor):
    result, model, row = faulty_build(executor, "crash:nofallback")
    assert_matches_oracle(result, model)
    assert row["attempts"] == 3 and row["fallback"] and [a["fallback"] for a in row["attempt_log"]] == [0, 0, 1]
    assert result.report["totals"]["fallback"] == 1


def test_kernel_failing_every_attempt_fails_the_build_clearly(tmp_path, executor):
    store = Store(str(tmp_path))
    with pytest.raises(BuildError) as e:
        faulty_build(executor, "crash:always", store)
    msg = str(e.value)
    assert "1 of 6 kernels failed" in msg and "fused_gemm" in msg and "Gemm" in msg and "crash" in msg
    assert e.value.report["totals"]["failed"] == 1
    assert store.verify() == [] and store.stats()["entries"] == 5  # the others are kept, all valid
    again = build(model_zoo.cnn(), executor=executor, cache=store, progress=False)
    assert again.report["totals"]["compiled"] == 1  # nothing already built was lost


def test_trace_records_every_attempt(tmp_path, executor):
    import json
    trace = tmp_path / "trace.json"
    build(model_zoo.cnn(), executor=executor, cache=None, progress=False, inject={"fused_gemm": "crash"},
          trace=str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    assert all(e["ph"] == "X" and e["dur"] > 0 for e in events)
    compiles = [e for e in events if e["cat"] == "compile"]
    assert len(compiles) == 7  # 6 kernels, one of them twice
    gemm = [e for e in compiles if e["name"] == "fused_gemm"]
    assert [e["args"]["ok"] for e in gemm] == [False, True]
    assert len({e["tid"] for e in compiles}) >= 2  # one row per worker process
    # the model's plan and link, in order around its compiles
    [plan], [link] = ([e for e in events if e["cat"] == stage] for stage in ("plan", "link"))
    assert plan["ts"] + plan["dur"] <= min(e["ts"] for e in compiles)
    assert link["ts"] >= max(e["ts"] + e["dur"] for e in compiles)


def test_a_killed_zygote_is_replaced(executor):
    """Even the zygote (the parent of every job) dying mid-build costs one attempt, not the build."""
    import os
    import signal
    import threading

    model = model_zoo.resnet18()
    ex = LocalExecutor(workers=2)
    zygote_pid = ex.zygote.pid  # started now; killed while ResNet-18's kernels compile
    killer = threading.Timer(0.2, lambda: os.kill(zygote_pid, signal.SIGKILL))  # early: never after the build
    killer.start()
    try:
        result = build(model, executor=ex, cache=None, progress=False)
    finally:
        killer.cancel()
        ex.close()
    assert_matches_oracle(result, model)
    assert result.report["totals"]["retried"] >= 1
    assert any(a["worker"] == "zygote" for k in result.report["kernels"] for a in k["attempt_log"])


def fallback_never_answers_a_normal_lookup(executor, tmp_path):
    """A build whose kernels only compiled with the fallback schedule stores none of them (nor
    the module linked from them): a clean build over the same store compiles every kernel
    with the normal schedule, and its module is byte-equal to a clean build's."""
    model = model_zoo.cnn()
    store = Store(str(tmp_path / "store"))
    degraded = build(model, executor=executor, cache=store, progress=False, inject={"": "crash:nofallback"})
    assert degraded.report["totals"]["fallback"] == degraded.report["totals"]["kernels"]
    assert_matches_oracle(degraded, model)  # slow, but correct
    after = build(model, executor=executor, cache=store, progress=False)
    assert not after.report.get("whole_model_hit")
    assert after.report["totals"]["compiled"] == after.report["totals"]["kernels"]
    assert after.report["totals"]["fallback"] == 0
    clean = build(model, executor=executor, cache=None, progress=False)
    assert after.files["model.so"] == clean.files["model.so"]
    # --verify-cache recompiles every hit: a stored fallback object would be a BuildError here
    build(model, executor=executor, cache=store, progress=False, verify_cache=True)


def test_fallback_objects_never_poison_the_store(executor, tmp_path):
    fallback_never_answers_a_normal_lookup(executor, tmp_path)
