"""One codegen job: kernel bytes + target -> object bytes.

Runs inside a process forked from the zygote (or, in the explicit debug mode, in the
caller's process). LLVM options are set here, in the job's own process, because they are
process-global: whatever this job sets dies with the process.
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time

import llvmlite.binding as llvm

from ..ir.loop import Kernel

from .llvm_emit import kernel_to_llvm_ir
from .partial_stores import split_prefix_masked_stores
from .protocol import LOG_LIMIT

_initialized = False


def initialize_llvm() -> None:
    """Initialize every target llvmlite ships (cross targets emit objects too); sets no option."""
    global _initialized
    if not _initialized:
        llvm.initialize_all_targets()
        llvm.initialize_all_asmprinters()
        _initialized = True


@contextlib.contextmanager
def _llvm_output_kept(log: list):
    """LLVM prints its remarks and warnings ("loop not vectorized: ...") on file descriptor 2,
    beneath Python's sys.stderr: while it runs, that goes into a file whose text is appended
    to `log` (a job's log in the report; `--verbose` prints it), not onto the terminal."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as f:  # (unnamed: nothing is left in the temp folder)
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            f.seek(0)
            log.append(f.read(LOG_LIMIT).decode("utf-8", "replace"))


def compile_kernel(kernel_bytes: bytes, symbol: str, target: dict, llvm_options=(), opt_level: int = 3,
                   fallback: bool = False, emit_asm: bool = False, emit_ir: bool = False) -> dict:
    """Compile one kernel. `target` holds triple, cpu, features. Returns object bytes, timings,
    what LLVM printed ("log") and, where asked, the assembly and the optimized LLVM IR (tests
    read what LLVM made of a kernel)."""
    log: list = []
    with _llvm_output_kept(log):
        result = _compile(kernel_bytes, symbol, target, llvm_options, opt_level, fallback, emit_asm, emit_ir)
    return {**result, "log": "".join(log)}


def _compile(kernel_bytes: bytes, symbol: str, target: dict, llvm_options, opt_level: int, fallback: bool,
             emit_asm: bool, emit_ir: bool) -> dict:
    initialize_llvm()
    t0 = time.perf_counter()
    kernel = Kernel.from_bytes(kernel_bytes)
    if fallback:
        kernel = kernel.with_schedule(vectorize=False)
    for opt in llvm_options:
        llvm.set_option("kiln", opt)
    text = kernel_to_llvm_ir(kernel, symbol, target["triple"], target["cpu"], target["features"])
    module = llvm.parse_assembly(text)
    module.verify()
    t1 = time.perf_counter()
    tm = llvm.Target.from_triple(target["triple"]).create_target_machine(
        cpu=target["cpu"], features=target["features"], opt=min(opt_level, 3), reloc="pic", codemodel="default")
    pto = llvm.create_pipeline_tuning_options(speed_level=min(opt_level, 3))
    if fallback:  # the safe schedule: nothing that can explode
        pto.loop_vectorization = False
        pto.slp_vectorization = False
        pto.loop_unrolling = False
    pb = llvm.create_pass_builder(tm, pto)
    pb.getModulePassManager().run(module, pb)
    if int(kernel.option("vector_width", 8)) < 16:  # (no mask registers: masked stores are slow)
        text, rewritten = split_prefix_masked_stores(str(module))
        if rewritten:
            module = llvm.parse_assembly(text)
            module.verify()
    t2 = time.perf_counter()
    obj = tm.emit_object(module)
    asm = tm.emit_assembly(module) if emit_asm else None
    t3 = time.perf_counter()
    return {"object": obj, "asm": asm, "ir": str(module) if emit_ir else None, "ir_ms": (t1 - t0) * 1e3,
            "opt_ms": (t2 - t1) * 1e3, "emit_ms": (t3 - t2) * 1e3}
