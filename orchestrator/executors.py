"""Executors by name: what `build(executor="local" | "ray" | "inprocess")` and the CLI use."""
from __future__ import annotations

from ..ir.errors import KilnError

from .executor import Executor


def make_executor(kind: str = "local", workers: int | None = None, kernel_timeout: float = 300.0,
                  ray_address: str | None = None, **ray_options) -> Executor:
    """ray_options (Ray only): ship, resource, local_fallback; see executor_ray.RayExecutor."""
    if kind == "local":
        from .executor_local import LocalExecutor
        return LocalExecutor(workers, kernel_timeout)
    if kind == "inprocess":
        from .executor_local import InProcessExecutor
        return InProcessExecutor()
    if kind == "ray":
        from .executor_ray import RayExecutor
        return RayExecutor(workers, kernel_timeout, ray_address, **ray_options)
    raise KilnError(f"unknown executor '{kind}' (local, ray, inprocess)")
