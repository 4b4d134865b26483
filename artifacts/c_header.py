"""kiln_model.h: what a C program needs to run a bundle without Python.

Every bundle ships it beside model.so. It declares the library's entry points and describes
this model (inputs and outputs: names, dtypes, shapes, sizes; the weights file and its size;
the arena size; the entry ABI it was built for), plus two small helpers that load the weights
into 64-byte-aligned memory and allocate the arena. docs/example_run.c is a complete program;
tests/test_c_api.py compiles it with `cc` and checks its outputs against onnxruntime's.
"""
from __future__ import annotations

import json
import math

from .manifest import ENTRY_ABI_VERSION, Manifest, dim_c, dim_greatest, dim_text, dim_value, is_counted, late_names

HEADER = "kiln_model.h"
# (int4, uint4, int2, uint2 and the 8- and 4-bit floats: one to a byte, a 4-bit value in its low bits)
_BYTE_CODED = ("int4", "uint4", "int2", "uint2", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
               "float4_e2m1fn", "float8_e8m0fnu")
_C_TYPES = {"float32": "float", "float64": "double", "float16": "uint16_t", "bfloat16": "uint16_t", "bool": "uint8_t",
            **{t: "uint8_t" for t in _BYTE_CODED},
            **{f"int{w}": f"int{w}_t" for w in (8, 16, 32, 64)}, **{f"uint{w}": f"uint{w}_t" for w in (8, 16, 32, 64)}}
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "bool": 1, "float32": 4, "float64": 8, **{t: 1 for t in _BYTE_CODED},
             **{f"{s}int{w}": w // 8 for s in ("", "u") for w in (8, 16, 32, 64)}}


def _array(c_type: str, name: str, values: list) -> str:
    """A static const C array (one element at least: C has no empty arrays)."""
    return f"static const {c_type} {name}[{max(len(values), 1)}] = {{{', '.join(values) or '0'}}};"


def _symbolic_dim_c(dim, symbols: list) -> str:
    """A shape entry in kiln_*_shapes: the size, or -1 - k for symbol k, or KILN_DIM_EXPR."""
    if isinstance(dim, int):
        return str(dim)
    if len(dim) == 1 and dim[0][1] == 1 and len(dim[0][0]) == 1 and dim[0][0][0] in symbols:
        return str(-1 - symbols.index(dim[0][0][0]))
    return "KILN_DIM_EXPR"


def _bytes_c(spec: dict, symbols: list, derived: list) -> str:
    """A tensor's bytes as a C expression of dims[] (the symbols' values); a dim that a size
    counted while the call runs decides, unless dims[] holds it, at its greatest (what to
    allocate before the call)."""
    late, bounds = late_names(derived), _bounds(derived)
    return "(size_t)(" + "*".join([f"{dim_greatest(d, bounds)}LL" if _uses(d, late - set(symbols)) else
                                   dim_c(d, symbols, derived) for d in spec["shape"]]
                                  + [str(_ITEMSIZE[spec["dtype"]])]) + ")"


def _uses(dim, names: set) -> bool:
    return not isinstance(dim, int) and any(s in names for monomial, _ in dim for s in monomial)


def _bounds(derived: list, symbols: list = ()) -> dict:
    return {s["name"]: (int(s["least"]), int(s["greatest"])) for s in [*symbols, *derived]}


def _counts(m: Manifest) -> bool:
    return any(is_counted(d) for d in m.derived)


def _symbols(m: Manifest) -> list[str]:
    """A symbolic model's symbols, and the byte counts of its inputs and outputs at run time."""
    names = [s["name"] for s in m.symbols]
    lines = ["/* Symbolic dims: kiln_run_dims takes each symbol's value, in this order, in dims[]; a",
             " * shape entry -1 - k is symbol k, KILN_DIM_EXPR a polynomial of them (see kiln_*_bytes_at). */",
             f"#define KILN_NUM_SYMBOLS {len(m.symbols)}", "#define KILN_DIM_EXPR (-1000000LL)",
             *([f"#define KILN_NUM_DIMS {len(names) + len(m.derived)}",
                _array("char* const", "kiln_derived_names", [json.dumps(d["name"]) for d in m.derived])]
               if _counts(m) else []),
             _array("char* const", "kiln_symbol_names", [json.dumps(n) for n in names]),
             _array("long long", "kiln_symbol_least", [str(s["least"]) for s in m.symbols]),
             _array("long long", "kiln_symbol_greatest", [str(s["greatest"]) for s in m.symbols])]
    for kind, specs in (("input", m.inputs), ("output", _cache_buffers(m))):
        lines += [f"/* Bytes of {kind} i for these symbol values. */",
                  f"static inline size_t kiln_{kind}_bytes_at(int i, const long long* dims) {{",
                  "  (void)dims;", "  switch (i) {"]
        lines += [f"    case {i}: return {_bytes_c(s, names, m.derived)};  /* {s['name']}: "
                  f"[{', '.join(dim_text(d) for d in s['shape'])}] */" for i, s in enumerate(specs)]
        lines += ["  }", "  return 0;", "}"]
    if _counts(m):  # (sizes a call counted: read from dims[] after it, as the entry wrote them)
        every = names + [d["name"] for d in m.derived]
        lines += ["/* Bytes output i holds after a call: dims[] as kiln_run_dims left it (KILN_NUM_DIMS). */",
                  "static inline size_t kiln_output_bytes_after(int i, const long long* dims) {",
                  "  (void)dims;", "  switch (i) {"]
        lines += [f"    case {i}: return {_bytes_c(s, every, m.derived)};" for i, s in enumerate(m.outputs)]
        lines += ["  }", "  return 0;", "}"]
    return lines


def _cache_buffers(m: Manifest) -> list:
    """The outputs, a KV cache's present as the buffer it is written in: capacity entries."""
    specs = []
    for s in m.outputs:
        for c in m.caches:
            if c["present"] == s["name"]:
                shape = list(s["shape"])
                shape[c["axis"]] = [[[c["capacity"]], 1]]
                s = {**s, "shape": shape}
        specs.append(s)
    return specs


def _caches(m: Manifest) -> list[str]:
    """The KV caches kept in place: which input and output share a buffer."""
    inputs, outputs, symbols = ([s["name"] for s in specs] for specs in (m.inputs, m.outputs, m.symbols))
    return ["/* KV caches kept in place: input kiln_cache_inputs[c] (the past) and output",
            " * kiln_cache_outputs[c] (the present: the past and this call's entries after it, along",
            " * axis kiln_cache_axes[c]) may be one buffer, kiln_output_bytes_at(kiln_cache_outputs[c],",
            " * dims) bytes, with dims[kiln_cache_capacity[c]] the entries it has room for: a call then",
            " * reads the past where it lies and appends only its own entries. Passed as two buffers",
            " * (the past dense, the capacity the present's length), the past is copied in first.",
            " * Returns 4, running nothing, where the present would not fit in the capacity. */",
            f"#define KILN_NUM_CACHES {len(m.caches)}",
            _array("int", "kiln_cache_inputs", [str(inputs.index(c["past"])) for c in m.caches]),
            _array("int", "kiln_cache_outputs", [str(outputs.index(c["present"])) for c in m.caches]),
            _array("int", "kiln_cache_axes", [str(c["axis"]) for c in m.caches]),
            _array("int", "kiln_cache_capacity", [str(symbols.index(c["capacity"])) for c in m.caches])]


def _tensors(kind: str, specs: list, symbols: list, derived: list) -> list[str]:
    """The C arrays describing a model's inputs or outputs (bytes at the symbols' bounds)."""
    rank = max([len(s["shape"]) for s in specs] + [1])
    names = [s["name"] for s in symbols]
    if any(is_counted(d) for d in derived):  # (a call writes these after the caller's)
        names += [d["name"] for d in derived]
    greatest, late, bounds = {s["name"]: s["greatest"] for s in symbols + derived}, late_names(derived), \
        _bounds(derived, symbols)
    shapes = ["{" + ", ".join([_symbolic_dim_c(d, names) for d in s["shape"]] + ["0"] * (rank - len(s["shape"])))
              + "}" for s in specs]
    return [f"#define KILN_NUM_{kind.upper()}S {len(specs)}",
            _array("char* const", f"kiln_{kind}_names", [json.dumps(s["name"]) for s in specs]),
            _array("char* const", f"kiln_{kind}_dtypes", [json.dumps(s["dtype"]) for s in specs]),
            _array("int", f"kiln_{kind}_ranks", [str(len(s["shape"])) for s in specs]),
            f"static const long long kiln_{kind}_shapes[{max(len(specs), 1)}][{rank}] = "
            f"{{{', '.join(shapes) or '{0}'}}};",
            _array("size_t", f"kiln_{kind}_bytes", [str(math.prod(dim_greatest(d, bounds) if _uses(d, late) else
                                                                  dim_value(d, greatest) for d in s["shape"])
                                                        * _ITEMSIZE[s["dtype"]]) for s in specs]),
            "/* element types, in order: " + ", ".join(f"{s['name']}: {_C_TYPES[s['dtype']]}" for s in specs) + " */"]


_ENTRY_STATIC = [
    "int kiln_run(char* weights, char* arena, void** inputs, void** outputs);",
    "/* kiln_run on `threads` threads (<= 0: kiln_num_threads()); any count gives the same bytes.",
    " * Returns 0, or before running anything 5 where two of the buffers overlap (kernels write",
    " * the outputs in place while the inputs are still read) or 6 where the bundle's kernels use",
    " * AMX tiles and Linux refused this process the tile state. */",
    "int kiln_run_threads(char* weights, char* arena, void** inputs, void** outputs, int threads);",
    "int kiln_run_profiled(char* weights, char* arena, void** inputs, void** outputs, double* times_ms,",
    "                      int threads);"]


def _entry_dims(counted: bool) -> list[str]:
    """The entry points of a model with symbolic dims; `counted`: sizes it counts while it runs
    (a NonZero's), which it writes back into dims[]."""
    dims = "long long* dims" if counted else "const long long* dims"
    return [
        "/* Run with the symbols' values in dims[] (inputs and outputs hold kiln_*_bytes_at(i, dims)",
        " * bytes each) on `threads` threads (<= 0: the default). Returns 0, or before running",
        " * anything 2 (a symbol outside its bounds), 3 (sizes the model needs equal differ), 4 (a",
        " * KV cache's present longer than its capacity), 5 (two buffers overlap: kernels write the",
        " * outputs in place while the inputs are still read; a KV cache's past may be its present)",
        " * or 6 (the kernels use AMX tiles and Linux refused this process the tile state). */",
        *([] if not counted else [
            "/* This model counts sizes while it runs (KILN_NUM_DIMS): dims[] has room for KILN_NUM_DIMS",
            " * values, the caller's symbols first; a call writes the others after them, in",
            " * kiln_derived_names order, and the outputs' shapes follow from them (kiln_output_shapes:",
            " * -1 - k is dims[k]). Allocate outputs for the greatest: kiln_output_bytes[i]. */"]),
        f"int kiln_run_dims(char* weights, char* arena, void** inputs, void** outputs, {dims},",
        "                  int threads);",
        f"int kiln_run_dims_profiled(char* weights, char* arena, void** inputs, void** outputs, {dims},",
        "                           double* times_ms, int threads);"]


def model_header(m: Manifest) -> str:
    lines = [f"/* Generated by Kiln {m.kiln_version} for model '{m.model}': run this bundle from C.",
             " *",
             " *   char* weights = kiln_load_weights(\"BUNDLE/" + m.weights_file + "\");   (NULL: read error, or the",
             " *                                                      file is not KILN_WEIGHTS_BYTES long)",
             " *   char* arena = kiln_alloc_arena();",
             " *   void* inputs[KILN_NUM_INPUTS] = {...};   void* outputs[KILN_NUM_OUTPUTS] = {...};",
             " *   kiln_run(weights, arena, inputs, outputs);   (0: done; 5: buffers overlap)",
             " *",
             f" * Link with the library: cc prog.c -IBUNDLE BUNDLE/{m.library} -Wl,-rpath,BUNDLE",
             " * Inputs and outputs are dense row-major buffers of kiln_*_bytes[i] bytes; kernels write",
             " * the outputs in place, fastest 64-byte aligned (aligned_alloc). One arena per",
             " * concurrent call; the weights are read-only and may be shared. A call divides its larger",
             " * kernels across a thread pool inside the library (workers sleep when idle and exit after",
             " * a second without work); concurrent calls each still get the same bytes. */",
             "#ifndef KILN_MODEL_H", "#define KILN_MODEL_H", "",
             "#include <stddef.h>", "#include <stdint.h>", "#include <stdio.h>", "#include <stdlib.h>", "",
             "#ifdef __cplusplus", "extern \"C\" {", "#endif", "",
             f"#define KILN_ABI_VERSION {ENTRY_ABI_VERSION}  /* kiln_abi_version() of the library must equal it */",
             f"#define KILN_WEIGHTS_FILE {json.dumps(m.weights_file)}",
             f"#define KILN_WEIGHTS_BYTES {m.weights_bytes}u",
             f"#define KILN_ARENA_BYTES {m.arena_bytes}u",
             f"#define KILN_SIGNATURE {json.dumps(m.signature())}  /* kiln_signature() of the library */",
             *(_symbols(m) + [""] if m.symbols or m.derived else []),  # (first: the shapes below use KILN_DIM_EXPR)
             *(_caches(m) + [""] if m.caches else []),
             *_tensors("input", m.inputs, m.symbols, m.derived), *_tensors("output", m.outputs, m.symbols, m.derived),
             "",
             "/* The library's entry points. */",
             "size_t kiln_arena_bytes(void);",
             "int kiln_abi_version(void);",
             "const char* kiln_signature(void);",
             "int kiln_num_calls(void);",
             "/* Threads kiln_run uses: the usable cores (sched_getaffinity), or the KILN_NUM_THREADS",
             " * environment variable, or what kiln_set_num_threads set (n <= 0: back to the default). */",
             "int kiln_num_threads(void);",
             "int kiln_set_num_threads(int n);",
             *(_entry_dims(_counts(m)) if m.symbols or m.derived else _ENTRY_STATIC),
             "",
             "/* The weights file read into 64-byte-aligned memory (free() it), or NULL. */",
             "static inline char* kiln_load_weights(const char* path) {",
             "  size_t n = KILN_WEIGHTS_BYTES, got;",
             "  char* buf = (char*)aligned_alloc(64, (n + 63) / 64 * 64 + 64);",
             "  FILE* f = fopen(path, \"rb\");",
             "  if (!buf || !f) { free(buf); if (f) fclose(f); return NULL; }",
             "  got = fread(buf, 1, n, f);",
             "  if (got != n || fgetc(f) != EOF) { free(buf); buf = NULL; }",
             "  fclose(f);",
             "  return buf;",
             "}", "",
             "/* An arena for one call at a time (free() it), or NULL. */",
             "static inline char* kiln_alloc_arena(void) {",
             "  return (char*)aligned_alloc(64, (KILN_ARENA_BYTES + 63) / 64 * 64 + 64);",
             "}", "",
             "#ifdef __cplusplus", "}", "#endif", "#endif", ""]
    return "\n".join(lines)
