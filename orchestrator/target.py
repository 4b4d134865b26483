"""Targets: TVM-style strings (`llvm -mcpu=cascadelake -mattr=+avx512f`) and named presets.

A Target is plain data (triple, cpu, features, LLVM options) that crosses into codegen
workers as JSON. Resolving "llvm" to the host asks llvmlite for the host CPU; that sets
no LLVM option, so it is safe in the driver process.
"""
from __future__ import annotations

import functools
import shlex
import subprocess
from dataclasses import asdict, dataclass

from ..artifacts.cpu_features import FLAG_OF_LLVM, FLAG_OF_MACRO, host_arch
from ..configs import load_preset, preset_names
from ..ir.errors import KilnError

# CPUs whose vectors are 512 bits wide (LLVM CPU names), and those with 256-bit AVX2.
_AVX512_CPUS = {"skylake-avx512", "cascadelake", "cooperlake", "icelake-client", "icelake-server", "tigerlake",
                "sapphirerapids", "emeraldrapids", "graniterapids", "znver4", "znver5", "x86-64-v4", "rocketlake"}
_AVX2_CPUS = {"haswell", "broadwell", "skylake", "alderlake", "raptorlake", "znver1", "znver2", "znver3",
              "x86-64-v3", "cannonlake"}


@dataclass(frozen=True)
class Target:
    name: str
    triple: str
    cpu: str
    features: str
    llvm_options: tuple = ()

    @property
    def arch(self) -> str:
        return self.triple.split("-")[0]

    @property
    def vector_width(self) -> int:
        """float32 lanes the GEMM micro-kernel and vectorized loops are shaped for."""
        if self.arch != "x86_64":
            return 4
        feats = set(self.features.split(","))
        if "-avx512f" in feats:
            return 8 if "+avx2" in feats or self.cpu in _AVX2_CPUS | _AVX512_CPUS else 4
        if "+avx512f" in feats or self.cpu in _AVX512_CPUS:
            return 16
        if "+avx2" in feats or self.cpu in _AVX2_CPUS:
            return 8
        return 4

    @property
    def runnable(self) -> bool:
        """Can a module for this target run on this machine (its architecture)?"""
        return host_arch() == self.arch

    def cpu_flags(self) -> list[str]:
        """The CPU features (as /proc/cpuinfo names them) that code for this target may use:
        its explicit +features, and for a named CPU what the C compiler says `-march=CPU`
        implies (a CPU name the compiler does not know contributes its explicit ones only)."""
        if self.arch != "x86_64":
            return []
        flags = {FLAG_OF_LLVM[f[1:]] for f in self.features.split(",") if f[:1] == "+" and f[1:] in FLAG_OF_LLVM}
        off = {FLAG_OF_LLVM[f[1:]] for f in self.features.split(",") if f[:1] == "-" and f[1:] in FLAG_OF_LLVM}
        if self.cpu and self.cpu not in ("generic", "x86-64"):
            flags |= _implied_by_cpu(self.cpu)
        return sorted(flags - off)

    def to_dict(self) -> dict:
        return {**asdict(self), "llvm_options": list(self.llvm_options)}

    def describe(self) -> str:
        opts = " ".join(f"-cl-opt={o}" for o in self.llvm_options)
        return f"{self.name}: {self.triple} cpu={self.cpu} ({self.vector_width} lanes) {opts}".strip()


@functools.lru_cache(maxsize=None)
def _implied_by_cpu(cpu: str) -> frozenset:
    from ..artifacts.link import find_cc
    try:
        proc = subprocess.run([find_cc(), f"-march={cpu}", "-dM", "-E", "-x", "c", "-"], input="",
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired, KilnError):
        return frozenset()
    macros = {line.split()[1] for line in proc.stdout.splitlines() if line.startswith("#define ")}
    return frozenset(flag for macro, flag in FLAG_OF_MACRO.items() if macro in macros)


def _host():
    from .toolchain import host_toolchain
    t = host_toolchain()
    return t["triple"], t["cpu"], t["features"]


def parse_target(spec: "str | Target") -> Target:
    """'llvm', 'host', a preset name from configs/, or 'llvm -mtriple=.. -mcpu=.. -mattr=.. -cl-opt=..'."""
    if isinstance(spec, Target):
        return spec
    spec = (spec or "llvm").strip()
    preset = load_preset(spec) if " " not in spec else None
    name, options = spec, []
    if preset is not None:
        name, options = preset["name"], list(preset.get("llvm_options", []))
        spec = preset["target"]
    words = shlex.split(spec)
    if not words or words[0] not in ("llvm", "host"):
        raise KilnError(f"unknown target '{spec}': use 'llvm [-mcpu=..] [-mattr=..] [-mtriple=..]' "
                        f"or a preset ({', '.join(preset_names())})")
    triple = cpu = None
    attrs: list[str] = []
    for w in words[1:]:
        key, _, value = w.partition("=")
        if key == "-mtriple":
            triple = value
        elif key == "-mcpu":
            cpu = value
        elif key == "-mattr":
            attrs += [a for a in value.split(",") if a]
        elif key == "-cl-opt":
            options.append(value)
        else:
            raise KilnError(f"target '{spec}': unknown flag '{w}' (known: -mtriple, -mcpu, -mattr, -cl-opt)")
    host_triple, host_cpu, host_features = _host()
    if triple is None and cpu is None:
        triple, cpu, features = host_triple, host_cpu, ",".join([host_features] + attrs if host_features else attrs)
    else:
        triple = triple or host_triple
        cpu = cpu or "generic"
        features = ",".join(attrs)
    for a in attrs:
        if a[:1] not in "+-":
            raise KilnError(f"target '{spec}': -mattr entries start with + or -, got '{a}'")
    return Target(name if preset is not None else ("host" if len(words) == 1 else spec), triple, cpu, features,
                  tuple(options))
