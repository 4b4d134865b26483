"""Where a warm pool is: its name, its actors on a cluster, the cluster it was started on.

Both the pool's commands (worker_pool) and every Ray build (executor_ray) need these; the
commands also need the executor, so these live apart from both.
"""
from __future__ import annotations

import json
import os
import socket

NAMESPACE = "kiln"
PREFIX = "kiln-codegen-"
CONNECT_TIMEOUT = 3.0  # seconds for a cluster's address to accept a connection


def record_path() -> str:
    from .options import default_cache_dir
    return os.path.join(default_cache_dir(), "workers.json")


def unreachable(address: str) -> str:
    """Why a plain HOST:PORT cluster address does not accept connections ('' if it does, or is
    of another form). Ray's own connect retries for minutes against a dead address."""
    host, sep, port = address.rpartition(":")
    if not sep or "://" in address or not port.isdigit():
        return ""
    try:
        with socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT):
            return ""
    except OSError as e:
        return e.strerror or str(e)


def recorded_address() -> str | None:
    """The address `up` recorded, if its GCS still accepts connections."""
    try:
        with open(record_path()) as f:
            address = json.load(f)["address"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return None if not isinstance(address, str) or unreachable(address) else address


def pool_names(ray) -> list[str]:
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a.get("namespace") == NAMESPACE and a["name"].startswith(PREFIX))


def find(ray, digest: str) -> list:
    """Handles to the pool actors of toolchain `digest` on the connected cluster."""
    actors = []
    for name in pool_names(ray):
        if name.startswith(f"{PREFIX}{digest}-"):
            try:
                actors.append(ray.get_actor(name, namespace=NAMESPACE))
            except ValueError:  # gone since it was listed
                pass
    return actors
