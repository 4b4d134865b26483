"""The features each x86-64 CPU name implies, for every CPU LLVM 22 knows (`-mcpu=NAME`).

LLVM compiles for a named CPU with that CPU's features whatever the target's feature string
says, but Kiln's own choices (VNNI or AMX kernels, vector width, the host check on loading)
read the features: a target named by its CPU alone must carry them (orchestrator/target.py).
llvmlite has no call for a CPU's features, so they are here, grouped as LLVM's own table
groups them (llvm/lib/TargetParser/X86TargetParser.cpp, LLVM 22), each generation what the
one before it had plus what it added. tests/test_x86_cpus.py holds the table to the list of
CPUs LLVM prints and, where the C compiler knows a CPU, to the features it says `-march=`
implies.
"""
from __future__ import annotations

from ..artifacts.cpu_features import closure


def _f(names: str) -> frozenset:
    return frozenset(names.split())


# Every x86-64 CPU has these (x86-64 requires SSE2).
_BASE = _f("x87 cx8 cmov mmx fxsr sse sse2")
_X86_64_V2 = _BASE | _f("sahf popcnt crc32 sse4.2 cx16")
_X86_64_V3 = _X86_64_V2 | _f("avx2 bmi bmi2 f16c fma lzcnt movbe xsave")
_X86_64_V4 = _X86_64_V3 | _f("avx512bw avx512cd avx512dq avx512vl")

# Intel cores
_NOCONA = _BASE | _f("sse3 cx16")
_CORE2 = _NOCONA | _f("sahf ssse3")
_PENRYN = _CORE2 | _f("sse4.1")
_NEHALEM = _PENRYN | _f("popcnt crc32 sse4.2")
_WESTMERE = _NEHALEM | _f("pclmul")
_SANDYBRIDGE = _WESTMERE | _f("avx xsave xsaveopt")
_IVYBRIDGE = _SANDYBRIDGE | _f("f16c fsgsbase rdrnd")
_HASWELL = _IVYBRIDGE | _f("avx2 bmi bmi2 fma invpcid lzcnt movbe")
_BROADWELL = _HASWELL | _f("adx prfchw rdseed")
_KNL = _BROADWELL | _f("aes avx512f avx512cd")
_KNM = _KNL | _f("avx512vpopcntdq")
_SKYLAKE = _BROADWELL | _f("aes clflushopt xsavec xsaves sgx")
_SKYLAKE_SERVER = (_SKYLAKE - {"sgx"}) | _f("avx512f avx512cd avx512dq avx512bw avx512vl clwb pku")
_CASCADELAKE = _SKYLAKE_SERVER | _f("avx512vnni")
_COOPERLAKE = _CASCADELAKE | _f("avx512bf16")
_CANNONLAKE = _SKYLAKE | _f("avx512f avx512cd avx512dq avx512bw avx512vl avx512ifma avx512vbmi pku sha")
_ICELAKE_CLIENT = _CANNONLAKE | _f("avx512bitalg avx512vbmi2 avx512vnni avx512vpopcntdq gfni rdpid vaes vpclmulqdq")
_ROCKETLAKE = _ICELAKE_CLIENT - {"sgx"}
_ICELAKE_SERVER = _ICELAKE_CLIENT | _f("clwb pconfig wbnoinvd")
_TIGERLAKE = _ICELAKE_CLIENT | _f("avx512vp2intersect movdir64b clwb movdiri shstk kl widekl")
_SAPPHIRERAPIDS = _ICELAKE_SERVER | _f("amx-bf16 amx-int8 amx-tile avx512bf16 avx512fp16 avxvnni cldemote enqcmd "
                                       "movdir64b movdiri ptwrite serialize shstk tsxldtrk uintr waitpkg")
_GRANITERAPIDS = _SAPPHIRERAPIDS | _f("amx-fp16 prefetchi")
_DIAMONDRAPIDS = _GRANITERAPIDS | _f("amx-complex avx10.2 cmpccxadd avxifma avxneconvert avxvnniint8 avxvnniint16 "
                                     "sha512 sm3 sm4 egpr zu ccmp push2pop2 ppx ndd nf movrs amx-movrs amx-avx512 "
                                     "amx-fp8 amx-tf32")
