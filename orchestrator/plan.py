"""From lowered kernels to compile jobs: one job per unique cache key."""
from __future__ import annotations

from dataclasses import dataclass, field

from .cache_key import key_of, key_parts


@dataclass
class CompileJob:
    key: str
    parts: dict
    symbol: str
    kernel_bytes: bytes
    target: object  # orchestrator.target.Target
    opt_level: int
    name: str
    ops: list
    # Rough compile cost for longest-first scheduling, and whether the job travels alone
    # (GEMM kernels: the slow ones) or batched with other small jobs: from the kernel's IR.
    estimated_cost: int = 0
    travels_alone: bool = False
    inject: str | None = None  # a fault for tests, carried in every request (codegen_worker/faults.py)

    def request(self, job_id: int, fallback: bool, deadline_s: float, attempt: int) -> dict:
        return {"id": job_id, "symbol": self.symbol, "target": self.target.to_dict(),
                "llvm_options": list(self.target.llvm_options), "opt_level": self.opt_level,
                "fallback": fallback, "deadline_s": deadline_s, "inject": self.inject, "attempt": attempt}


@dataclass
class JobResult:
    key: str
    ok: bool
    object: bytes | None = None
    kind: str = ""
    message: str = ""
    log: str = ""
    attempts: list = field(default_factory=list)  # one record per attempt: kind, worker, ms
    worker: str = ""
    toolchain: str = ""  # digest of the toolchain that compiled the object (orchestrator.toolchain_identity)
    compile_ms: float = 0.0
    fallback: bool = False
    cached: bool = False


def kernel_id(call) -> str:
    """Stable identity of a kernel across builds of one model: the nodes it computes."""
    return "+".join(call.nodes)


def make_job(call, target, opt_level: int, salt: str = "", inject: dict | None = None) -> CompileJob:
    """inject (tests only): kernel-name substring or symbol -> fault spec."""
    data = call.kernel.to_bytes()
    parts = key_parts(data, target, opt_level, salt=salt)
    gemm = call.kernel.has_gemm()
    return CompileJob(key_of(parts), parts, call.kernel.symbol, data, target, opt_level, call.name, call.ops,
                      estimated_cost=len(data) * (8 if gemm else 1), travels_alone=gemm,
                      inject=next((f for p, f in (inject or {}).items() if p in call.name or p == call.kernel.symbol),
                                  None))


def unique_jobs(jobs: list[CompileJob]) -> list[CompileJob]:
    """Dedupe by key, then longest estimated compile first (keeps every worker busy to the end)."""
    seen: dict[str, CompileJob] = {}
    for j in jobs:
        seen.setdefault(j.key, j)
    return sorted(seen.values(), key=lambda j: -j.estimated_cost)
