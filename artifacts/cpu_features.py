"""CPU features a bundle's code may use, and whether this machine has them.

A bundle compiled for a CPU this machine is not (`-mcpu=sapphirerapids` on a Zen 5) may run
today and die with SIGILL tomorrow, the first time a kernel reaches an AVX512-FP16 or AMX
instruction. The manifest lists the features the code was compiled for, as Linux names
them in /proc/cpuinfo; loading compares that list with the host's and refuses.

Every x86 feature LLVM 22 enables for a CPU it knows (orchestrator/x86_cpus.py) or reports
for a host is in one of four classes here:
- X86_FEATURES, checked on the host: the instruction sets LLVM selects from ordinary IR
  (vector ISAs, bit manipulation, the base set) and the AMX extensions of today's Xeons
  (TILE, INT8, BF16, FP16), each with its /proc/cpuinfo flag (and the C compiler's macro for
  it, where GCC has one);
- NOT_EMITTED, not checked: instructions LLVM emits only for explicit intrinsics or inline
  assembly, which Kiln's kernels never call (system, security, crypto and cache-control
  instructions, and SSE4A, which LLVM selects only for its intrinsics and non-temporal scalar
  stores); hypervisors often hide them (SGX, Key Locker), so checking them would refuse
  bundles on hosts that run them fine;
- UMBRELLAS, checked through the features they imply (AVX10.1 is a name for AVX-512's set);
- everything else (APX, AVX10.2, the AVX-VNNI-INT8 family): LLVM may emit them, and Kiln
  knows no /proc/cpuinfo flag to check them by, so targets turn them off
  (orchestrator/target.py) and a target asking for one by name is refused.
"""
from __future__ import annotations

import functools
import platform

# (LLVM feature name, the C compiler's macro for it or None, the /proc/cpuinfo flag)
X86_FEATURES = (
    ("x87", None, "fpu"), ("cx8", None, "cx8"), ("cmov", None, "cmov"), ("mmx", "__MMX__", "mmx"),
    ("fxsr", "__FXSR__", "fxsr"), ("sse", "__SSE__", "sse"), ("sse2", "__SSE2__", "sse2"),
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
    ("avx512fp16", "__AVX512FP16__", "avx512_fp16"), ("avx512vp2intersect", "__AVX512VP2INTERSECT__",
                                                     "avx512_vp2intersect"),
    ("avxvnni", "__AVXVNNI__", "avx_vnni"), ("amx-tile", "__AMX_TILE__", "amx_tile"),
    ("amx-bf16", "__AMX_BF16__", "amx_bf16"), ("amx-int8", "__AMX_INT8__", "amx_int8"),
    ("amx-fp16", "__AMX_FP16__", "amx_fp16"), ("gfni", "__GFNI__", "gfni"), ("vaes", "__VAES__", "vaes"),
    ("vpclmulqdq", "__VPCLMULQDQ__", "vpclmulqdq"), ("xop", "__XOP__", "xop"),
    ("fma4", "__FMA4__", "fma4"), ("tbm", "__TBM__", "tbm"),
)
FLAG_OF_LLVM = {llvm: flag for llvm, _, flag in X86_FEATURES}
FLAG_OF_MACRO = {macro: flag for _, macro, flag in X86_FEATURES if macro}

NOT_EMITTED = frozenset((
    "64bit", "adx", "aes", "amx-avx512", "amx-complex", "amx-fp8", "amx-movrs", "amx-tf32", "cldemote",
    "clflushopt", "clwb", "clzero", "cmpccxadd", "crc32", "cx16", "enqcmd", "fsgsbase", "hreset", "invpcid", "kl",
    "lwp", "movdir64b", "movdiri", "movrs", "mwaitx", "pclmul", "pconfig", "pku", "prefetchi", "prfchw", "ptwrite",
    "raoint", "rdpid", "rdpru", "rdrnd", "rdseed", "rtm", "sahf", "serialize", "sgx", "sha", "sha512", "shstk",
    "sm3", "sm4", "sse4a", "tsxldtrk", "uintr", "usermsr", "waitpkg", "wbnoinvd", "widekl", "xsave", "xsavec",
    "xsaveopt", "xsaves",
))

