"""Objects + a generated entry function -> model.so, linked with the system C compiler.

The entry function `kiln_run_threads(weights, arena, inputs, outputs, threads)` runs every
kernel's phases in order with pointers into the weights blob, the arena, or the caller's
input and output arrays (kernels write the outputs where the caller wants them), each phase
on the calling thread or divided across the thread pool (thread_pool.c, linked in), then
copies in the outputs computed elsewhere (an input, a constant, a tensor two outputs name).
It is generated C so the link step needs nothing but `cc`.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import tempfile

from .cpu_features import host_arch
from .errors import KilnError
from .expressions import C_HELPERS
from .manifest import ENTRY_ABI_VERSION, TILES_REFUSED


def _pointer(loc: tuple) -> str:
    space, where = loc
    if space == "input":
        return f"inputs[{where}]"
    if space == "output":  # (written in the caller's buffer: orchestrator.bundle.output_homes)
        return f"outputs[{where}]"
    if space == "dims":
        return "(void*)dims"
    base = {"arena": "arena", "weights": "weights"}[space]
    return f"(void*)({base} + {where})"


def _guard(guard: list) -> str:
    """The C condition of a guarded call: each bool tensor (one byte) must hold its value."""
    tests = [f"*(const unsigned char*){_pointer(loc)} {'!=' if value else '=='} 0" for loc, value in guard]
    return " && ".join(tests)


THREAD_POOL_C = os.path.join(os.path.dirname(os.path.abspath(__file__)), "thread_pool.c")


@functools.lru_cache(maxsize=1)
def thread_pool_source() -> str:
    with open(THREAD_POOL_C) as f:
        return f.read()


def _calls(plan: list, kind: str = "call"):
    """Every (kind, ...) item of an entry plan, loops' bodies included."""
    for item in plan:
        if item[0] == "loop":
            yield from _calls(item[5], kind)
        elif item[0] == kind:
            yield item


def _divides(pieces) -> bool:
    """Whether a phase may run on several threads: pieces > 1, or decided at run time (C)."""
    return isinstance(pieces, str) or pieces > 1


# Pieces of a phase whose work is known at run time: `work` at the bounds scaled by
# scale / bound, one piece per MIN_PIECE_WORK of it (ir/parallel.py), at most `most`.
_RUNTIME_PIECES_C = """static long kiln_pieces(long long scale, long long bound, long long work, long most) {
  long long p = (long long)((double)work * (double)scale / (double)bound / %d.0);
  return p < 1 ? 1 : p > most ? most : (long)p;
}
"""


