"""RayExecutor: codegen jobs sharded to long-lived Ray actors, each owning a zygote.

A Ray task or actor per job costs 0.7-1 s here; a fork from the actor's zygote costs
~15 ms, so actors live for the whole build (and across builds of one executor) and each
forks a fresh child per job, exactly as the local executor does. The driver ships kernels
as bytes and receives object bytes: plain data both ways.

Where actors run: the executor reads the cluster's live nodes and pins actors to them, one
per CPU (or `workers` in all, spread over the nodes; `resource` limits them to nodes that
offer that custom resource). A warm pool (orchestrator.worker_pool) of this toolchain is used
instead when one is up.

Who may compile: every actor says hello before it gets work (orchestrator.ray_actor). One on a
node without Kiln is started again with the driver's Kiln shipped to it (ship="auto"; "always"
ships to every node). One whose toolchain identity differs from the driver's is never given
work, and its node is not used again: its objects would be stored under keys that name our
toolchain. Each answer carries its toolchain digest and is checked again on arrival.

Faults: small jobs travel in batches so Ray round trips do not dominate; GEMM kernels (the
slow ones) go alone. An actor that dies, or stays silent past its batch's deadline, is killed
and replaced on its node if the node is still alive; its batch counts as a failed attempt and
is retried under the common policy. When no actor is left, the build fails naming why (or,
with local_fallback, compiles the rest locally). Jobs are idempotent, so a batch that ran
twice is harmless.
"""
from __future__ import annotations

import collections
import itertools
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
import warnings
from collections import deque

from ..ir.errors import KilnError

from . import pool_lookup, ray_actor
from .executor import ATTEMPTS, Executor, default_workers, settle
from .plan import JobResult
from .toolchain_identity import identity_difference, local_identity

SMALL_BATCH = 4  # non-GEMM jobs per round trip
ACTOR_START_TIMEOUT = 120.0  # seconds for an actor to say hello (an autoscaler may add nodes)
ANSWER_MARGIN = 15.0  # seconds an actor may take beyond its jobs' deadlines before it counts as dead
SHIP_MODES = ("auto", "always", "never")


# Set by the CLI: the process ends right after its build, so a cluster it joined is left
# connected and the process ends without Ray's teardown (cli.py; ~0.5 s of a cold build).
# A Ray this process started itself is always shut down: its processes must not outlive it.
_process_exits_next = False


def process_exits_next() -> None:
    global _process_exits_next
    _process_exits_next = True


def node_label(node: str) -> str:
    """How reports name a node (or the whole cluster, for a reason that is not one node's)."""
    return "the cluster" if node == "cluster" else f"node {node[:8]}"


class _NoSigtermWarning(logging.Filter):
    def filter(self, record) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()


