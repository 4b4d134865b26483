"""`kiln workers up|status|down` on the shared three-node cluster, as a user runs them: each
command its own process, the pool's actors outliving the process that started them."""
import json
import os
import subprocess
import sys

import pytest

from modelkiln.orchestrator.api import build
from tests.test_bad_input import ROOT, kiln

EXAMPLE = os.path.join(ROOT, "configs", "examples", "cnn.onnx")


# A pool actor named for another toolchain, as an older Kiln's `workers up` leaves it: started
# by a driver of its own, as that Kiln's was (the suite's long-lived driver has seen nodes die
# in earlier tests, and Ray has been seen to leave such a driver waiting forever for a new
# actor's "alive" notice).
FOREIGN_POOL_ACTOR = """
import sys, ray
from modelkiln.orchestrator import pool_lookup, ray_actor
ray.init(address=sys.argv[1], namespace=pool_lookup.NAMESPACE, log_to_driver=False)
ray.cloudpickle.register_pickle_by_value(ray_actor)
actor = ray.remote(num_cpus=1)(ray_actor.CodegenActor).options(
    name=pool_lookup.PREFIX + "0123456789abcdef-0", lifetime="detached").remote()
ray.get(actor.hello.remote(), timeout=120)
"""


def start_foreign_pool_actor(address: str) -> None:
    r = subprocess.run([sys.executable, "-c", FOREIGN_POOL_ACTOR, address], capture_output=True, text=True,
                       timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.slow
def test_a_warm_pool_is_used_and_an_old_one_never(ray_cluster, ray_executor, executor, tmp_path):
    ray_executor.close()  # the pool takes the cluster's CPUs
    address = ray_cluster.address
    try:
        up = kiln("workers", "up", "--ray-address", address, "-n", "2")
        assert up.returncode == 0, up.stderr[-2000:]
        assert "2 actors (2 started now)" in up.stdout
        again = kiln("workers", "up", "--ray-address", address, "-n", "2")  # already up: nothing to start
        assert "2 actors (0 started now)" in again.stdout, again.stdout + again.stderr[-2000:]
        start_foreign_pool_actor(address)

        status = kiln("workers", "status", "--ray-address", address)
        lines = status.stdout.strip().splitlines()
        assert len(lines) == 3 and sum("another Kiln" in line for line in lines) == 1, status.stdout

        r = kiln("build", EXAMPLE, "-o", str(tmp_path / "b"), "--executor", "ray", "--ray-address", address,
                 "--no-cache", "--report", str(tmp_path / "r.json"), "--quiet")
        assert r.returncode == 0, r.stderr[-2000:]
        report = json.loads((tmp_path / "r.json").read_text())
        assert report["workers"] == 2 and report["cluster"]["nodes"]
        assert all(row["pooled"] for row in report["cluster"]["nodes"].values())
        local = build(EXAMPLE, executor=executor, cache=None, progress=False)
        assert (tmp_path / "b" / "model.so").read_bytes() == local.files["model.so"]

        # without an address: the cluster `up` recorded, and its pool
        r = kiln("build", EXAMPLE, "-o", str(tmp_path / "c"), "--executor", "ray", "--no-cache",
                 "--report", str(tmp_path / "r2.json"), "--quiet")
        assert r.returncode == 0, r.stderr[-2000:]
        report = json.loads((tmp_path / "r2.json").read_text())
        assert report["workers"] == 2 and all(row["pooled"] for row in report["cluster"]["nodes"].values())

        down = kiln("workers", "down", "--ray-address", address)
        assert "removed 3 pool actors" in down.stdout, down.stdout + down.stderr[-2000:]
        assert "no Kiln worker pool" in kiln("workers", "status", "--ray-address", address).stdout
    finally:
        kiln("workers", "down", "--ray-address", address)


def test_up_without_a_cluster_says_how_to_start_one(tmp_path):
    r = kiln("workers", "up", "--ray-address", "127.0.0.1:9")
    assert r.returncode == 2 and "no Ray cluster at '127.0.0.1:9'" in r.stderr and "ray start --head" in r.stderr