# Intel Atom cores, and the hybrid clients built with them
_BONNELL = _CORE2 | _f("movbe")
_SILVERMONT = _BONNELL | _WESTMERE | _f("prfchw rdrnd")
_GOLDMONT = _SILVERMONT | _f("aes clflushopt fsgsbase rdseed sha xsave xsavec xsaveopt xsaves")
_GOLDMONT_PLUS = _GOLDMONT | _f("ptwrite rdpid sgx")
_TREMONT = _GOLDMONT_PLUS | _f("clwb gfni")
_ALDERLAKE = _TREMONT | _f("adx bmi bmi2 f16c fma invpcid lzcnt pconfig pku serialize shstk vaes vpclmulqdq "
                           "movdir64b movdiri waitpkg avxvnni hreset widekl")
_ARROWLAKE = _ALDERLAKE | _f("cmpccxadd avxifma uintr enqcmd avxneconvert avxvnniint8")
_SIERRAFOREST = _ARROWLAKE | _f("cldemote")
_ARROWLAKE_S = _ARROWLAKE | _f("avxvnniint16 sha512 sm3 sm4")
_PANTHERLAKE = _ARROWLAKE_S - {"widekl"}
_NOVALAKE = _PANTHERLAKE | _f("prefetchi avx10.2 movrs egpr zu ccmp push2pop2 ppx ndd nf")
_CLEARWATERFOREST = (_SIERRAFOREST - {"widekl"}) | _f("avxvnniint16 sha512 sm3 sm4 prefetchi usermsr")
# AMD
_K8 = _BASE | _f("prfchw")
_K8_SSE3 = _K8 | _f("sse3")
_AMDFAM10 = _K8_SSE3 | _f("cx16 lzcnt popcnt sahf sse4a")
_BTVER1 = _BASE | _f("cx16 lzcnt popcnt prfchw sse3 ssse3 sse4a sahf")
_BTVER2 = _BTVER1 | _f("aes avx bmi crc32 f16c movbe pclmul xsave xsaveopt")
_BDVER1 = _BASE | _f("aes avx cx16 crc32 fma4 lwp lzcnt pclmul popcnt prfchw sahf sse3 ssse3 sse4.1 sse4.2 sse4a "
                     "xop xsave")
_BDVER2 = _BDVER1 | _f("bmi fma f16c tbm")
_BDVER3 = _BDVER2 | _f("fsgsbase xsaveopt")
_BDVER4 = _BDVER3 | _f("avx2 bmi2 movbe mwaitx rdrnd")
_ZNVER1 = _BASE | _f("adx aes avx avx2 bmi bmi2 clflushopt clzero cx16 crc32 f16c fma fsgsbase lzcnt movbe mwaitx "
                     "pclmul popcnt prfchw rdrnd rdseed sahf sha sse3 ssse3 sse4.1 sse4.2 sse4a xsave xsavec "
                     "xsaveopt xsaves")
_ZNVER2 = _ZNVER1 | _f("clwb rdpid rdpru wbnoinvd")
_ZNVER3 = _ZNVER2 | _f("invpcid pku vaes vpclmulqdq")
_ZNVER4 = _ZNVER3 | _f("avx512f avx512cd avx512dq avx512bw avx512vl avx512ifma avx512vbmi avx512vbmi2 avx512vnni "
                       "avx512bitalg avx512vpopcntdq avx512bf16 gfni shstk")
_ZNVER5 = _ZNVER4 | _f("avxvnni movdiri movdir64b avx512vp2intersect prefetchi")