def _body(plan: list, timed: bool, depth: int = 1) -> list[str]:
    """C statements running an entry plan: kernel calls (guarded where they must be), and
    loops: their state set from the initial values, then per iteration the iteration number,
    the body, the state updated and each scan output's row written."""
    pad = "  " * depth
    lines = []
    for item in plan:
        if item[0] == "bind":  # (a size the call before counted: what every later extent reads)
            _, k, loc, guard, after = item
            read = f"dims[{k}] = *(const long long*){_pointer(loc)};"
            if guard:  # (a call that may not have run: kiln_ran<k>, declared first, says whether it did)
                lines += [f"{pad}kiln_ran{k} = 0;", f"{pad}if ({_guard(guard)}) {{ {read} kiln_ran{k} = 1; }}"]
            else:
                lines.append(pad + read)
            lines += [pad + a for a in after]
            continue
        if item[0] == "call":
            _, sym, args, guard, index, parts = item
            ptrs = ", ".join(_pointer(a) for a in args)
            phases = []
            for phase, (extent, pieces, grain, *condition) in enumerate(parts):
                if _divides(pieces):
                    run = f"kiln_parallel(kiln_piece, &ctx, {index}, {phase}, {extent}, {pieces}, {grain}, threads);"
                else:
                    run = f"{sym}({ptrs}{', ' if ptrs else ''}{phase}, 0, {extent});"
                phases.append(f"if ({condition[0]}) {run}" if condition else run)
            if guard:
                lines.append(f"{pad}if ({_guard(guard)}) {{")
                lines += [f"{pad}  {p}" for p in phases]
                lines.append(f"{pad}}}")
            else:
                lines += [f"{pad}{p}" for p in phases]
            if timed:  # (+=: a call in a loop adds up over its iterations)
                lines.append(f"{pad}t1 = kiln_now(); times[{index}] += t1 - t0; t0 = t1;")
            continue
        _, trip, iteration, inits, feeds, body, carries, swap, scans, guard, start_if, until, ran = item
        inner = "  " * (depth + 1)
        last = trip - 1 if isinstance(trip, int) else f"{trip} - 1"  # (scans: a trip known when the loop starts)
        row = lambda rev: f"({last} - it)" if rev else "it"  # noqa: E731
        lines.append(f"{pad}if ({_guard(guard)}) {{" if guard else f"{pad}{{")
        lines += [f"{inner}memcpy({_pointer(dst)}, {_pointer(src)}, {n});" for src, dst, n in inits]
        limit = "" if trip is None else f"*(const long long*){_pointer(trip)}" if isinstance(trip, tuple) else trip
        if ran:
            lines.append(f"{inner}long long kiln_iterations = 0;")
        runs = f"{inner}if (*(const unsigned char*){_pointer(start_if)}) " if start_if else inner
        lines.append(f"{runs}for (long long it = 0;{f' it < {limit};' if limit else ';'} ++it) {{")
        if ran:  # (one more than the scan outputs have room for: stop; the count's bounds check names it)
            lines += [f"{inner}  kiln_iterations = it + 1;", f"{inner}  if (it == {ran[1]}LL) break;"]
        if iteration:
            lines.append(f"{inner}  *(long long*){_pointer(iteration)} = it;")
        lines += [f"{inner}  memcpy({_pointer(part)}, (const char*){_pointer(whole)} + {row(rev)} * {n}, {n});"
                  for whole, part, n, rev in feeds]
        lines += _body(body, timed, depth + 2)
        # Scan rows first: a slice may be a view of a state buffer the carries overwrite.
        lines += [f"{inner}  memcpy((char*){_pointer(whole)} + {row(rev)} * {n}, {_pointer(part)}, {n});"
                  for part, whole, n, rev in scans]
        if swap:  # a body that swaps carried values: new values to scratch first, then to the state
            lines += [f"{inner}  memcpy({_pointer(tmp)}, {_pointer(src)}, {n});" for (src, _, n), tmp in zip(carries, swap)]
            lines += [f"{inner}  memcpy({_pointer(dst)}, {_pointer(tmp)}, {n});" for (_, dst, n), tmp in zip(carries, swap)]
        else:
            lines += [f"{inner}  memmove({_pointer(dst)}, {_pointer(src)}, {n});" for src, dst, n in carries]
        if until:
            lines.append(f"{inner}  if (!*(const unsigned char*){_pointer(until)}) break;")
        lines.append(f"{inner}}}")
        if ran:
            lines.append(f"{inner}*(long long*){_pointer(ran[0])} = kiln_iterations;")
        lines.append(f"{pad}}}")
    return lines


# Whether `count` buffers (start, bytes) are pairwise disjoint: the caller's inputs and outputs.
_DISJOINT_C = """static int kiln_disjoint(int count, void* const* at, const size_t* bytes) {
  for (int i = 0; i < count; ++i)
    for (int j = i + 1; j < count; ++j)
      if ((char*)at[i] < (char*)at[j] + bytes[j] && (char*)at[j] < (char*)at[i] + bytes[i]) return 0;
  return 1;
}"""


