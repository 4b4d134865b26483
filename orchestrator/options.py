"""BuildOptions: every setting of a build, in one place, for build(), build_many() and the CLI."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields, replace

from ..ir.errors import KilnError

DEFAULT_CACHE = "__kiln_default_cache__"  # KILN_CACHE_DIR, else the user's cache folder
PRECISIONS = ("fp32", "bf16")  # of GEMM operands (ir/lower/bf16_gemm.py)


def default_cache_dir() -> str:
    if os.environ.get("KILN_CACHE_DIR"):
        return os.environ["KILN_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kiln")


class BudgetError(KilnError):
    """An accuracy budget that cannot be met or makes no sense (orchestrator/accuracy_budget.py)."""


def check_budget(o: "BuildOptions") -> None:
    """The budget's settings make sense together (BuildOptions.__post_init__)."""
    if o.max_error is None:
        if o.calibration is not None:
            raise BudgetError("calibration inputs are for an accuracy budget: give max_error too")
        return
    if o.precision == "fp32":
        raise BudgetError("max_error is a budget for a reduced precision: build with precision='bf16' "
                          "(--precision bf16); a float32 build is the reference it is measured against")
    if isinstance(o.max_error, bool) or not isinstance(o.max_error, (int, float)) or \
            not math.isfinite(o.max_error) or o.max_error <= 0:
        raise BudgetError(f"max_error must be a positive number (a difference relative to each output's largest "
                          f"magnitude, e.g. 0.01), not {o.max_error!r}")
    if o.fp32_nodes:
        raise BudgetError("fp32_nodes is what max_error chooses: give one or the other")


@dataclass(frozen=True)
class BuildOptions:
    target: object = "llvm"  # a target string, a preset name or a Target; a model may bring its own
    opt_level: int = 3  # 0-3: graph passes and LLVM
    shapes: dict | None = None  # input name -> dims, where the model's are symbolic, zero or wrong
    dims: dict | None = None  # symbol -> (least, greatest): a dim left symbolic, run at any size in its bounds
    executor: object = "local"  # "local", "ray", "inprocess", or an Executor to reuse across builds
    workers: int | None = None  # codegen processes or actors (default: usable cores)
    ray_address: str | None = None  # join this Ray cluster (default: RAY_ADDRESS, a pool's, else a local Ray)
    ray_ship: str = "auto"  # Kiln to Ray nodes: "auto" (where a node has none), "always", "never"
    ray_resource: str | None = None  # only Ray nodes offering this custom resource compile
    ray_local_fallback: bool = False  # no matching Ray actor left: compile locally instead of failing
    kernel_timeout: float = 300.0  # seconds per codegen job before it is killed
    cache: object = DEFAULT_CACHE  # a folder, an artifacts.store.Store, or None for no store
    cache_readonly: bool = False  # read hits, write nothing (untrusted builds)
    verify_cache: bool = False  # recompile hits and fail on a byte difference
    progress: bool | None = None  # a progress line (default: on a terminal, not under CI)
    trace: str | None = None  # write a Chrome trace of the compile here
    pass_context: object = None  # an ir.PassContext (opt level, disabled passes, instruments)
    extra_passes: tuple = ()  # graph passes run after the built-in ones, before fusion
    salt: str = ""  # mixed into every cache key
    tuning: bool = True  # apply the store's tuning records (kiln tune); False: the hand-written rules only
    tuning_threads: int | None = None  # the thread count whose records apply (default: the usable cores)
    fail_fast: bool = False  # a batch stops at its first failed model (default: the others are built)
    precision: str = "fp32"  # "bf16": GEMM operands rounded to bfloat16, summed in float32 (ir/lower/bf16_gemm.py)
    # An accuracy budget for a reduced precision (orchestrator/accuracy_budget.py): the largest
    # output difference from the float32 build, relative to each output's largest magnitude; the
    # fewest kernels that bring it within stay float32. Measured on `calibration` (a dict of
    # arrays, a list of them, or .npz paths; default: random inputs of the declared shapes).
    max_error: float | None = None
    calibration: object = None
    fp32_nodes: tuple = ()  # in a bf16 build, the nodes (by key) whose products stay float32: max_error's choice
    accuracy: dict | None = None  # the budget's record, for the report and the manifest (set by max_error)
    inject: dict | None = None  # tests only: kernel-name substring -> fault (see orchestrator.plan)

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise KilnError(f"precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        check_budget(self)

    @classmethod
    def of(cls, options: "BuildOptions | None", overrides: dict) -> "BuildOptions":
        """`options` (or the defaults) with keyword overrides; an unknown keyword is an error."""
        unknown = sorted(set(overrides) - {f.name for f in fields(cls)})
        if unknown:
            raise TypeError(f"unknown build option(s): {', '.join(unknown)}")
        return replace(options or cls(), **overrides)

    @property
    def bypasses_model_cache(self) -> bool:
        """Settings the whole-model key cannot hash faithfully, or that must compile."""
        return bool(self.pass_context or self.extra_passes or self.inject or self.verify_cache)