class RayExecutor(Executor):
    name = "ray"

    def __init__(self, workers: int | None = None, kernel_timeout: float = 300.0, address: str | None = None,
                 start_timeout: float = ACTOR_START_TIMEOUT, ship: str = "auto", local_fallback: bool = False,
                 resource: str | None = None, use_pool: bool = True, pool_name: str | None = None):
        """pool_name (worker_pool only): actors are detached and named `pool_name`-N.

        The cluster: `address`, else RAY_ADDRESS, else the one a pool was started on here
        (worker_pool), else a new local Ray. Importing Ray, joining a cluster and asking for
        actors happen on a thread, while the caller plans the build (a cold CLI build would
        otherwise wait ~0.6 s for them first); whatever needs them waits for that thread
        (`_started`)."""
        if ship not in SHIP_MODES:
            raise KilnError(f"ship must be one of {', '.join(SHIP_MODES)}, not {ship!r}")
        self.ray = None
        self._started_ray, self._ray_tmp = False, None
        self.kernel_timeout, self.start_timeout = kernel_timeout, start_timeout
        self.ship, self.local_fallback, self.resource = ship, local_fallback, resource
        self._pool_name, self._names = pool_name, itertools.count()
        self._shipped_env = None
        self._actors: list = []  # said hello, toolchain matches
        self._info: dict = {}  # actor id -> hello + {"shipped", "pooled"}
        self._booting: dict = {}  # hello future -> (actor, node, shipped, pooled, deadline)
        self.rejected: dict = {}  # node id -> why its actors get no work
        self.lost: list = []  # why actors were lost
        self.unstarted = 0  # actors that did not say hello in time
        self.replaced = 0
        self.sent = collections.Counter()  # node id -> compile jobs sent to actors there (attempts)
        self._ids = itertools.count()
        self._wanted, self._workers, self.pooled = workers, 0, False
        self._error: BaseException | None = None
        self._thread = None
        address = address or os.environ.get("RAY_ADDRESS") or pool_lookup.recorded_address()
        ray = sys.modules.get("ray")
        if address or (ray is not None and ray.is_initialized()):
            self._thread = threading.Thread(target=self._start, args=(address, workers, use_pool), daemon=True,
                                            name="kiln-ray-start")
            self._thread.start()
        else:  # a Ray of our own: started on the main thread (its processes do not start from another)
            self._start(address, workers, use_pool)
            self._started()

    def _start(self, address, workers, use_pool) -> None:
        try:
            try:
                import ray
            except ImportError:
                raise KilnError("the ray executor needs Ray: pip install ray") from None
            self.ray = ray
            self._connect(address, workers)
            self.identity = local_identity()
            ray.cloudpickle.register_pickle_by_value(ray_actor)  # nodes need not have Kiln to start one
            self._remote = ray.remote(num_cpus=1, max_restarts=0, max_concurrency=1)(ray_actor.CodegenActor)
            pool = pool_lookup.find(ray, self.identity["digest"]) if use_pool and self._pool_name is None else []
            self.pooled, self._workers = bool(pool), len(pool)
            self._greet_later(pool)
            if not pool and self._pool_name is None:
                self._plan(workers)  # actor creation is asynchronous: they boot while the caller plans
        except BaseException as e:  # noqa: BLE001 - raised again where the caller waits
            self._error = e

    def _started(self) -> None:
        """Wait for the start thread; raise what it raised."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            raise self._error

    @property
    def workers(self) -> int:
        self._started()
        return self._workers

    # -- the cluster ----------------------------------------------------------------------

    def _connect(self, address: str | None, workers: int | None) -> None:
        ray = self.ray
        if ray.is_initialized():
            return
        # Off the main thread Ray cannot install its SIGTERM handler and says so; the handler
        # only shuts Ray down tidily, which the cluster does anyway when a driver dies.
        logging.getLogger("ray._private.worker").addFilter(_NoSigtermWarning())
        kwargs = {"include_dashboard": False, "log_to_driver": False}
        why = pool_lookup.unreachable(address) if address else ""
        if why:
            raise KilnError(f"the Ray cluster at {address!r} does not answer ({why})")
        if address:
            ray.init(address=address, **kwargs)
        else:
            # A Ray of our own runs on this machine: its workers import Kiln from where this
            # process did. Ray keeps a session folder after shutdown; one Kiln started is
            # Kiln's to remove.
            from .. import IMPORT_ROOT
            self._ray_tmp = tempfile.mkdtemp(prefix="kiln-ray-")
            ray.init(num_cpus=workers or default_workers(), _temp_dir=self._ray_tmp,
                     runtime_env={"env_vars": {"PYTHONPATH": IMPORT_ROOT}}, **kwargs)
        self._started_ray = True

    def _slots(self) -> dict:
        """node id -> how many actors it can hold: its CPUs (and units of `resource`), for the
        live nodes whose toolchain was not rejected."""
        slots = {}
        for node in self.ray.nodes():
            res = node.get("Resources", {})
            n = int(res.get("CPU", 0))
            if self.resource:
                n = min(n, int(res.get(self.resource, 0)))
            if node.get("Alive") and n > 0 and node["NodeID"] not in self.rejected:
                slots[node["NodeID"]] = n
        return slots

    def _plan(self, workers: int | None, occupied: dict | None = None) -> None:
        """Start `workers` actors (default: one per slot), spread over the nodes round-robin;
        occupied: node id -> {"actors": n} already there (a pool being topped up)."""
        slots = self._slots()
        placed = {n: (occupied or {}).get(n, {}).get("actors", 0) for n in slots}
        total = sum(slots.values()) - sum(placed.values())
        n_new = max(0, min(workers, total) if workers else total)
        nodes = sorted(slots)
        for i in range(n_new):
            free = [n for n in nodes if placed[n] < slots[n]]
            node = free[i % len(free)]
            placed[node] += 1
            self._spawn(node, self.ship == "always")
        self._workers = len(self._actors) + len(self._booting)
        if not n_new and not self._workers:
            self.rejected.setdefault("cluster", "no live node offers a CPU" +
                                     (f" and the resource '{self.resource}'" if self.resource else ""))

    def _spawn(self, node: str, shipped: bool):
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        opts = {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}
        if self.resource:
            opts["resources"] = {self.resource: 1}
        if shipped:
            opts["runtime_env"] = self._ship()
        if self._pool_name:
            opts.update(name=f"{self._pool_name}-{next(self._names)}-{os.urandom(3).hex()}",
                        namespace=pool_lookup.NAMESPACE, lifetime="detached")
        actor = self._remote.options(**opts).remote()
        self._expect_hello(actor, node, shipped, False)
        return actor

    def _expect_hello(self, actor, node: str, shipped: bool, pooled: bool) -> None:
        self._booting[actor.hello.remote()] = (actor, node, shipped, pooled, time.monotonic() + self.start_timeout)

    def _ship(self) -> dict:
        if self._shipped_env is None:
            from .ship import upload_runtime_env
            self._shipped_env = upload_runtime_env()
        return self._shipped_env

    def _node_alive(self, node: str) -> bool:
        return any(n["NodeID"] == node and n.get("Alive") for n in self.ray.nodes())

    def _greet(self, ref, actor, node, shipped, pooled) -> bool:
        """Take an actor's hello: True if it may get work. Otherwise it is killed, and started
        again with Kiln shipped if Kiln is all it lacked."""
        try:
            hello = self.ray.get(ref)
        except self.ray.exceptions.RayError as e:
            self.lost.append(f"node {node[:8]} is gone" if not self._node_alive(node) else
                             f"an actor on node {node[:8]} died while starting ({type(e).__name__})")
            return False
        node = hello["node"]
        if hello["problem"]:
            self._kill(actor)
            if shipped or self.ship == "never":
                self.rejected[node] = hello["problem"]
                return False
            try:
                self._spawn(node, True)
            except Exception as e:  # noqa: BLE001 - e.g. a Ray without the upload this relies on
                self.rejected[node] = f"{hello['problem']}; shipping Kiln there failed: {type(e).__name__}: {e}"
            return False
        differs = identity_difference(self.identity, hello["identity"])
        if differs:
            self._kill(actor)
            self.rejected[node] = f"toolchain differs ({differs}; Kiln at {hello['kiln_path']})"
            return False
        self._info[actor._actor_id] = {**hello, "shipped": shipped, "pooled": pooled}
        self._actors.append(actor)
        return True

    def _boot(self, ready: list) -> list:
        """Settle the hellos in `ready` and the overdue ones; returns the actors now ready."""
        now, up = time.monotonic(), []
        for ref, (actor, node, shipped, pooled, deadline) in list(self._booting.items()):
            if ref in ready:
                del self._booting[ref]
                if self._greet(ref, actor, node, shipped, pooled):
                    up.append(actor)
            elif now >= deadline:
                del self._booting[ref]
                self._kill(actor)  # do not hold a CPU it cannot use
                self.unstarted += 1
        return up

    def _greet_later(self, actors) -> None:
        """Actors started elsewhere (a pool's): each says hello, as ours do, before it gets work."""
        for actor in actors:
            self._expect_hello(actor, "?", False, True)

    def adopt(self, actors) -> int:
        """worker_pool: take a pool's actors, wait for their hellos; how many are ready."""
        self._started()
        self._greet_later(actors)
        self.wait_ready()
        return len(self._actors)

    def grow(self, total: int | None) -> int:
        """worker_pool: start actors until `total` are ready (default: one per slot of the
        cluster), on the slots the ready ones leave free; how many are ready."""
        self.wait_ready()
        want = total or sum(self._slots().values())
        if want > len(self._actors):
            self._plan(want - len(self._actors), occupied=self.describe()["nodes"])
            self.wait_ready()
        return len(self._actors)

    def wait_ready(self) -> None:
        """Wait until every actor has said hello or timed out (worker_pool up)."""
        self._started()
        while self._booting:
            deadline = min(d for *_, d in self._booting.values())
            ready, _ = self.ray.wait(list(self._booting), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            self._boot(ready)

    def describe(self) -> dict:
        """Where this executor's actors run and which nodes it refused, for reports."""
        self._started()
        nodes: dict = {}
        for actor in self._actors:
            info = self._info[actor._actor_id]
            row = nodes.setdefault(info["node"], {"host": info["host"], "toolchain": info["digest"], "actors": 0,
                                                  "shipped": info["shipped"], "pooled": info["pooled"],
                                                  "kiln_path": info["kiln_path"]})
            row["actors"] += 1
        return {"nodes": nodes, "rejected": dict(self.rejected), "lost": list(self.lost),
                "unstarted": self.unstarted, "replaced": self.replaced, "jobs_sent": dict(self.sent)}

    def _nobody_left(self, n_pending: int) -> str:
        ray = self.ray
        why = [f"{node_label(node)}: {reason}" for node, reason in self.rejected.items()]
        if self.unstarted:
            why.append(f"{self.unstarted} actor(s) did not start within {self.start_timeout:.0f} s (each needs 1 CPU; "
                       f"available now: {ray.available_resources().get('CPU', 0)} of "
                       f"{ray.cluster_resources().get('CPU', 0)})")
        why += self.lost[-3:]
        return (f"no Kiln codegen actor is left on the Ray cluster; {n_pending} jobs were not compiled:\n  " +
                "\n  ".join(why or ["(no reason recorded)"]) +
                "\n(local_fallback=True, or --ray-fallback-local, compiles them locally instead)")

    # -- the build --------------------------------------------------------------------------

    @staticmethod
    def _take_batch(items: deque) -> list:
        """Take one batch off the queue: a GEMM job alone, else up to SMALL_BATCH small jobs."""
        batch = [items.popleft()]
        if batch[0][0].travels_alone:
            return batch
        while items and len(batch) < SMALL_BATCH and not items[0][0].travels_alone:
            batch.append(items.popleft())
        return batch

    def _answer_deadline(self, batch: list) -> float:
        """When a batch's answer is overdue: its jobs' own deadlines (the zygote enforces
        those) plus a margin for the round trip. An actor silent past it is taken for dead."""
        return time.monotonic() + self.kernel_timeout * len(batch) + ANSWER_MARGIN

    def run(self, jobs, on_result=None):
        self._started()
        ray = self.ray
        results = {j.key: JobResult(j.key, False) for j in jobs}
        pending = deque((j, 0) for j in jobs)
        busy: dict = {}  # future -> (actor, [(job, attempt, t_sent)], answer deadline)
        if not self._actors and not self._booting and not self.pooled:
            self._plan(self._wanted)  # a closed executor used again, or every actor was lost last time
        if not jobs:
            self.wait_ready()  # run([]): just bring the actors up
        idle = list(self._actors)

        def finish(job, attempt, header, blob, worker, t0, t1, toolchain=None):
            if settle(job, results[job.key], header, blob, attempt, worker, t0, t1, toolchain):
                if on_result:
                    on_result(results[job.key])
            else:
                pending.appendleft((job, attempt + 1))

        def lose(actor, batch, why: str, kind: str):
            """The actor is dead or silent: never use it again, start a replacement on its
            node if the node is alive (it must say hello before it gets work), and fail its
            batch's attempt."""
            info = self._info.pop(actor._actor_id, {})
            self._actors.remove(actor)
            self._kill(actor)
            self.replaced += 1
            node = info.get("node", "?")
            if self._node_alive(node):
                self._spawn(node, info.get("shipped", False))
            else:
                self.lost.append(f"node {node[:8]} is gone (its actor: {why})")
            worker = "ray:dead-actor" if kind == "crash" else "ray:silent-actor"
            for job, attempt, t_sent in batch:
                finish(job, attempt, {"ok": False, "kind": kind, "message": why}, b"", worker, t_sent, time.time())

        while pending or busy:
            while pending and idle:
                actor = idle.pop()
                batch = [(job, attempt, time.time()) for job, attempt in self._take_batch(pending)]
                requests = []
                for job, attempt, _ in batch:
                    req = job.request(next(self._ids), ATTEMPTS[attempt], self.kernel_timeout, attempt + 1)
                    requests.append((req, job.kernel_bytes))
                busy[actor.compile.remote(requests)] = (actor, batch, self._answer_deadline(batch))
                self.sent[self._info[actor._actor_id]["node"]] += len(batch)
            if not busy and not self._booting:
                if not self.local_fallback:
                    raise KilnError(self._nobody_left(len(pending)))
                self._compile_locally(pending, results, on_result)
                break
            deadlines = [d for _, _, d in busy.values()] + [d for *_, d in self._booting.values()]
            wait = max(0.0, min(deadlines) - time.monotonic())
            ready, _ = ray.wait(list(busy) + list(self._booting), num_returns=1, timeout=wait)
            idle += self._boot(ready)
            now = time.monotonic()
            for ref, (actor, batch, deadline) in list(busy.items()):
                if ref in ready:
                    del busy[ref]
                    try:
                        outs = ray.get(ref)
                    except ray.exceptions.RayError as e:  # died, its node lost, or its worker crashed
                        lose(actor, batch, f"Ray actor died: {type(e).__name__}", "crash")
                        continue
                    foreign = next((d for *_, d in outs if d != self.identity["digest"]), None)
                    for (job, attempt, _), (header, blob, t0, t1, worker, digest) in zip(batch, outs):
                        if digest != self.identity["digest"]:  # never stored under our key
                            header = {"ok": False, "kind": "toolchain",
                                      "message": f"compiled by toolchain {digest}, not this driver's"}
                        finish(job, attempt, header, blob, f"{worker}:{header.get('pid', '?')}", t0, t1, digest)
                    if foreign is None:
                        idle.append(actor)
                    else:  # its node's Kiln changed under it: no more work there
                        node = self._info.pop(actor._actor_id, {}).get("node", "?")
                        self.rejected[node] = f"it answered with objects of toolchain {foreign}, not this driver's"
                        self._actors.remove(actor)
                        self._kill(actor)
                elif now >= deadline:
                    del busy[ref]
                    waited = self.kernel_timeout * len(batch) + ANSWER_MARGIN
                    lose(actor, batch, f"Ray actor did not answer within {waited:.0f} s (taken for dead)", "timeout")
        return results

    def _compile_locally(self, pending: deque, results: dict, on_result) -> None:
        """local_fallback: the jobs no actor is left for, on this machine's zygote."""
        from .executor_local import LocalExecutor
        warnings.warn("kiln: " + self._nobody_left(len(pending)).split("\n(")[0].replace(
            "jobs were not compiled", "jobs compile locally instead"))

        def merged(r):
            r.attempts[:0] = results[r.key].attempts  # keep the attempts Ray made
            results[r.key] = r
            if on_result:
                on_result(r)

        with LocalExecutor() as local:
            local.run([job for job, _ in pending], merged)
        pending.clear()

    def _kill(self, actor) -> None:
        try:
            self.ray.kill(actor)
        except Exception:  # noqa: BLE001 - already dead is fine
            pass

    def close(self):
        """Stop this executor's own actors (a warm pool's stay up) and a Ray it started."""
        try:
            self._started()
        except BaseException:  # noqa: BLE001 - it failed to start: nothing of it to stop
            pass
        if not self._pool_name:
            for actor in self._actors:
                if not self._info[actor._actor_id]["pooled"]:
                    self._kill(actor)
            for actor, _, _, pooled, _ in self._booting.values():
                if not pooled:
                    self._kill(actor)
        self._actors, self._booting, self._info = [], {}, {}
        if self._started_ray and not (_process_exits_next and not self._ray_tmp):
            self.ray.shutdown()
            self._started_ray = False
        if self._ray_tmp:
            shutil.rmtree(self._ray_tmp, ignore_errors=True)
            self._ray_tmp = None
