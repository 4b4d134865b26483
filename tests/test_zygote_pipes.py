"""The driver <-> zygote pipes never deadlock: many jobs whose requests and results are each
larger than a pipe's buffer go through one zygote, four at a time."""
import threading

import pytest

from modelkiln.codegen_worker.protocol import FrameReader, encode
from modelkiln.ir.loop import Buffer, Const, Kernel, Store
from modelkiln.orchestrator.executor_local import LocalExecutor
from modelkiln.orchestrator.plan import CompileJob, make_job
from modelkiln.orchestrator.target import parse_target

STORES = 12000  # ~1 MB of kernel bytes and ~100 KB of object per job: pipes hold 64 KB


class _Call:
    def __init__(self, kernel, i):
        self.kernel, self.name, self.ops = kernel, f"big_{i}", ["Store"]


def _big_job(i: int, stores: int = STORES) -> CompileJob:
    body = tuple(Store("o0", Const(j), Const(float(i * stores + j) * 0.5, "f32")) for j in range(stores))
    kernel = Kernel((Buffer("o0", "f32", stores),), body, (("vector_width", 16), ("vectorize", False)))
    return make_job(_Call(kernel, i), parse_target("llvm"), 0)


@pytest.mark.slow
def test_large_requests_and_results_through_one_zygote():
    jobs = [_big_job(i) for i in range(16)]
    assert all(len(j.kernel_bytes) > 4 * 65536 for j in jobs)
    results = {}
    with LocalExecutor(workers=4, kernel_timeout=120) as ex:
        worker = threading.Thread(target=lambda: results.update(ex.run(jobs)), daemon=True)
        worker.start()
        worker.join(timeout=120)
        assert not worker.is_alive(), "the build is stuck: driver and zygote both blocked on full pipes"
    assert len(results) == len(jobs) and all(r.ok for r in results.values())
    assert all(len(r.object) > 65536 for r in results.values())


def test_frame_reader_reassembles_frames_split_anywhere():
    frames = [({"id": i, "ok": True}, bytes([i]) * (i * 1000)) for i in range(5)]
    stream = b"".join(encode(h, b) for h, b in frames)
    for step in (1, 7, 4096, len(stream)):
        reader, got = FrameReader(), []
        for pos in range(0, len(stream), step):
            got += reader.feed(stream[pos:pos + step])
        assert got == frames


def start_hanging_job(zygote) -> list:
    """Send a zygote one job that hangs; its processes (psutil), once they run."""
    import time

    import psutil
    job = _big_job(0, stores=4)  # small: the request fits the pipe, sent without waiting
    zygote.send({**job.request(0, False, 600, 1), "inject": "hang"}, job.kernel_bytes)
    deadline = time.monotonic() + 30
    while not psutil.Process(zygote.pid).children() and time.monotonic() < deadline:
        time.sleep(0.05)
    children = psutil.Process(zygote.pid).children(recursive=True)
    assert children, "the job never started"
    return children


def test_closing_the_zygote_leaves_no_job_running():
    """A job still running when its executor closes (here: one that hangs) dies with it,
    although each job runs in a process group of its own."""
    import time

    import psutil

    from modelkiln.codegen_worker.zygote_client import ZygoteClient
    zygote = ZygoteClient()
    children = start_hanging_job(zygote)
    t0 = time.monotonic()
    zygote.close()
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive and time.monotonic() - t0 < 10


def test_every_attempt_reports_its_peak_memory(executor):
    from modelkiln.orchestrator.api import build
    from tests import model_zoo
    report = build(model_zoo.cnn(), executor=executor, cache=None, progress=False).report
    attempts = [a for k in report["kernels"] for a in k["attempt_log"]]
    assert attempts and all(a["peak_rss_mb"] > 10 for a in attempts)  # an LLVM process: tens of MB at least
