"""The codegen actor that runs on Ray nodes.

Ray sends this class to the nodes by value (executor_ray registers the module with Ray's
cloudpickle), and it imports Kiln only inside its methods: an actor therefore starts on a
node that has no Kiln at all, and says so in `hello`, where a class sent by reference would
fail to unpickle with an error the driver cannot act on. The driver then starts it again with
Kiln shipped (orchestrator.ship).

Every answer carries the digest of the toolchain that compiled it. The actor computes its
identity when it starts and again whenever it starts a new zygote (the node's Kiln could have
been reinstalled meanwhile), so an answer never claims a toolchain it was not made with.
"""
import os
import socket
import time


class CodegenActor:
    def __init__(self):
        self.host, self.pid = socket.gethostname(), os.getpid()
        try:
            import ray
            self.node = ray.get_runtime_context().get_node_id()
        except Exception:  # noqa: BLE001 - only the report uses it
            self.node = "?"
        self.name = f"ray:{self.host}:{self.node[:8]}:{self.pid}"
        self.identity, self.digest, self.kiln_path, self.problem = None, "", "", ""
        self.zygote = None
        try:
            import modelkiln
            self.kiln_path = os.path.dirname(modelkiln.__file__)
            self._start_zygote()
        except ImportError as e:
            self.problem = f"Kiln is not importable on this node ({e})"
        except Exception as e:  # noqa: BLE001 - reported to the driver, which decides
            self.problem = f"Kiln failed to start here: {type(e).__name__}: {e}"

    def _start_zygote(self):
        from modelkiln.codegen_worker.zygote_client import ZygoteClient
        from modelkiln.orchestrator import cache_key
        from modelkiln.orchestrator.toolchain_identity import identity_digest, toolchain_identity
        cache_key.codegen_source_hash.cache_clear()  # read the sources the new zygote will import
        self.zygote = ZygoteClient()
        self.identity = toolchain_identity()
        self.digest = identity_digest(self.identity)

    def hello(self) -> dict:
        return {"name": self.name, "node": self.node, "host": self.host, "pid": self.pid,
                "identity": self.identity, "digest": self.digest, "kiln_path": self.kiln_path,
                "problem": self.problem}

    def compile(self, requests: list) -> list:
        """[(header, blob, t_start, t_end, worker name, toolchain digest)] for [(request, kernel bytes)]."""
        from modelkiln.codegen_worker import faults
        out = []
        for header, blob in requests:
            faults.in_actor(header)
            t0 = time.time()
            try:
                self.zygote.send(header, blob)
                msg = self.zygote.receive()
            except OSError:  # a broken pipe: the zygote died
                msg = None
            if msg is None:
                self.zygote.close()
                self._start_zygote()
                msg = ({"id": header["id"], "ok": False, "kind": "crash", "message": "the zygote process died"}, b"")
            out.append((msg[0], msg[1], t0, time.time(), self.name, self.digest))
        return out

    def ping(self) -> str:
        return self.name