# What a feature turns on with it (LLVM's implications, for the features the classes above
# name): enabling one enables these, disabling one disables every feature that implies it.
IMPLIES = {
    "sse2": ("sse",), "sse3": ("sse2",), "ssse3": ("sse3",), "sse4.1": ("ssse3",), "sse4.2": ("sse4.1",),
    "avx": ("sse4.2",), "avx2": ("avx",), "f16c": ("avx",), "fma": ("avx",), "avx512f": ("avx2", "f16c", "fma"),
    **{f: ("avx512f",) for f in ("avx512cd", "avx512dq", "avx512vl", "avx512ifma", "avx512vnni", "avx512vpopcntdq",
                                 "avx512vp2intersect", "avx512bw")},
    **{f: ("avx512bw",) for f in ("avx512bf16", "avx512bitalg", "avx512vbmi", "avx512vbmi2", "avx512fp16")},
    "aes": ("sse2",), "pclmul": ("sse2",), "gfni": ("sse2",), "sha": ("sse2",), "vaes": ("aes", "avx2"),
    "vpclmulqdq": ("avx", "pclmul"), "sse4a": ("sse3",), "fma4": ("avx", "sse4a"), "xop": ("fma4",),
    **{f: ("amx-tile",) for f in ("amx-bf16", "amx-int8", "amx-fp16", "amx-complex", "amx-fp8", "amx-movrs",
                                  "amx-tf32")},
    "amx-avx512": ("amx-tile", "avx10.2"),
    **{f: ("avx2",) for f in ("avxvnni", "avxvnniint8", "avxvnniint16", "avxifma", "avxneconvert", "sha512", "sm4")},
    "sm3": ("avx",), "xsavec": ("xsave",), "xsaveopt": ("xsave",), "xsaves": ("xsave",), "widekl": ("kl",),
    "avx10.1": ("avx512cd", "avx512vbmi", "avx512ifma", "avx512vnni", "avx512bf16", "avx512vpopcntdq", "avx512vbmi2",
                "avx512bitalg", "avx512fp16", "avx512dq", "avx512vl"),
    "avx10.2": ("avx10.1",),
}
# Names for sets of features, checked through what they imply.
UMBRELLAS = frozenset(("avx10.1", "evex512"))


@functools.lru_cache(maxsize=None)
def _implied(feature: str) -> frozenset:
    out, todo = set(), [feature]
    while todo:
        f = todo.pop()
        if f not in out:
            out.add(f)
            todo.extend(IMPLIES.get(f, ()))
    return frozenset(out)


def closure(features) -> set[str]:
    """The features and everything they imply."""
    return set().union(*(_implied(f) for f in features))


@functools.lru_cache(maxsize=64)
def enabled(llvm_features: str) -> frozenset:
    """The features an LLVM feature string turns on, a later entry overriding an earlier one
    (the host's or the CPU's features, then the target's -mattr): "+f" turns on f and what it
    implies, "-f" turns off f and every feature that implies it, as LLVM reads the string."""
    on: set[str] = set()
    for f in llvm_features.split(","):
        if f[:1] == "+":
            on |= _implied(f[1:])
        elif f[:1] == "-":
            on = {g for g in on if f[1:] not in _implied(g)}
    return frozenset(on)


def checkable(feature: str) -> bool:
    """Whether Kiln can let a target use `feature`: checked on hosts, never emitted, or a name for others."""
    return feature in FLAG_OF_LLVM or feature in NOT_EMITTED or feature in UMBRELLAS


def host_flags_required(llvm_features: str) -> list[str]:
    """The /proc/cpuinfo flags a host must have to run code compiled with these features."""
    return sorted({FLAG_OF_LLVM[f] for f in enabled(llvm_features) if f in FLAG_OF_LLVM})


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


def has_f16_conversions(triple: str, llvm_features: str) -> bool:
    """Whether the target converts float16 to and from float32 in one instruction: F16C on
    x86 (every AVX2 CPU), always on aarch64."""
    return triple.startswith("aarch64") or "f16c" in enabled(llvm_features)


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
