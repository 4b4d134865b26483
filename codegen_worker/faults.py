"""Fault injection, for the tests that prove retries, fallbacks and replacements.

A fault enters at one seam: the request. `build(..., inject={"kernel-name-substring":
"KIND[:WHEN]"})` puts the spec into the request of every matching job (orchestrator.plan);
the process the fault belongs in asks `before_compile` / `after_compile` (the job's own
process) or `in_actor` (a Ray actor) and acts. KIND: crash (SIGSEGV), oom (SIGKILL, as the
OOM killer does), exit, hang, slow (a second's sleep: stretches a build), corrupt (a result that is not an object), kill_actor,
silent_actor (alive, never answers). WHEN: first attempt only (default), `always`, or
`nofallback` (every attempt but the fallback one).
"""
from __future__ import annotations

import os
import signal
import time


def injected(request: dict) -> str | None:
    """The fault this attempt of the job is to suffer, if any."""
    spec = request.get("inject")
    if not spec:
        return None
    kind, _, when = spec.partition(":")
    if when == "always" or (when == "nofallback" and not request.get("fallback")):
        return kind
    return kind if not when and request.get("attempt", 1) == 1 else None


def before_compile(request: dict) -> None:
    """In the job's process, before LLVM runs."""
    fault = injected(request)
    if fault == "crash":
        os.kill(os.getpid(), signal.SIGSEGV)
    if fault == "oom":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "exit":
        os._exit(3)
    if fault == "slow":
        time.sleep(1.0)
    if fault == "hang":
        while True:
            time.sleep(60)


def after_compile(request: dict, obj: bytes) -> bytes:
    """In the job's process: the object it returns."""
    return b"\x7fELF-not-really" + obj[:16] if injected(request) == "corrupt" else obj


def in_actor(request: dict) -> None:
    """In a Ray actor, before it hands the job to its zygote."""
    fault = injected(request)
    if fault == "kill_actor":
        os._exit(1)
    if fault == "silent_actor":
        time.sleep(10 ** 6)
