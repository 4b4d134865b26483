"""The zygote: a pristine process that forks one child per codegen job.

Started as `python -m modelkiln.codegen_worker.zygote`. It imports llvmlite and initializes the
targets, and never sets an LLVM option, so every child it forks starts from clean LLVM
state (options are process-global and would otherwise leak from one job into the next).
Forking is safe: llvmlite starts no threads, and the zygote imports nothing that does.

Protocol (codegen_worker.protocol frames): requests on stdin, results on stdout.
  request  {"id", "symbol", "target", "llvm_options", "opt_level", "fallback", "deadline_s",
            "attempt", "inject", "emit_asm"} + kernel bytes
  result   {"id", "ok", "pid", "ms", "peak_rss_mb", ...timings} + object bytes, or
           {"id", "ok": false, "kind": "llvm_error"|"crash"|"timeout", "message", "log", "peak_rss_mb"}
           (the executor adds "bad_output" when the bytes are not an object defining the symbol)
The zygote is the parent of each job's process, so it owns the deadline: a child stuck
inside LLVM cannot answer a timer of its own, but it can be killed.
"""
from __future__ import annotations

import os
import select
import signal
import sys
import time
import traceback

from . import faults
from .protocol import LOG_LIMIT, FrameReader, OutBuffer, decode, encode, write_all




def _prctl():
    """libc's prctl, looked up once in the zygote: a forked job only calls it."""
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None


_PRCTL = _prctl()
_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    """Linux: the kernel kills this process when its parent (the zygote) dies, so no job
    outlives a zygote killed with SIGKILL. A job in its own process group would otherwise
    live on; a hung one forever."""
    if _PRCTL is None:
        return
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the zygote died before the line above ran
        os._exit(1)


def _capture_output() -> int:
    """Send this process's stderr (where LLVM prints its remarks and warnings) into an
    anonymous file: it goes into the job's log in the report, not onto the user's terminal."""
    fd = os.memfd_create("kiln-job-log") if hasattr(os, "memfd_create") else os.open(os.devnull, os.O_RDWR)
    os.dup2(fd, 2)
    return fd


def _captured(fd: int) -> str:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        return os.read(fd, LOG_LIMIT).decode("utf-8", "replace")
    except OSError:
        return ""


def _run_child(request: dict, kernel_bytes: bytes, out_fd: int) -> None:
    """Body of the forked child: compile, write one result frame, exit without cleanup."""
    log_fd = _capture_output()
    try:
        faults.before_compile(request)
        from .compile import compile_kernel
        t0 = time.perf_counter()
        res = compile_kernel(kernel_bytes, request["symbol"], request["target"], request.get("llvm_options", ()),
                             request.get("opt_level", 3), request.get("fallback", False),
                             request.get("emit_asm", False))
        obj = faults.after_compile(request, res.pop("object"))
        llvm_log = res.pop("log")
        header = {"id": request["id"], "ok": True, "pid": os.getpid(), "ms": (time.perf_counter() - t0) * 1e3, **res,
                  "log": _captured(log_fd) + llvm_log}
        frame = encode(header, obj)
    except BaseException as e:  # noqa: BLE001 - every failure becomes a record
        frame = encode({"id": request["id"], "ok": False, "pid": os.getpid(), "kind": "llvm_error",
                        "message": f"{type(e).__name__}: {e}", "log": _captured(log_fd) + traceback.format_exc()})
    try:
        write_all(out_fd, frame)
    finally:
        os._exit(0)


class _Job:
    def __init__(self, request: dict, pid: int, fd: int):
        self.request, self.pid, self.fd = request, pid, fd
        self.deadline = time.monotonic() + float(request.get("deadline_s", 600))
        self.chunks: list[bytes] = []
        self.timed_out = False


def _finish(job: _Job) -> bytes:
    """Reap the child and turn what it wrote (or did not) into a result frame."""
    _, status, usage = os.wait4(job.pid, 0)
    peak_mb = round(usage.ru_maxrss / 1024, 1)  # Linux reports KiB: the child's own peak, exactly
    rid = job.request["id"]
    data = b"".join(job.chunks)
    if job.timed_out:
        return encode({"id": rid, "ok": False, "pid": job.pid, "kind": "timeout", "peak_rss_mb": peak_mb,
                       "message": f"no result within {job.request.get('deadline_s')} s; the job was killed"})
    try:
        header, blob = decode(data)
        if header.get("id") == rid:
            return encode({**header, "peak_rss_mb": peak_mb}, blob)
    except ValueError:
        pass
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        why = f"killed by signal {sig} ({signal.Signals(sig).name})"
    else:
        why = f"exited with status {os.WEXITSTATUS(status)}"
    return encode({"id": rid, "ok": False, "pid": job.pid, "kind": "crash", "peak_rss_mb": peak_mb,
                   "message": f"codegen process {why} before returning a result"})


def serve(in_fd: int, out_fd: int) -> None:
    from .compile import initialize_llvm
    initialize_llvm()
    running: dict[int, _Job] = {}
    requests, results = FrameReader(), OutBuffer(out_fd)
    stdin_open = True
    while stdin_open or running or results:
        now = time.monotonic()
        timeout = max(0.0, min((j.deadline for j in running.values()), default=now + 3600) - now)
        readable = ([in_fd] if stdin_open else []) + list(running)
        ready, writable, _ = select.select(readable, [out_fd] if results else [], [], timeout)
        if writable:
            try:
                results.flush()
            except OSError:  # the driver is gone: nobody wants these results
                return
        for fd in ready:
            if fd == in_fd:
                data = os.read(in_fd, 1 << 20)
                if not data:  # the driver is done with us: jobs still running are unwanted
                    stdin_open = False
                    for job in running.values():
                        _kill_group(job.pid)
                    continue
                for request, kernel_bytes in requests.feed(data):
                    running.update(_start(request, kernel_bytes))
            else:
                job = running[fd]
                chunk = os.read(fd, 1 << 20)
                if chunk:
                    job.chunks.append(chunk)
                    continue
                os.close(fd)
                del running[fd]
                results.push(_finish(job))
        now = time.monotonic()
        for job in running.values():
            if not job.timed_out and now >= job.deadline:
                job.timed_out = True
                _kill_group(job.pid)
    # stdin closed, nothing running, every result written: the parent is done with us.


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # the whole group: LLVM may have spawned helpers
    except ProcessLookupError:
        pass


def _start(request: dict, kernel_bytes: bytes) -> dict:
    """Fork the child that runs one job; {read end of its result pipe: the job}."""
    r, w = os.pipe()
    zygote = os.getpid()
    pid = os.fork()
    if pid == 0:
        os.setpgid(0, 0)
        _die_with_parent(zygote)
        os.close(r)
        _run_child(request, kernel_bytes, w)
    os.close(w)
    return {r: _Job(request, pid, r)}


def main() -> None:
    out_fd = os.dup(1)
    os.dup2(2, 1)  # stray prints from libraries must not corrupt the result stream
    sys.stdout = sys.stderr
    serve(0, out_fd)


if __name__ == "__main__":
    main()