# A bundle whose kernels use AMX tiles asks Linux for the tile data state when it loads:
# without it the first tile instruction faults (SIGILL). The request is per process and
# answered for all its threads; a process that has it already (another bundle asked) is not
# asked again. Refused (a kernel without AMX support, or a seccomp filter), every call returns
# TILES_REFUSED, running nothing, and kiln_tile_status() says why (the errno).
_TILES_C = """#include <errno.h>
#include <sys/syscall.h>
#include <unistd.h>
#define KILN_ARCH_GET_XCOMP_PERM 0x1022
#define KILN_ARCH_REQ_XCOMP_PERM 0x1023
#define KILN_XFEATURE_XTILEDATA 18
static int kiln_tiles = -1;  /* 0: granted; else the errno of the refusal */
__attribute__((constructor)) static void kiln_request_tiles(void) {
  unsigned long long have = 0;
  if (syscall(SYS_arch_prctl, KILN_ARCH_GET_XCOMP_PERM, &have) == 0 && (have >> KILN_XFEATURE_XTILEDATA & 1)) {
    kiln_tiles = 0;
    return;
  }
  kiln_tiles = syscall(SYS_arch_prctl, KILN_ARCH_REQ_XCOMP_PERM, KILN_XFEATURE_XTILEDATA) == 0 ? 0 : errno;
}
int kiln_tile_status(void) { return kiln_tiles; }"""


