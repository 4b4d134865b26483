"""Where a batch's models are planned and linked.

Planning (frontend, passes, lowering) and linking (weights packed, the module linked by cc)
are a model's serial work. Done by the driver one model after another, they bounded what any
number of codegen workers could do for a batch (issue 61: 14.7 s of an 89.5 s batch, so no
cluster could speed it past 6x). A batch of several models therefore plans and links them in
model hosts: processes forked from the driver at the start of the batch, before any
executor thread or Ray connection exists, so that they carry the driver's state (its store,
options and anything a test patched) and nothing that forking breaks. A host keeps each model
it planned (its graph and weights never travel) until the driver sends the model's objects,
then links it and hands back the bundle: its files as bytes, the weights as the file
descriptor of an unnamed temporary file (nothing copied). The driver only schedules: it
sends a model's new compile jobs as soon as its plan arrives and asks for its link as soon
as its last object exists.

One model, the in-process debug executor, or a batch whose local workers take every core is
planned and linked by the driver itself (InDriverHosts: api.model_host_count decides), one
request per turn of its loop; its BuildResults keep the graph and the lowered model that a
host's cannot send.

Every host answers one request at a time; requests wait in the driver until their host is
free (a large link request written into a busy host's socket would stall the driver).
"""
from __future__ import annotations

import dataclasses
import multiprocessing
import os
import pickle
import time
from collections import deque
from multiprocessing import reduction

from ..artifacts.store import TemporaryBlob
from ..ir.errors import KilnError

_QUIT = None


class InDriverHosts:
    """Plans and links in the driver, one request each time the driver asks for events: the
    first model's jobs are compiling while the next is planned."""
    count = 0  # (processes of its own)

    def __init__(self, work):
        self.work = work
        self._planned: dict = {}
        # (plans first: they feed the workers; then links: they finish models; then what a
        # link would otherwise do itself, made while the kernels compile)
        self._asked = {"plan": deque(), "link": deque(), "prepare": deque()}

    def plan(self, i: int) -> None:
        self._asked["plan"].append((i, None))

    def link(self, i: int, request: dict) -> None:
        self._asked["link"].append((i, request))

    def waitables(self) -> list:
        return []

    def events(self, ready=()) -> list:
        stage = next((s for s, asked in self._asked.items() if asked), None)
        if stage is None:
            return []
        i, request = self._asked[stage].popleft()
        t0 = time.time()
        try:
            if stage == "plan":
                p = self._planned[i] = self.work.plan(i)
                self._asked["prepare"].append((i, None))
                event = ("planned", i, p)
            elif stage == "link":
                event = ("linked", i, self.work.link(i, self._planned.pop(i), **request))
            else:
                if i in self._planned:  # (not linked already)
                    self.work.prepare(i, self._planned[i])
                return self.events()
        except Exception as e:  # noqa: BLE001 - the model's failure, the driver's to judge
            if stage == "prepare":  # (its link makes it again, and fails there by name)
                return self.events()
            event = ("failed", i, (stage, e))
        return [(*event, (t0, time.time(), "driver"))]

    def close(self) -> None:
        self._planned.clear()


class _Host:
    def __init__(self, proc, conn, index: int):
        self.proc, self.conn, self.index = proc, conn, index
        self.queue: deque = deque()
        self.busy = False
        self.models: set = set()  # the models this host planned and has not linked yet
        self.asked: dict = {}  # model -> what the host is doing with it ("plan" or "link")
        self.dead = False


