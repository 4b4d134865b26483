"""Model -> compile jobs: the frontend, the graph passes and lowering.

Kept apart from the build API because it is the heavy part to import (numpy, onnx, the
lowering): a build that the store answers whole never imports this module.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..artifacts.cpu_features import byte_dot_widths, has_bf16_tiles, has_int8_tiles
from ..ir.frontend_onnx import from_onnx
from ..ir.lower import ScheduleConfig, lower
from ..ir.passes import default_pipeline
from ..ir.transform import PassContext, PassTimingInstrument
from ..ir.verify import verify_kernel

from .plan import make_job
from .target import Target


def optimize(model, shapes=None, opt_level: int = 3, pass_context: PassContext | None = None, extra_passes=(),
             dims=None):
    """Frontend + graph passes: the graph that lowering sees, and per-pass timings."""
    g = from_onnx(model, shapes, dims)
    ctx = pass_context or PassContext(opt_level=opt_level)
    timing = PassTimingInstrument()
    ctx.instruments = list(ctx.instruments) + [timing]
    try:
        with ctx:
            g = default_pipeline(extra_passes)(g, ctx)
    finally:
        ctx.instruments.remove(timing)
    return g, timing.timings


@dataclass
class PlannedModel:
    target: Target
    graph: object
    lowered: object
    jobs: list
    timings: list
    stale_records: list = field(default_factory=list)  # kernels whose tuning records no longer apply
    prepared: object = None  # its bundle but the library (orchestrator.bundle.prepare), once made

    @property
    def calls(self) -> list:
        return self.lowered.calls

    def summary(self) -> PlanSummary:
        """What the driver needs of a model planned in another process: its jobs, and what
        report.kernel_rows reads of its calls (no graph, no weights)."""
        return PlanSummary(self.jobs, [CallSummary(c.name, c.ops, c.nodes, c.tuned, c.precision, c.bf16_nodes)
                                       for c in self.lowered.calls])


@dataclass
class CallSummary:
    name: str
    ops: list
    nodes: list
    tuned: dict | None
    precision: str
    bf16_nodes: tuple


@dataclass
class PlanSummary:
    """A PlannedModel as the driver of a batch sees it when a model host planned it
    (orchestrator/model_hosts.py)."""
    jobs: list
    calls: list


def schedule_for(target: Target) -> ScheduleConfig:
    """The lowering choices a target implies (the one place they are derived from it)."""
    return ScheduleConfig.for_target(target.vector_width, target.arch == "x86_64", byte_dot_widths(target.features),
                                     has_int8_tiles(target.features), has_bf16_tiles(target.features))


def plan_model(model, target, opt_level, shapes, pass_context, extra_passes, salt, inject, dims=None,
               records=None, precision: str = "fp32", fp32_nodes=()) -> PlannedModel:
    """records: an orchestrator.tuning_records.Records whose schedules the kernels follow, or
    None; precision: "fp32", or "bf16" (ir/lower/bf16_gemm.py), with the products of
    `fp32_nodes` (node keys) kept in float32."""
    g, timings = optimize(model, shapes, opt_level, pass_context, extra_passes, dims)
    config = replace(schedule_for(target), precision=precision, fp32_nodes=frozenset(fp32_nodes))
    lowered = lower(g, config, records.lookup if records is not None else None)
    for call in lowered.calls:  # a malformed kernel is a clear error here, not an LLVM error in a child
        verify_kernel(call.kernel, call.name, call.ops)
    jobs = [make_job(c, target, opt_level, salt, inject) for c in lowered.calls]
    return PlannedModel(target, g, lowered, jobs, timings, list(records.stale) if records is not None else [])