def entry_source(plan: list, outputs: list[tuple[tuple, int]], arena_bytes: int, signature: str = "",
                 min_piece_work: int = 0, preconditions: list = (), derived: tuple = (), caches: tuple = (),
                 arena_at: list = (), tiles: bool = False) -> str:
    """plan: the steps in order:
      ("call", symbol, [location of each argument], guard, index, phases): guard is
        [(location of a bool, value)], the call runs only where each holds; index its
        position among all calls (profiling, dispatch); phases [(extent, pieces, grain)] of
        each kernel phase in order (ir.parallel.thread_plan): pieces > 1 may divide it
        across threads, in parts on multiples of grain; a guarded phase's fourth item is its
        condition (C), where false the phase does not run;
      ("loop", trip count (an int, a C expression of dims, the location of an int64 read at
        run time, or None: no limit), location of the iteration number or None, [(initial value, state, nbytes)],
        [(scanned tensor, slice, slice nbytes, reversed)], body plan, [(new value, state,
        nbytes)], scratch locations or None, [(slice, stacked output, slice nbytes,
        reversed)], guard, location of the bool it runs only if or None, location of the
        bool that stops it after an iteration where it is false or None, and (location of
        the int64 it writes the iterations it ran to, the most its scan outputs hold) or None).
    outputs: (location, nbytes); signature: the I/O signature (artifacts.manifest.io_signature)
    the library reports to the loader.

    A model with symbolic dims (min_piece_work given) has extents, pieces and nbytes that are
    C expressions of `dims`, the symbols' values: its entry is kiln_run_dims (and
    kiln_run_dims_profiled), which take them after the outputs and return the error code of
    the first of `preconditions` ((C condition, code)) that fails before running anything.
    `derived` (base count, [C expression of dims[] for each derived symbol], whether any is
    counted): symbols the entry computes from the caller's (ir/symbolic.floor_div), after
    them in dims[]. A counted one (a NonZero's count), and one computed from it, starts at its
    greatest; a ("bind", k, location of the int64 a call wrote, the call's guard, [C statements])
    item after that call sets dims[k] where the call ran, then computes and checks what waited
    for it (KILN_FAIL(code) there writes the symbols back, so the caller can name the size at
    fault, and returns an error code like the preconditions'). With any, the caller's
    dims[] has room for every symbol and the entry writes the derived ones back.
    `caches` (input count, [(input index, output index, blocks, past block bytes, capacity block bytes)]),
    sizes as C expressions: KV caches whose kernels read the past input from the present
    output's buffer, at its capacity; where the caller passed two buffers, the entry first
    copies the past's blocks there (an output at ("output", i) is written in place, not copied).
    `arena_at`: C statements setting at[0], at[1], ... in order, the arena offsets that
    depend on the call's sizes (locations ("arena", "at[i]"); orchestrator.bundle.plan_memory).
    `tiles`: some kernel uses AMX tiles (_TILES_C).
    A static model's entry is exactly what it was before symbols existed."""
    calls = list(_calls(plan))
    symbolic = bool(min_piece_work)
    writes_outputs = any(arg[0] == "output" for call in calls for arg in call[2])  # (kernels given the caller's)
    dims_param = "const long long* dims, " if symbolic else ""
    lines = ["/* Generated by Kiln: runs the model's kernels in order over a planned arena. */",
             "#include <stddef.h>", "#include <string.h>", "#include <time.h>", "",
             "typedef void (*kiln_piece_fn)(void* ctx, long call, long phase, long lo, long hi);",
             "void kiln_parallel(kiln_piece_fn fn, void* ctx, long call, long phase, long extent, long pieces, "
             "long grain, int threads);",
             "int kiln_num_threads(void);", ""]
    for sym in sorted({c[1] for c in calls}):
        n = max(len(c[2]) for c in calls if c[1] == sym)
        lines.append(f"void {sym}({', '.join(['void*'] * n + ['long long'] * 3)});")
    if symbolic:
        lines += ["", _RUNTIME_PIECES_C % min_piece_work]
    # (kiln_max: the arena's run-time offsets; kiln_div and the rest: a value symbol's expression)
    binds = [a for item in _calls(plan, "bind") for a in item[4]]
    if arena_at or derived and any("kiln_" in value for value in derived[1] + binds):
        lines += ["", *C_HELPERS]
    if any("kiln_disjoint" in cond for cond, _ in preconditions):
        lines += ["", _DISJOINT_C]
    if tiles:
        lines += ["", _TILES_C]
    if arena_at:  # (an offset: aligned as artifacts.memory_plan aligns)
        lines.append("static inline long long kiln_end(long long at, long long bytes) "
                     "{ return (at + bytes + 63) & ~63LL; }")
    lines += ["", f"size_t kiln_arena_bytes(void) {{ return {arena_bytes}u; }}",
              f"int kiln_abi_version(void) {{ return {ENTRY_ABI_VERSION}; }}",
              f"const char* kiln_signature(void) {{ return {json.dumps(signature)}; }}",
              f"int kiln_num_calls(void) {{ return {len(calls)}; }}", "",
              "static double kiln_now(void) {",
              "  struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e3 + t.tv_nsec * 1e-6;", "}",
              "", "struct kiln_ctx { char* weights; char* arena; void** inputs;"
              + " const long long* dims;" * symbolic + " void** outputs;" * writes_outputs
              + " const long long* at;" * bool(arena_at) + " };",
              "", "/* Runs [lo, hi) of one phase of a call: what a pool thread is given. */",
              "static void kiln_piece(void* c, long call, long phase, long lo, long hi) {",
              "  const struct kiln_ctx* ctx = (const struct kiln_ctx*)c;",
              "  char* weights = ctx->weights; char* arena = ctx->arena; void** inputs = ctx->inputs;"
              + (" const long long* dims = ctx->dims; (void)dims;" if symbolic else "")
              + (" void** outputs = ctx->outputs;" if writes_outputs else "")
              + (" const long long* at = ctx->at;" if arena_at else ""),
              "  (void)weights; (void)arena; (void)inputs;",
              "  switch (call) {"]
    for _, sym, args, _, index, parts in calls:
        if any(_divides(part[1]) for part in parts):
            ptrs = "".join(f"{_pointer(a)}, " for a in args)
            lines.append(f"    case {index}: {sym}({ptrs}phase, lo, hi); break;")
    lines += ["  }", "}", ""]
    # kiln_run_profiled also writes each call's wall time (ms) to times[i]: `kiln bench --profile`.
    names = (("kiln_run_dims", False), ("kiln_run_dims_profiled", True)) if symbolic else \
        (("kiln_run_threads", False), ("kiln_run_profiled", True))
    if derived:
        base, values, counted = derived
        dims_param = f"{'' if counted else 'const '}long long* given, "
        if counted:  # (a size read while the model runs failed its bounds or a check: the caller names it)
            lines += [f"#define KILN_FAIL(code) do {{ for (int k = {base}; k < {base + len(values)}; ++k) "
                      "given[k] = dims[k]; return (code); } while (0)", ""]
        compute = [f"  long long dims[{base + len(values)}];", *[f"  dims[{k}] = given[{k}];" for k in range(base)],
                   *[f"  dims[{base + j}] = {expr};" for j, expr in enumerate(values)]]
    for name, timed in names:
        extra = ", double* times" if timed else ""
        lines += [f"int {name}(char* weights, char* arena, void** inputs, void** outputs, {dims_param}"
                  f"{extra[2:] + ', ' if timed else ''}int threads) {{",
                  *(compute if derived else []),
                  *([f"  if (kiln_tiles) return {TILES_REFUSED};"] if tiles else []),
                  *[f"  if (!({cond})) return {code};" for cond, code in preconditions],
                  *_bind_caches(caches),
                  *([f"  long long at[{len(arena_at)}];"] + [f"  {a}" for a in arena_at] if arena_at else []),
                  f"  struct kiln_ctx ctx = {{weights, arena, inputs{', dims' * symbolic}"
                  f"{', outputs' * writes_outputs}{', at' * bool(arena_at)}}};",
                  "  (void)ctx;",
                  "  if (threads <= 0) threads = kiln_num_threads();"]
        if timed:
            lines += [f"  for (int i = 0; i < {len(calls)}; ++i) times[i] = 0;", "  double t0 = kiln_now(), t1;"]
        # (whether a guarded count was read: declared here, so a check after a loop sees one read in it)
        lines += [f"  int kiln_ran{k} = 0; (void)kiln_ran{k};"
                  for k in dict.fromkeys(item[1] for item in _calls(plan, "bind") if item[3])]
        lines += _body(plan, timed)
        for i, (loc, nbytes) in enumerate(outputs):
            if loc != ("output", i):
                lines.append(f"  memcpy(outputs[{i}], {_pointer(loc)}, {nbytes});")
        if derived and derived[2]:  # (the caller learns the sizes counted, and so its outputs' shapes)
            lines += [f"  for (int k = {derived[0]}; k < {derived[0] + len(derived[1])}; ++k) given[k] = dims[k];"]
        lines += ["  return 0;", "}", ""]
    if not symbolic:
        lines += ["int kiln_run(char* weights, char* arena, void** inputs, void** outputs) {",
                  "  return kiln_run_threads(weights, arena, inputs, outputs, 0);", "}", ""]
    return "\n".join(lines)