class ForkedHosts:
    """`count` forked processes that plan and link the batch's models."""

    def __init__(self, work, count: int):
        ctx = multiprocessing.get_context("fork")
        self.hosts: list[_Host] = []
        self.home: dict = {}  # model -> its host
        self.fallback = InDriverHosts(work)  # (once every host has died)
        self._noticed: list = []  # events of a death found while sending, for the next events()
        for n in range(count):
            ours, theirs = ctx.Pipe()  # (a socket pair: a file descriptor can go through it)
            # (the driver's ends, its own among them, closed in the new host: else no host
            # would see the driver's end close when it dies)
            drivers_ends = [h.conn for h in self.hosts] + [ours]
            proc = ctx.Process(target=_serve, args=(theirs, work, drivers_ends), name=f"kiln-model-host-{n}",
                               daemon=True)
            proc.start()
            theirs.close()
            self.hosts.append(_Host(proc, ours, n))
        self.count = count

    def plan(self, i: int) -> None:
        alive = [h for h in self.hosts if not h.dead]
        if not alive:
            self.home[i] = self.fallback
            self.fallback.plan(i)
            return
        host = min(alive, key=lambda h: (h.busy + len(h.queue), len(h.models)))
        self.home[i] = host
        self._ask(host, i, ("plan", i))

    def link(self, i: int, request: dict) -> None:
        if self.home[i] is self.fallback:
            self.fallback.link(i, request)
        else:
            self._ask(self.home[i], i, ("link", i, request))

    def _ask(self, host: _Host, i: int, message: tuple) -> None:
        host.queue.append((i, message))
        self._next(host)

    def _next(self, host: _Host) -> None:
        while not host.busy and host.queue and not host.dead:
            i, message = host.queue.popleft()
            host.asked[i] = (message[0], time.time())
            try:
                host.conn.send(message)
                host.busy = True
            except OSError:  # (found dead by the send: the model goes elsewhere, not down with it)
                del host.asked[i]
                host.queue.appendleft((i, message))
                self._noticed += self._died(host)

    def waitables(self) -> list:
        return [h.conn for h in self.hosts if not h.dead]

    def events(self, ready=()) -> list:
        """The answers of the hosts whose connections are in `ready` (and the driver's own,
        once every host died)."""
        out, self._noticed = self._noticed + self.fallback.events(), []
        for host in self.hosts:
            if host.dead or host.conn not in ready:
                continue
            try:
                kind, i, value = host.conn.recv()
                if kind == "linked":
                    value = _with_blobs(value, host.conn)
            except (EOFError, OSError):
                out += self._died(host)
                continue
            stage, t0 = host.asked.pop(i)
            host.busy = False
            if kind == "planned":
                host.models.add(i)
            else:
                host.models.discard(i)
            out.append((kind, i, value, (t0, time.time(), f"host:{host.proc.pid}")))
            self._next(host)
        return out

    def _died(self, host: _Host) -> list:
        """The model the host was working on fails with it (the likely cause); the others it
        held or had queued are planned again elsewhere ("replanned" events)."""
        host.dead = True
        host.proc.join(timeout=1)
        code = host.proc.exitcode
        why = f"the model host process (pid {host.proc.pid}) died" + (f" with exit code {code}" if code else "")
        now, where = time.time(), f"host:{host.proc.pid}"
        out = [("failed", i, (stage, KilnError(f"{why} while it {'planned' if stage == 'plan' else 'linked'} "
                                               f"this model")), (t0, now, where))
               for i, (stage, t0) in host.asked.items()]
        again = sorted((host.models | {i for i, _ in host.queue}) - set(host.asked))
        host.asked.clear()
        host.models.clear()
        host.queue.clear()
        for i in again:
            self.plan(i)
            out.append(("replanned", i, why, (now, now, where)))
        return out

    def close(self) -> None:
        self.fallback.close()
        for host in self.hosts:
            if not host.dead:
                try:
                    host.conn.send(_QUIT)
                except OSError:
                    pass
        for host in self.hosts:
            host.proc.join(timeout=5)
            if host.proc.is_alive():
                host.proc.kill()
                host.proc.join()
            host.conn.close()


def _serve(conn, work, inherited: list) -> None:
    """A host's loop: plan and link models as the driver asks, keeping each planned model."""
    for c in inherited:  # (the driver's ends of its socket and of the hosts forked before it)
        c.close()
    planned: dict = {}
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError, KeyboardInterrupt):
            return
        if message is _QUIT:
            return
        kind, i = message[0], message[1]
        try:
            if kind == "plan":
                p = planned[i] = work.plan(i)
                answer, blobs = ("planned", i, p.summary()), []
            else:
                result = work.link(i, planned.pop(i), **message[2])
                answer, blobs = ("linked", i, _without_blobs(result)), _blobs(result)
        except Exception as e:  # noqa: BLE001 - sent to the driver, which fails this model alone
            answer, blobs = ("failed", i, (kind, _portable(e))), []
        conn.send(answer)
        for blob in blobs:
            reduction.send_handle(conn, blob.fileno(), os.getppid())
        if answer[0] == "planned" and not conn.poll():  # (idle until its objects come: prepare its bundle)
            try:
                work.prepare(i, planned[i])
            except Exception:  # noqa: BLE001 - its link makes it again, and fails there by name
                pass


def _blobs(result) -> list:
    return [v for v in result.files.values() if isinstance(v, TemporaryBlob)]


def _without_blobs(result):
    """The BuildResult to send: without the graph and the lowered model (they stay here, with
    the weights they hold), each temporary blob as (size, sha256) (its file follows)."""
    files = {name: ("blob", v.size, v.sha256) if isinstance(v, TemporaryBlob) else v
             for name, v in result.files.items()}
    return dataclasses.replace(result, graph=None, lowered=None, files=files)


def _with_blobs(result, conn):
    """The BuildResult a host sent, its blobs taken over from the file descriptors that
    follow it, in the order of its files."""
    files = {}
    for name, v in result.files.items():
        if isinstance(v, tuple) and v and v[0] == "blob":
            v = TemporaryBlob.adopt(reduction.recv_handle(conn), v[1], v[2])
        files[name] = v
    result.files = files
    return result


def _portable(e: Exception) -> Exception:
    """e, if it survives pickling; else a KilnError with its message."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001
        return KilnError(f"{type(e).__name__}: {e}")
