"""LLVM options are process-global: a job that sets one must not change another job's code.

Job A compiles with -force-vector-width=4 (a real option that changes the loop vectorizer's
output), job B with no options. Under the zygote executor, B's object is byte-equal to B
compiled alone; compiled in one process (the in-process debug mode), B inherits A's option
and its object differs. The in-process half runs in a subprocess so it cannot pollute
this test process."""
import os
import subprocess
import sys

import numpy as np

from modelkiln.ir.lower import ScheduleConfig, lower
from modelkiln.orchestrator.api import optimize
from modelkiln.orchestrator.executor_local import LocalExecutor
from modelkiln.orchestrator.plan import make_job
from modelkiln.orchestrator.target import parse_target
from tests.model_zoo import GraphMaker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _elementwise_job(target):
    g = GraphMaker(0)
    y = g.op("Mul", [g.op("Add", ["x", g.const(np.float32(1))]), g.const(np.float32(3))])
    model = g.model({"x": [4096]}, [y])
    graph, _ = optimize(model)
    lowered = lower(graph, ScheduleConfig.for_vector_width(16))
    assert len(lowered.calls) == 1
    return make_job(lowered.calls[0], parse_target(target), 3)


def _objects(executor, jobs):
    results = executor.run(jobs)
    assert all(r.ok for r in results.values())
    return [results[j.key].object for j in jobs]


def test_option_does_not_leak_between_isolated_jobs():
    job_a = _elementwise_job("llvm -cl-opt=-force-vector-width=4")
    job_b = _elementwise_job("llvm")
    with LocalExecutor(workers=1) as ex:
        (b_alone,) = _objects(ex, [job_b])
        a_obj, b_after_a = _objects(ex, [job_a, job_b])
    assert a_obj != b_alone, "the option must actually change code, or this test proves nothing"
    assert b_after_a == b_alone


INPROCESS = r"""
import sys
sys.path.insert(0, {root!r})
from tests.test_isolation import _elementwise_job
from modelkiln.orchestrator.executor_local import InProcessExecutor
ex = InProcessExecutor()
jobs = [_elementwise_job("llvm -cl-opt=-force-vector-width=4"), _elementwise_job("llvm")]
results = ex.run(jobs)
sys.stdout.buffer.write(results[jobs[1].key].object)
"""


def test_inprocess_debug_mode_shows_the_leak():
    job_b = _elementwise_job("llvm")
    with LocalExecutor(workers=1) as ex:
        (b_alone,) = _objects(ex, [job_b])
    proc = subprocess.run([sys.executable, "-c", INPROCESS.format(root=ROOT)], capture_output=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr.decode()
    b_after_a_inprocess = proc.stdout
    assert b_after_a_inprocess[:4] == b"\x7fELF"
    assert b_after_a_inprocess != b_alone  # B was compiled with A's -force-vector-width


def test_llvm_remarks_go_to_each_jobs_log_not_the_terminal(tmp_path):
    """LLVM prints "remark: ... loop not vectorized" on file descriptor 2 for some of UNet's
    convs: in the debugging executor too (where it compiles in the CLI's own process), that
    text goes into the kernel's log, and onto the terminal only with --verbose."""
    import onnx

    from tests import model_zoo
    from tests.test_bad_input import kiln
    path = str(tmp_path / "unet.onnx")
    onnx.save(model_zoo.unet(), path)
    quiet = kiln("build", path, "-o", str(tmp_path / "a"), "--executor", "inprocess", "--no-cache",
                 "--report", str(tmp_path / "r.json"))
    assert quiet.returncode == 0, quiet.stderr
    assert "remark:" not in quiet.stderr and "remark:" not in quiet.stdout
    report = (tmp_path / "r.json").read_text()
    assert "loop not vectorized" in report  # kept, in the kernels' attempt logs
    loud = kiln("build", path, "-o", str(tmp_path / "b"), "--executor", "inprocess", "--no-cache", "--verbose")
    assert loud.returncode == 0 and "loop not vectorized" in loud.stderr
