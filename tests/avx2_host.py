"""Python as on an AVX2-only x86 host (AMD Zen 3), on any x86-64 machine with qemu-user.

Every CPU this suite was written on had AVX-512, and CI runs on whatever CPU it gets: a test
that only holds where the host has AVX-512 is found by the first AVX2 machine. This runs a
Python command (the whole suite, or one script) as if on such a machine:

    python -m tests.avx2_host -m pytest -q tests/test_quantized.py

- qemu-x86_64 `-cpu EPYC-Milan` answers cpuid as a Zen 3 does (AVX2 and FMA, no AVX-512),
  so LLVM's host detection (target "llvm"), numpy's and onnxruntime's kernel dispatch and
  the code a module runs are what they are on Zen 3; an AVX-512 instruction is SIGILL.
- /proc/cpuinfo, which Kiln reads for the host's flags (artifacts/cpu_features.py: which
  bundles load, which oracles are exact), is the real host's under qemu-user. A copy with the
  flags a Zen 3 lacks removed is opened instead, by a library preloaded into the emulated
  Python only (tests/fake_cpuinfo.c; qemu's `-L` prefix would hide /proc's process folders).
- The toolchain record, keyed by /proc/cpuinfo, lives in a cache folder of its own.

A pytest command runs its tests in the emulated process itself (`-n 0`: pytest-xdist's test
processes would start natively). Other processes the guest starts (Kiln's codegen workers,
a test's subprocess) run natively, on the real CPU: workers compile for the target the
emulated parent resolved, so the code is the same. A child that builds for `llvm` on its own
builds for the real CPU: its bundle is then refused by the emulated parent, or differs from
the parent's build. On a Zen 5, 2026-11-24,
the whole suite so (on 40f7bce): 2462 passed, and 6 failed for that reason alone
(test_bench_tools' three, test_big_models' language model, test_tuning's concurrent tuners,
test_worker_pool's warm pool); 35 minutes, against 15 natively.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile

QEMU_CPU = "EPYC-Milan"  # AMD Zen 3: AVX2, FMA, F16C, BMI2; no AVX-512, no AVX-VNNI
# Linux's names of the flags an EPYC-Milan does not have and a newer x86 host may
_NOT_ON_ZEN3 = ("avx512", "avx_vnni", "avx_ifma", "amx", "gfni", "movdir", "vp2intersect")  # (prefixes)


def qemu() -> str:
    path = shutil.which("qemu-x86_64")
    assert path, "qemu-x86_64 is needed (sh tests/install_test_deps.sh installs qemu-user)"
    return path


def zen3_cpuinfo(real: str) -> str:
    """`real` (a /proc/cpuinfo) as a Zen 3's: the same lines, the flags it lacks removed."""
    lines = []
    for line in real.splitlines(keepends=True):
        if line.startswith("flags"):
            key, flags = line.split(":", 1)
            line = key + ": " + " ".join(f for f in flags.split() if not f.startswith(_NOT_ON_ZEN3)) + "\n"
        elif line.startswith("model name"):
            line = f"model name\t: emulated {QEMU_CPU} (qemu-x86_64 -cpu {QEMU_CPU})\n"
        lines.append(line)
    return "".join(lines)


def prepare(root: str) -> dict:
    """Lay out `root` (the Zen 3's /proc/cpuinfo, the library that shows it, a cache
    folder): the environment to run the emulated process with."""
    import subprocess

    from modelkiln.artifacts.link import find_cc
    with open("/proc/cpuinfo") as f:
        real = f.read()
    with open(os.path.join(root, "cpuinfo"), "w") as f:
        f.write(zen3_cpuinfo(real))
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_cpuinfo.c")
    subprocess.run([find_cc(), "-shared", "-fPIC", "-O2", "-o", os.path.join(root, "fake_cpuinfo.so"), source,
                    "-ldl"], check=True)
    return dict(os.environ, KILN_CACHE_DIR=os.path.join(root, "cache"))


def command(root: str, args) -> list[str]:
    """The command line running this Python with `args` as on a Zen 3 (the library is
    preloaded into the guest, not into qemu)."""
    return [qemu(), "-cpu", QEMU_CPU, "-E", f"LD_PRELOAD={os.path.join(root, 'fake_cpuinfo.so')}",
            "-E", f"KILN_FAKE_CPUINFO={os.path.join(root, 'cpuinfo')}", sys.executable, *args]


QEMU_NOISE = "TCG doesn't support requested feature"  # once per cpuid bit TCG lacks (rdseed, ...)


def in_one_process(argv: list[str]) -> list[str]:
    """A pytest command run by the emulated Python itself: the test processes pytest-xdist
    starts (pyproject.toml's `-n auto`) would run natively, outside qemu."""
    if argv[:2] == ["-m", "pytest"] and not any(a.startswith("-n") for a in argv[2:]):
        return [*argv[:2], "-n", "0", *argv[2:]]
    return argv


def main(argv: list[str]) -> int:
    import subprocess
    with tempfile.TemporaryDirectory(prefix="kiln-avx2-host-") as root:
        proc = subprocess.Popen(command(root, in_one_process(argv)), env=prepare(root), stderr=subprocess.PIPE,
                                text=True)
        for line in proc.stderr:
            if QEMU_NOISE not in line:
                sys.stderr.write(line)
        return proc.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