def _bind_caches(caches: tuple) -> list[str]:
    """The entry's lines pointing each KV cache's past input at its present's buffer."""
    if not caches:
        return []
    inputs, caches = caches
    lines = [f"  void* bound[{inputs}];", f"  for (int i = 0; i < {inputs}; ++i) bound[i] = inputs[i];"]
    for i, o, blocks, past_bytes, capacity_bytes in caches:
        lines += [f"  if (inputs[{i}] != outputs[{o}])  /* two buffers: the past moves into the present's */",
                  f"    for (long long b = 0; b < {blocks}; ++b)",
                  f"      memcpy((char*)outputs[{o}] + b * {capacity_bytes}, "
                  f"(const char*)inputs[{i}] + b * {past_bytes}, {past_bytes});",
                  f"  bound[{i}] = outputs[{o}];"]
    return lines + ["  inputs = bound;"]


COMPILE_FLAGS = ("-fPIC", "-O2", "-pthread")  # the thread pool: its spin loops are worth optimizing
# The entry is glue (kernel calls, size arithmetic, the pool's dispatch): built at -O0 it ran
# as fast (mlp at batch 1, 13-18 us a call either way) and compiled in half the time
# (ResNet-18's link 136 -> 71 ms, a one-kernel model's 65 -> 49; 2026-12-02, Zen 5).
ENTRY_FLAGS = ("-fPIC", "-O0", "-pipe", "-pthread")
LINK_FLAGS = ("-shared", *ENTRY_FLAGS)


