"""Lowering: each fused group of the graph becomes one loop-nest Kernel (see group.py).
Exports load lazily: the op definitions (ir/ops) import the helper modules of this package."""
__all__ = ["lower", "LoweredModel", "KernelCall", "ScheduleConfig"]


def __getattr__(name):
    if name in ("lower", "LoweredModel", "KernelCall", "lower_group"):
        from . import group
        return getattr(group, name)
    if name == "ScheduleConfig":
        from .builder import ScheduleConfig
        return ScheduleConfig
    raise AttributeError(f"module 'ir.lower' has no attribute '{name}'")
