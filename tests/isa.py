"""Tests of code for instruction sets the host may lack.

Kiln emits different kernels for 8-lane (AVX2) and 16-lane (AVX-512) targets. A test of
either builds for an explicit target, so it tests the same code on every machine. Where the
host can run that code, the test runs it against its oracle; where it cannot, it checks what
was emitted (the kernels' assembly) instead: nothing is skipped, and nothing is run that
would die of SIGILL. On an AVX-512 host both kinds run; on an AVX2 host the AVX2 kernels run
and the AVX-512 ones are checked by their instructions.
"""
from __future__ import annotations

import re

from modelkiln.artifacts.cpu_features import missing_on_host
from modelkiln.orchestrator.target import parse_target

AVX2 = "x86-64-v3"
AVX512 = "cascadelake"  # AVX-512 F/BW/DQ/VL and VNNI; no VBMI
AVX512_NO_VNNI = "llvm -mtriple=x86_64-unknown-linux-gnu -mcpu=skylake-avx512"
AVX2_VNNI = "llvm -mtriple=x86_64-unknown-linux-gnu -mcpu=x86-64-v3 -mattr=+avxvnni"  # Alder Lake's, Zen 5's
X86_TARGETS = (AVX2, AVX512)


def host_runs(target) -> bool:
    """Can this machine run code built for `target`?"""
    t = parse_target(target)
    return t.runnable and not missing_on_host(t.cpu_flags())


def kernel_assembly(result) -> str:
    """The assembly of every kernel of a build, for the build's target (compiled here, with
    no LLVM option set: the same code the build's workers produced)."""
    from modelkiln.codegen_worker.compile import compile_kernel
    target = result.target.to_dict()
    return "\n".join(compile_kernel(c.kernel.to_bytes(), c.kernel.symbol, target, emit_asm=True)["asm"]
                     for c in result.lowered.calls)


# What code for each x86 vector width cannot do without: AVX-512 code names a zmm register,
# a mask register or one of the registers 16-31 (a 7-wide row is one masked ymm); AVX2 code
# names ymm registers.
VECTOR_SIGNS = {16: r"zmm|%k[1-7]|%[xy]mm(1[6-9]|2[0-9]|3[01])\b", 8: r"%ymm", 4: r"%xmm"}


def run_or_inspect(result, run, instructions=None) -> bool:
    """run() (which runs the build's module against an oracle) where the host runs the build's
    target; otherwise assert that every one of `instructions` (regular expressions over the
    assembly, e.g. "vpdpbusd"; default: the signs of the target's vector width) appears in
    the kernels' assembly. Returns whether it ran."""
    if host_runs(result.target):
        run()
        return True
    if instructions is None:
        instructions = (VECTOR_SIGNS[result.target.vector_width],)
    asm = kernel_assembly(result)
    missing = [i for i in instructions if not re.search(i, asm)]
    assert not missing, f"built for {result.target.name}, its kernels hold no {missing}"
    return False


def lanes(target) -> int:
    return parse_target(target).vector_width