@functools.lru_cache(maxsize=None)
def compiler_identity(cc: str | None = None) -> str:
    """What the link cache key needs to know about a C compiler (default: this machine's):
    its path and version."""
    cc = cc or find_cc()
    proc = subprocess.run([cc, "--version"], capture_output=True, text=True)
    return f"{cc}|{proc.stdout.splitlines()[0] if proc.stdout else ''}"


def link_key(object_keys: list[str], entry_c: str, cc: str | None = None) -> str:
    """The store key of a linked module: its objects' keys, the entry source, the linker."""
    h = hashlib.sha256(b"kiln-link-v1\0")
    for part in (*sorted(object_keys), entry_c, thread_pool_source(), compiler_identity(cc), " ".join(LINK_FLAGS)):
        h.update(part.encode() + b"\0")
    return h.hexdigest()


def find_cc() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise KilnError("no C compiler found to link the module (set CC, or install gcc)")
    return cc


def find_linker(arch: str) -> str | None:
    """The C compiler that links modules for `arch`: this machine's for its own architecture;
    for another, KILN_CC_<ARCH> or the GNU cross compiler `<arch>-linux-gnu-gcc` (Debian's
    gcc-aarch64-linux-gnu), or None where there is none (the bundle then holds the objects)."""
    if arch == host_arch():
        return find_cc()
    return os.environ.get(f"KILN_CC_{arch.upper()}") or shutil.which(f"{arch}-linux-gnu-gcc")


def _run_cc(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise KilnError(f"{what} failed ({' '.join(cmd[:4])} ...):\n{proc.stderr[-4000:]}")


_POOL_OBJECTS: dict = {}  # thread pool key -> object bytes, in this process


def thread_pool_object(cc: str, store=None) -> bytes:
    """thread_pool.c compiled by `cc`: every module links the same pool, so it is compiled once
    a process, and with a store once for every builder that shares it (the compile took half of
    a small model's link, 2026-11-27: 50 of 96 ms; 80 ms of a cold `kiln build`'s)."""
    h = hashlib.sha256(b"kiln-thread-pool-v1\0")
    for part in (thread_pool_source(), compiler_identity(cc), " ".join(COMPILE_FLAGS)):
        h.update(part.encode() + b"\0")
    key = h.hexdigest()
    stored = store.get(key) if store is not None else None
    obj = stored or _POOL_OBJECTS.get(key) or _compile_thread_pool(cc)
    if store is not None and stored is None:
        store.put(key, obj)
    _POOL_OBJECTS[key] = obj
    return obj


def _compile_thread_pool(cc: str) -> bytes:
    with tempfile.TemporaryDirectory(prefix="kiln-pool-") as tmp:
        src, obj = os.path.join(tmp, "kiln_thread_pool.c"), os.path.join(tmp, "kiln_thread_pool.o")
        with open(src, "w") as f:
            f.write(thread_pool_source())
        _run_cc([cc, "-c", *COMPILE_FLAGS, "-o", obj, src], "compiling the thread pool")
        with open(obj, "rb") as f:
            return f.read()


def link_shared(objects: dict[str, bytes], entry_c: str, out_path: str, cc: str | None = None,
                store=None) -> None:
    """Write the objects and entry source to a temp dir and link them into out_path with `cc`
    (default: this machine's C compiler); the thread pool's object comes from `store` where
    it is there."""
    cc = cc or find_cc()
    with tempfile.TemporaryDirectory(prefix="kiln-link-") as tmp:
        paths = []
        for sym in sorted(objects):
            p = os.path.join(tmp, f"{sym}.o")
            with open(p, "wb") as f:
                f.write(objects[sym])
            paths.append(p)
        entry = os.path.join(tmp, "kiln_entry.c")
        with open(entry, "w") as f:
            f.write(entry_c)
        pool = os.path.join(tmp, "kiln_thread_pool.o")
        with open(pool, "wb") as f:
            f.write(thread_pool_object(cc, store))
        tmp_out = os.path.join(tmp, "model.so")
        _run_cc([cc, *LINK_FLAGS, "-o", tmp_out, entry, pool, *paths, "-lm"], "linking the module")
        shutil.copyfile(tmp_out, out_path)
