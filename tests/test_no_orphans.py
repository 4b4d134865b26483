"""No process outlives its build, and what LLVM prints goes into the job's log, not onto
the user's terminal."""
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.conftest import ROOT
from tests.test_bad_input import kiln

EXAMPLE = os.path.join(ROOT, "configs", "examples", "cnn.onnx")
# (SIGINT's default handler restored first: a shell without job control starts background
# jobs with SIGINT ignored, and a child inherits that, so a CI run started with `&` hung here)
_HANGING_BUILD = ("import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
                  "from modelkiln.orchestrator.api import build\n"
                  f"build({EXAMPLE!r}, cache=None, progress=False, kernel_timeout=600, workers=2,\n"
                  "      inject={'fused': 'hang:always'})\n")


# A batch of two: two model hosts beside the zygote and its jobs (orchestrator/model_hosts.py).
_HANGING_BATCH = _HANGING_BUILD.replace("import build\n", "import build_many\n").replace(
    f"build({EXAMPLE!r},", f"build_many([{EXAMPLE!r}, {EXAMPLE!r}],")


@pytest.mark.parametrize("sig,program,processes", [
    (signal.SIGKILL, _HANGING_BUILD, 3), (signal.SIGTERM, _HANGING_BUILD, 3), (signal.SIGINT, _HANGING_BUILD, 3),
    (signal.SIGKILL, _HANGING_BATCH, 5), (signal.SIGINT, _HANGING_BATCH, 5)])
def test_killing_the_driver_leaves_no_codegen_process(sig, program, processes):
    driver = subprocess.Popen([sys.executable, "-c", program], cwd=ROOT, stderr=subprocess.DEVNULL,
                              env={**os.environ, "PYTHONPATH": ROOT, "KILN_MODEL_HOSTS": "2"})
    try:
        deadline = time.monotonic() + 60
        family = []
        while time.monotonic() < deadline:  # the driver, its zygote, and hanging jobs under it
            family = psutil.Process(driver.pid).children(recursive=True)
            if len(family) >= processes:
                break
            time.sleep(0.1)
        assert len(family) >= 3, "the jobs never started"
        os.kill(driver.pid, sig)
        driver.wait(timeout=30)
        _, alive = psutil.wait_procs(family, timeout=15)
        assert not alive, f"left behind after {sig.name}: {[p.pid for p in alive]}"
    finally:
        if driver.poll() is None:
            driver.kill()


# The SIGINT lands on a thread other than the main one (as the kernel may choose, with numpy's
# BLAS threads about): Python's handler only marks it, and the main thread, waiting on the
# zygote's pipe, must look for it by itself.
_INTERRUPTED_ELSEWHERE = ("import os, signal, threading, time, psutil\n"
                          "def interrupt():\n"
                          "    while len(psutil.Process().children(recursive=True)) < 2:\n"
                          "        time.sleep(0.1)\n"
                          "    time.sleep(1)\n"
                          "    signal.pthread_kill(threading.get_ident(), signal.SIGINT)\n"
                          "threading.Thread(target=interrupt, daemon=True).start()\n" + _HANGING_BUILD)


def test_an_interrupt_delivered_to_another_thread_ends_the_build():
    driver = subprocess.Popen([sys.executable, "-c", _INTERRUPTED_ELSEWHERE], cwd=ROOT, stderr=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": ROOT})
    try:
        _, err = driver.communicate(timeout=60)
        assert driver.returncode != 0 and b"KeyboardInterrupt" in err, err[-2000:]
    finally:
        if driver.poll() is None:
            driver.kill()


def test_llvm_output_goes_to_the_job_log(tmp_path):
    report = tmp_path / "r.json"
    args = ["build", EXAMPLE, "-o", str(tmp_path / "b"), "--no-cache", "--quiet", "--report", str(report),
            "--target", "llvm -cl-opt=-force-vector-width=4"]
    r = kiln(*args)
    assert r.returncode == 0 and r.stderr.strip() == "", r.stderr  # it used to print dozens of remarks
    logs = [a["log"] for k in json.loads(report.read_text())["kernels"] for a in k["attempt_log"]]
    assert any("loop not vectorized" in log for log in logs)
    r = kiln(*args, "--verbose")
    assert r.returncode == 0 and "loop not vectorized" in r.stderr


def test_jobs_die_with_a_killed_zygote():
    """A zygote killed with SIGKILL cannot clean up: its jobs (each in a process group of its
    own) are killed by the kernel when their parent dies."""
    from modelkiln.codegen_worker.zygote_client import ZygoteClient
    from tests.test_zygote_pipes import start_hanging_job
    zygote = ZygoteClient()
    try:
        jobs = start_hanging_job(zygote)
        os.kill(zygote.pid, signal.SIGKILL)
        _, alive = psutil.wait_procs(jobs, timeout=10)
        assert not alive
    finally:
        zygote.close()
