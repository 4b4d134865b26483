"""What this machine's toolchain is: host triple, CPU and features as LLVM sees them, the
llvmlite and LLVM versions, the C compiler. Every cache key names these.

Asking LLVM costs loading it (~30 ms) and asking `cc --version` a process, which is most
of what a whole-model hit would spend outside hashing. The answers cannot change while the
CPU, llvmlite and the compiler stay the same, so they are kept in a small file named by a
fingerprint of exactly those (CPU flags, llvmlite's and the compiler's files), read back
without importing llvmlite. A record that cannot be read or written is asked for again.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import platform
import sys
import tempfile

_RECORD_VERSION = 1


def _cpu_fingerprint() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(sorted({line for line in f if line.startswith(("model name", "flags", "Features"))}))
    except OSError:
        return platform.processor()


def _file_fingerprint(path: str | None) -> str:
    if not path:
        return ""
    try:
        st = os.stat(path)
        return f"{os.path.realpath(path)}:{st.st_size}:{st.st_mtime_ns}"
    except OSError:
        return path


def fingerprint() -> str:
    from ..artifacts.link import find_cc
    spec = importlib.util.find_spec("llvmlite")
    llvmlite_dir = os.path.dirname(spec.origin) if spec and spec.origin else ""
    binding = [os.path.join(llvmlite_dir, "binding", f) for f in sorted(os.listdir(os.path.join(llvmlite_dir, "binding")))
               if f.startswith("libllvmlite")] if llvmlite_dir else []
    try:
        cc = find_cc()
    except Exception:  # noqa: BLE001 - no compiler: the record says so, the link will fail clearly
        cc = ""
    parts = [str(_RECORD_VERSION), sys.version, platform.machine(), _cpu_fingerprint(),
             _file_fingerprint(os.path.join(llvmlite_dir, "__init__.py")), *map(_file_fingerprint, binding),
             _file_fingerprint(cc)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _ask() -> dict:
    import llvmlite
    import llvmlite.binding as llvm

    from ..artifacts.link import compiler_identity
    llvm.initialize_native_target()
    return {"triple": llvm.get_process_triple(), "cpu": llvm.get_host_cpu_name(),
            "features": llvm.get_host_cpu_features().flatten(), "llvmlite": llvmlite.__version__,
            "llvm": ".".join(map(str, llvm.llvm_version_info)), "cc": compiler_identity()}


def _record_dir() -> str:
    from .options import default_cache_dir
    return os.path.join(default_cache_dir(), "toolchain")


@functools.lru_cache(maxsize=1)
def host_toolchain() -> dict:
    """{"triple", "cpu", "features", "llvmlite", "llvm", "cc"} of this machine."""
    path = os.path.join(_record_dir(), f"{fingerprint()[:32]}.json")
    try:
        with open(path) as f:
            record = json.load(f)
        if set(record) == {"triple", "cpu", "features", "llvmlite", "llvm", "cc"}:
            return record
    except (OSError, ValueError):
        pass
    record = _ask()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path))
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: ask again next time
    return record