_CPUS = {
    "generic": _BASE, "x86-64": _BASE, "x86-64-v2": _X86_64_V2, "x86-64-v3": _X86_64_V3, "x86-64-v4": _X86_64_V4,
    "nocona": _NOCONA, "core2": _CORE2, "core_2_duo_ssse3": _CORE2, "penryn": _PENRYN, "core_2_duo_sse4_1": _PENRYN,
    "bonnell": _BONNELL, "atom": _BONNELL, "silvermont": _SILVERMONT, "slm": _SILVERMONT,
    "atom_sse4_2": _NEHALEM, "atom_sse4_2_movbe": _GOLDMONT, "goldmont": _GOLDMONT, "goldmont-plus": _GOLDMONT_PLUS,
    "goldmont_plus": _GOLDMONT_PLUS, "tremont": _TREMONT,
    "nehalem": _NEHALEM, "corei7": _NEHALEM, "core_i7_sse4_2": _NEHALEM, "core_aes_pclmulqdq": _NEHALEM,
    "westmere": _WESTMERE, "sandybridge": _SANDYBRIDGE, "corei7-avx": _SANDYBRIDGE, "core_2nd_gen_avx": _SANDYBRIDGE,
    "ivybridge": _IVYBRIDGE, "core-avx-i": _IVYBRIDGE, "core_3rd_gen_avx": _IVYBRIDGE,
    "haswell": _HASWELL, "core-avx2": _HASWELL, "core_4th_gen_avx": _HASWELL, "core_4th_gen_avx_tsx": _HASWELL,
    "broadwell": _BROADWELL, "core_5th_gen_avx": _BROADWELL, "core_5th_gen_avx_tsx": _BROADWELL,
    "skylake": _SKYLAKE, "skylake-avx512": _SKYLAKE_SERVER, "skx": _SKYLAKE_SERVER, "skylake_avx512": _SKYLAKE_SERVER,
    "cascadelake": _CASCADELAKE, "cooperlake": _COOPERLAKE, "cannonlake": _CANNONLAKE,
    "icelake-client": _ICELAKE_CLIENT, "icelake_client": _ICELAKE_CLIENT, "rocketlake": _ROCKETLAKE,
    "icelake-server": _ICELAKE_SERVER, "icelake_server": _ICELAKE_SERVER, "tigerlake": _TIGERLAKE,
    "sapphirerapids": _SAPPHIRERAPIDS, "emeraldrapids": _SAPPHIRERAPIDS, "graniterapids": _GRANITERAPIDS,
    "graniterapids-d": _GRANITERAPIDS | {"amx-complex"}, "graniterapids_d": _GRANITERAPIDS | {"amx-complex"},
    "diamondrapids": _DIAMONDRAPIDS,
    "alderlake": _ALDERLAKE, "raptorlake": _ALDERLAKE, "meteorlake": _ALDERLAKE, "gracemont": _ALDERLAKE,
    "arrowlake": _ARROWLAKE, "arrowlake-s": _ARROWLAKE_S, "arrowlake_s": _ARROWLAKE_S, "lunarlake": _ARROWLAKE_S,
    "pantherlake": _PANTHERLAKE, "wildcatlake": _PANTHERLAKE, "novalake": _NOVALAKE,
    "sierraforest": _SIERRAFOREST, "grandridge": _SIERRAFOREST, "clearwaterforest": _CLEARWATERFOREST,
    "knl": _KNL, "mic_avx512": _KNL, "knm": _KNM,
    "k8": _K8, "athlon64": _K8, "athlon-fx": _K8, "opteron": _K8, "k8-sse3": _K8_SSE3, "athlon64-sse3": _K8_SSE3,
    "opteron-sse3": _K8_SSE3, "amdfam10": _AMDFAM10, "barcelona": _AMDFAM10, "btver1": _BTVER1, "btver2": _BTVER2,
    "bdver1": _BDVER1, "bdver2": _BDVER2, "bdver3": _BDVER3, "bdver4": _BDVER4,
    "znver1": _ZNVER1, "znver2": _ZNVER2, "znver3": _ZNVER3, "znver4": _ZNVER4, "znver5": _ZNVER5,
}

# CPUs LLVM knows that cannot run 64-bit code.
THIRTY_TWO_BIT_ONLY = frozenset((
    "i386", "i486", "i586", "i686", "pentium", "pentium-mmx", "pentium_mmx", "pentiumpro", "pentium_pro", "pentium2",
    "pentium_ii", "pentium3", "pentium3m", "pentium_iii", "pentium_iii_no_xmm_regs", "pentium-m", "pentium_m",
    "pentium4", "pentium4m", "pentium_4", "pentium_4_sse3", "prescott", "yonah", "c3", "c3-2", "winchip-c6",
    "winchip2", "k6", "k6-2", "k6-3", "athlon", "athlon-tbird", "athlon-xp", "athlon-mp", "athlon-4", "geode",
    "lakemont",
))


def cpu_names() -> list[str]:
    return sorted(_CPUS)


def cpu_features(cpu: str) -> frozenset | None:
    """The LLVM features of x86-64 CPU `cpu`, with what they imply; None for a name this table
    does not hold (see THIRTY_TWO_BIT_ONLY for the ones LLVM knows that are not 64-bit)."""
    features = _CPUS.get(cpu)
    return None if features is None else frozenset(closure(features))
