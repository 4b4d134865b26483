"""Targets: TVM-style strings (`llvm -mcpu=cascadelake -mattr=+avx512f`) and named presets.

A Target is plain data (triple, cpu, features, LLVM options) that crosses into codegen
workers as JSON. Resolving "llvm" to the host asks llvmlite for the host CPU; that sets
no LLVM option, so it is safe in the driver process.
"""
from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass

from ..artifacts.cpu_features import FLAG_OF_LLVM, UMBRELLAS, checkable, enabled, host_arch, host_flags_required
from ..configs import load_preset, preset_names
from ..ir.errors import KilnError
from .x86_cpus import THIRTY_TWO_BIT_ONLY, cpu_features


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
        on = enabled(self.features)
        return 16 if "avx512f" in on else 8 if "avx2" in on else 4

    @property
    def runnable(self) -> bool:
        """Can a module for this target run on this machine (its architecture)?"""
        return host_arch() == self.arch

    def cpu_flags(self) -> list[str]:
        """The CPU features (as /proc/cpuinfo names them) a host needs to run code for this
        target: every checked feature its feature string turns on (a named CPU's are in it:
        parse_target)."""
        return host_flags_required(self.features) if self.arch == "x86_64" else []

    def feature_summary(self) -> str:
        """What `kiln targets` and `kiln explain` say of the features: the checked ones the
        code may use, and those turned off because no host can be checked for them."""
        if self.arch != "x86_64":
            return f"features: {self.features or 'those of ' + self.cpu}"
        used = sorted(f for f in enabled(self.features) if f in FLAG_OF_LLVM)
        # (what the CPU, or the host's list, would have turned on)
        wanted = {f[1:] for f in self.features.split(",") if f[:1] == "+"} | (cpu_features(self.cpu) or set())
        off = sorted(f for f in wanted if not checkable(f))
        return f"features: {' '.join(used)}" + (f"; off (no host can be checked for them): {' '.join(off)}"
                                                 if off else "")

    def to_dict(self) -> dict:
        return {**asdict(self), "llvm_options": list(self.llvm_options)}

    def describe(self) -> str:
        opts = " ".join(f"-cl-opt={o}" for o in self.llvm_options)
        return f"{self.name}: {self.triple} cpu={self.cpu} ({self.vector_width} lanes) {opts}".strip()


def _x86_features(spec: str, cpu: str | None, base: str, attrs: list[str]) -> str:
    """The feature string of an x86-64 target: `base` (the host's), or else the features CPU
    `cpu` implies (x86_cpus.py), then the -mattr entries; features Kiln cannot check a host
    for are turned off (artifacts/cpu_features.py), and asking for one is refused by name."""
    for a in attrs:
        if a[:1] == "+" and not checkable(a[1:]):
            raise KilnError(f"target '{spec}': feature '{a[1:]}' is not one Kiln can check a host for (it knows no "
                            "/proc/cpuinfo flag for it), so it does not build code that may use it")
    implied: frozenset = frozenset()
    if cpu is not None:
        if cpu in THIRTY_TWO_BIT_ONLY:
            raise KilnError(f"target '{spec}': CPU '{cpu}' cannot run 64-bit code")
        implied = cpu_features(cpu)
        if implied is None:
            raise KilnError(f"target '{spec}': unknown x86-64 CPU '{cpu}' (LLVM's names: x86-64-v3, skylake-avx512, "
                            "icelake-server, sapphirerapids, znver4, ...; see orchestrator/x86_cpus.py)")
        base = ",".join(f"+{f}" for f in sorted(implied) if f in FLAG_OF_LLVM or f in UMBRELLAS)
    features = ",".join(p for p in (base, *attrs) if p)
    # (what LLVM itself enables for the CPU name, and what the string turns on)
    off = sorted(f for f in implied | enabled(features) if not checkable(f))
    return ",".join(p for p in (features, *(f"-{f}" for f in off)) if p)


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
    for a in attrs:
        if a[:1] not in "+-":
            raise KilnError(f"target '{spec}': -mattr entries start with + or -, got '{a}'")
    host_triple, host_cpu, host_features = _host()
    if triple is None and cpu is None:
        triple, cpu, features = host_triple, host_cpu, ",".join([host_features] + attrs if host_features else attrs)
        if triple.split("-")[0] == "x86_64":
            features = _x86_features(spec, None, host_features, attrs)
    else:
        triple = triple or host_triple
        features = ",".join(attrs)
        if triple.split("-")[0] == "x86_64":
            features = _x86_features(spec, cpu or "generic", "", attrs)
        cpu = cpu or "generic"
    return Target(name if preset is not None else ("host" if len(words) == 1 else spec), triple, cpu, features,
                  tuple(options))
