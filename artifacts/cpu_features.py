"""CPU features a bundle's code may use, and whether this machine has them.

A bundle compiled for a CPU this machine is not (`-mcpu=sapphirerapids` on a Zen 5) may run
today and die with SIGILL tomorrow, the first time a kernel reaches an AVX512-FP16 or AMX
instruction. The manifest lists the features the code was compiled for, as Linux names
them in /proc/cpuinfo; loading compares that list with the host's and refuses.

One row per x86 feature that changes which instructions may be emitted:
(LLVM feature name, the C compiler's macro for it, the /proc/cpuinfo flag).
"""
from __future__ import annotations

import platform

X86_FEATURES = (
    ("sse3", "__SSE3__", "pni"), ("ssse3", "__SSSE3__", "ssse3"), ("sse4.1", "__SSE4_1__", "sse4_1"),
    ("sse4.2", "__SSE4_2__", "sse4_2"), ("popcnt", "__POPCNT__", "popcnt"), ("avx", "__AVX__", "avx"),
    ("avx2", "__AVX2__", "avx2"), ("fma", "__FMA__", "fma"), ("f16c", "__F16C__", "f16c"),
    ("bmi", "__BMI__", "bmi1"), ("bmi2", "__BMI2__", "bmi2"), ("lzcnt", "__LZCNT__", "abm"),
    ("movbe", "__MOVBE__", "movbe"), ("avx512f", "__AVX512F__", "avx512f"), ("avx512cd", "__AVX512CD__", "avx512cd"),
    ("avx512bw", "__AVX512BW__", "avx512bw"), ("avx512dq", "__AVX512DQ__", "avx512dq"),
    ("avx512vl", "__AVX512VL__", "avx512vl"), ("avx512ifma", "__AVX512IFMA__", "avx512ifma"),
    ("avx512vbmi", "__AVX512VBMI__", "avx512vbmi"), ("avx512vbmi2", "__AVX512VBMI2__", "avx512_vbmi2"),
    ("avx512vnni", "__AVX512VNNI__", "avx512_vnni"), ("avx512bitalg", "__AVX512BITALG__", "avx512_bitalg"),
    ("avx512vpopcntdq", "__AVX512VPOPCNTDQ__", "avx512_vpopcntdq"), ("avx512bf16", "__AVX512BF16__", "avx512_bf16"),
    ("avx512fp16", "__AVX512FP16__", "avx512_fp16"), ("avxvnni", "__AVXVNNI__", "avx_vnni"),
    ("amx-tile", "__AMX_TILE__", "amx_tile"), ("amx-bf16", "__AMX_BF16__", "amx_bf16"),
    ("amx-int8", "__AMX_INT8__", "amx_int8"), ("gfni", "__GFNI__", "gfni"), ("vaes", "__VAES__", "vaes"),
    ("vpclmulqdq", "__VPCLMULQDQ__", "vpclmulqdq"),
)
FLAG_OF_LLVM = {llvm: flag for llvm, _, flag in X86_FEATURES}
FLAG_OF_MACRO = {macro: flag for _, macro, flag in X86_FEATURES}


def enabled(llvm_features: str) -> set[str]:
    """The features an LLVM feature string turns on, a later entry overriding an earlier one
    (the host's features, then the target's -mattr)."""
    on: set[str] = set()
    for f in llvm_features.split(","):
        if f[:1] == "+":
            on.add(f[1:])
        elif f[:1] == "-":
            on.discard(f[1:])
    return on


def byte_dot_widths(llvm_features: str) -> set[int]:
    """The float32-lane widths (16: zmm, 8: ymm) at which a target's LLVM features give
    vpdpbusd, four u8 x s8 products summed per i32 lane: AVX-512 VNNI (ymm too with VL),
    or AVX-VNNI (ymm, VEX-encoded: Alder Lake, Zen 5)."""
    on = enabled(llvm_features)
    widths = set()
    if "avx512vnni" in on:
        widths.add(16)
        if "avx512vl" in on:
            widths.add(8)
    if "avxvnni" in on:
        widths.add(8)
    return widths


def has_int8_tiles(llvm_features: str) -> bool:
    """Whether a target's LLVM features give AMX's int8 tile products (AMX-TILE and
    AMX-INT8: Intel Sapphire Rapids and later)."""
    return {"amx-tile", "amx-int8"} <= enabled(llvm_features)


def has_bf16_tiles(llvm_features: str) -> bool:
    """Whether a target's LLVM features give AMX's bfloat16 tile products (AMX-TILE, AMX-BF16)."""
    return {"amx-tile", "amx-bf16"} <= enabled(llvm_features)


ARCH_OF_MACHINE = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}


def host_arch() -> str:
    """This machine's architecture as target triples name it (x86_64, aarch64)."""
    machine = platform.machine().lower()
    return ARCH_OF_MACHINE.get(machine, machine)


def host_flags() -> set[str] | None:
    """The host's CPU flags, or None where they cannot be read (not Linux on x86)."""
    if host_arch() != "x86_64":
        return None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def missing_on_host(required) -> list[str]:
    """The required flags this machine lacks (none where the host cannot be read)."""
    have = host_flags()
    return [] if have is None else sorted(set(required) - have)
