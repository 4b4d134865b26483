"""A warm pool: long-lived, detached codegen actors that builds borrow instead of booting their own.

    kiln workers up [--ray-address A] [-n N]     # start (or top up) this Kiln's pool
    kiln workers status                          # every Kiln pool on the cluster, and whether it answers
    kiln workers down                            # remove every Kiln pool, old ones included

Pool actors are named `kiln-codegen-<toolchain digest>-...` in the Ray namespace `kiln`. A build
looks only for its own digest, so a pool from another Kiln (or another llvmlite) is never
used; it still says hello, and is checked like any other actor, before it gets work.

`up` records the cluster's address in Kiln's cache folder (`workers.json`); a build with
`--executor ray` and no address joins that cluster when it still answers, so a pool started
on this machine is found without flags.
"""
from __future__ import annotations

import json
import os

from ..ir.errors import KilnError

from .pool_lookup import NAMESPACE, PREFIX, find, pool_names, record_path, recorded_address, unreachable

STATUS_TIMEOUT = 10.0  # seconds a pool actor may take to answer `status`


def _connect(address: str | None):
    import ray
    address = address or os.environ.get("RAY_ADDRESS") or recorded_address() or "auto"
    why = unreachable(address)
    if not why:
        try:
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
            return ray
        except ConnectionError as e:
            why = str(e)
    raise KilnError(f"no Ray cluster at {address!r} for a worker pool ({why}); start one with "
                    "`ray start --head` or pass --ray-address")


def up(address: str | None = None, workers: int | None = None, ship: str = "auto", resource: str | None = None,
       start_timeout: float = 120.0) -> dict:
    """Start this Kiln's pool (one actor per free CPU, or `workers` in all), or top it up."""
    from .executor_ray import RayExecutor, node_label
    from .toolchain_identity import local_identity
    ray = _connect(address)
    digest = local_identity()["digest"]
    ex = RayExecutor(workers=0, start_timeout=start_timeout, ship=ship, resource=resource, use_pool=False,
                     pool_name=f"{PREFIX}{digest}")
    have = ex.adopt(find(ray, digest))  # the pool so far: checked, and counted against the slots
    ready = ex.grow(workers)
    address = ray.get_runtime_context().gcs_address
    try:
        os.makedirs(os.path.dirname(record_path()), exist_ok=True)
        with open(record_path(), "w") as f:
            json.dump({"address": address, "digest": digest}, f)
    except OSError:
        pass  # only the no-flag lookup needs it
    report = {"pool": f"{PREFIX}{digest}", "address": address, "actors": ready,
              "started": ready - have, **ex.describe()}
    ray.shutdown()  # the pool's actors are detached: they outlive this driver
    if not report["actors"]:
        raise KilnError("no pool actor started:\n  " + "\n  ".join(
            [f"{node_label(n)}: {why}" for n, why in report["rejected"].items()] +
            ([f"{report['unstarted']} did not start within {start_timeout:.0f} s (no free CPU?)"]
             if report["unstarted"] else [])))
    return report


def status(address: str | None = None) -> list[dict]:
    """One row per pool actor on the cluster: its name, whether it is this Kiln's, and its hello."""
    from .toolchain_identity import local_identity
    ray = _connect(address)
    try:
        digest = local_identity()["digest"]
        rows, refs = [], {}
        for name in pool_names(ray):
            try:
                refs[name] = ray.get_actor(name, namespace=NAMESPACE).hello.remote()
            except ValueError:
                continue
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=STATUS_TIMEOUT) if refs else ([], [])
        for name, ref in refs.items():
            row = {"name": name, "ours": name.startswith(f"{PREFIX}{digest}-"), "answers": ref in ready}
            if ref in ready:
                try:
                    hello = ray.get(ref)
                    row.update(node=hello["node"], host=hello["host"], toolchain=hello["digest"])
                except ray.exceptions.RayError as e:
                    row.update(answers=False, error=type(e).__name__)
            rows.append(row)
        return rows
    finally:
        ray.shutdown()


def down(address: str | None = None) -> int:
    """Remove every Kiln pool actor on the cluster (any toolchain); returns how many."""
    ray = _connect(address)
    try:
        names = pool_names(ray)
        for name in names:
            try:
                ray.kill(ray.get_actor(name, namespace=NAMESPACE))
            except ValueError:
                pass
        try:
            os.remove(record_path())
        except OSError:
            pass
        return len(names)
    finally:
        ray.shutdown()
