"""Load a bundle and run it: numpy and ctypes only (no llvmlite, no JIT at load time).

A bundle is a folder: model.so (kernels + entry function), manifest.json (inputs,
outputs, shapes, dtypes, target, Kiln version) and weights.bin (all constants, packed
weights included, in the layout the entry function expects).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import stat
import threading
import time

import numpy as np

from .element_types import kind, numpy_dtype
from .errors import KilnError
from .kv_cache import KVCache

from .manifest import ENTRY_ABI_VERSION, KILN_VERSION, OVERLAPPING_BUFFERS, Manifest, dim_value
from .output_pool import OutputPool
from .symbols import Symbols
from .cpu_features import host_arch, missing_on_host


def _address(a: np.ndarray) -> int:
    """The address of an array's data: through a ctypes view where the array is writable (a
    third of the cost of `.ctypes.data`, which a small model's call pays per tensor)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(a))
    except (TypeError, ValueError, BufferError):  # read-only, or empty
        return a.ctypes.data


def _aligned_empty(nbytes: int, align: int = 64) -> np.ndarray:
    raw = np.empty(nbytes + align, np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + nbytes]


def _read_bundle_file(path: str, nbytes: int, into: memoryview | None = None) -> bytes | None:
    """A bundle file's bytes (or read into `into`), if it is a regular file of exactly
    `nbytes` (opened without blocking: a FIFO in its place would hang a plain open)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise KilnError(f"cannot open '{path}': {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KilnError(f"'{path}' is not a regular file")
        if st.st_size != nbytes:
            raise KilnError(f"'{path}' holds {st.st_size} bytes, the manifest says {nbytes}")
        if into is not None:
            with os.fdopen(os.dup(fd), "rb") as f:
                if f.readinto(into) != nbytes:
                    raise KilnError(f"'{path}' ended early")
            return None
        chunks, left = [], nbytes
        while left:
            chunk = os.read(fd, min(left, 1 << 24))
            if not chunk:
                raise KilnError(f"'{path}' ended early")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _static(shape: list) -> tuple | None:
    """A manifest shape as a tuple, or None where a dim is symbolic."""
    return tuple(shape) if all(isinstance(d, int) for d in shape) else None


class Module:
    def __init__(self, path: str, threads: int | None = None):
        self.path = path
        if threads is not None:
            self.threads = threads  # (checked before anything is loaded)
        m = self.manifest = Manifest.read(path)
        arch = str(m.target.get("triple", "")).split("-")[0]
        if arch != host_arch():
            raise KilnError(f"bundle '{path}' was built for {m.target['triple']}, which cannot run on this "
                            f"{host_arch()} machine (run it on an {arch} machine"
                            + (", or from C under qemu-user)" if m.runnable else
                               "; it holds objects only: no C compiler for that architecture was found to link them)"))
        if not m.runnable:
            raise KilnError(f"bundle '{path}' holds objects only, not a linked library")
        missing = missing_on_host(m.cpu_features)
        if missing:
            raise KilnError(f"bundle '{path}' was compiled for {m.target.get('name', 'another CPU')} and uses CPU "
                            f"features this machine lacks: {', '.join(missing)} (running it could crash with an "
                            "illegal instruction; build it for this machine, e.g. --target llvm)")
        self.inputs = m.inputs
        self.outputs = m.outputs
        self._weights = self._load_weights(os.path.join(path, m.weights_file), m.weights_bytes, m.weights_sha256)
        self._arena = _aligned_empty(max(m.arena_bytes, 1))
        self._lib = self._load_library(path, m)
        if threads is None:  # the library's default: KILN_NUM_THREADS, else the usable cores
            self.threads = self._lib.kiln_num_threads()
        # A bundle with symbolic dims runs at any size within its bounds: its entry takes the
        # symbols' values (artifacts/symbols.py), read from each call's input shapes.
        self._symbols = Symbols(m.symbols, m.inputs, m.outputs, m.checks, m.derived, m.caches) \
            if m.symbols or m.derived else None
        # (Symbols writes each call's values into its one array, in place: its address is fixed)
        self._dims_args = (self._symbols.dims.ctypes.data,) if self._symbols else ()
        self._run = self._lib.kiln_run_dims if self._symbols else self._lib.kiln_run_threads
        self._run.restype = ctypes.c_int
        self._run.argtypes = [ctypes.c_void_p] * (5 if self._symbols else 4) + [ctypes.c_int]
        self._in_ptrs = (ctypes.c_void_p * max(len(self.inputs), 1))()
        self._out_ptrs = (ctypes.c_void_p * max(len(self.outputs), 1))()
        self._weights_ptr, self._arena_ptr = self._weights.ctypes.data, self._arena.ctypes.data
        # (name, numpy dtype, shape) of each input and output: what a call checks first
        self._in_specs = [(s["name"], numpy_dtype(s["dtype"]), _static(s["shape"])) for s in self.inputs]
        self._out_specs = [(s["name"], numpy_dtype(s["dtype"]), _static(s["shape"])) for s in self.outputs]
        self._in_names = {s["name"] for s in self.inputs}
        # One arena per module: calls from several threads take turns (ctypes drops the GIL).
        self._lock = threading.Lock()
        self._outputs = OutputPool()

    @property
    def threads(self) -> int:
        """Threads a call may use (kernels too small to divide run on the caller's alone)."""
        return self._threads

    @threads.setter
    def threads(self, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise KilnError(f"threads must be a positive integer, got {n!r}")
        self._threads = n

    @staticmethod
    def _load_library(path: str, m: Manifest):
        """Map the library only once its bytes are the ones the manifest names (a truncated
        library dies with SIGBUS when mapped), then check that it was built for what the
        manifest promises: entry ABI, inputs, outputs and arena."""
        lib_path = os.path.abspath(os.path.join(path, m.library))
        data = _read_bundle_file(lib_path, m.library_bytes)
        if hashlib.sha256(data).hexdigest() != m.library_sha256:
            raise KilnError(f"library '{lib_path}' does not match the manifest's checksum (damaged or replaced)")
        lib = ctypes.CDLL(lib_path)
        abi = lib.kiln_abi_version()
        if abi != m.abi_version or abi != ENTRY_ABI_VERSION:
            raise KilnError(f"bundle '{path}': its library has entry ABI {abi}, the manifest says {m.abi_version}, "
                            f"and this Kiln {KILN_VERSION} calls ABI {ENTRY_ABI_VERSION}: rebuild the bundle")
        err = lib.kiln_tile_status() if hasattr(lib, "kiln_tile_status") else 0  # (bundles with AMX kernels)
        if err:
            raise KilnError(f"bundle '{path}' runs kernels on AMX tiles and Linux refused this process the tile "
                            f"state (arch_prctl ARCH_REQ_XCOMP_PERM: {os.strerror(err)}); build it for a target "
                            "without AMX, e.g. --target \"llvm -mattr=-amx-tile\"")
        lib.kiln_signature.restype = ctypes.c_char_p
        built_for = lib.kiln_signature().decode()
        if built_for != m.signature():
            raise KilnError(f"bundle '{path}': manifest.json describes inputs, outputs or arena other than the "
                            f"library was built for ({built_for!r})")
        return lib

    @staticmethod
    def _load_weights(path: str, nbytes: int, sha256: str) -> np.ndarray:
        buf = _aligned_empty(max(nbytes, 1))
        _read_bundle_file(path, nbytes, into=memoryview(buf)[:nbytes])
        if hashlib.sha256(buf[:nbytes]).hexdigest() != sha256:
            raise KilnError(f"weights file '{path}' does not match the manifest's checksum")
        return buf

    def _check_input(self, spec: dict, value) -> np.ndarray:
        arr = np.asarray(value)
        want = numpy_dtype(spec["dtype"])
        if arr.dtype != want:
            # Data of the same kind is converted (float64 arrays for a float32 input); another
            # kind (floats for an integer input) is the caller's mistake, named.
            if kind(arr.dtype) != kind(want) or not np.can_cast(arr.dtype, want, casting="same_kind"):
                raise KilnError(f"input '{spec['name']}': expected dtype {spec['dtype']}, got {arr.dtype}")
            arr = arr.astype(want)
        if self._symbols is None and list(arr.shape) != list(spec["shape"]):
            raise KilnError(f"input '{spec['name']}': expected shape {tuple(spec['shape'])}, got {arr.shape}")
        return np.ascontiguousarray(arr).reshape(arr.shape)  # (ascontiguousarray makes a scalar 1-d)

    def new_cache(self, capacity: int | None = None, **dims) -> KVCache:
        """Buffers for the model's KV caches (`run(..., cache=)`), empty: `capacity` entries
        each (default: the most the bundle was built for), at the sizes `dims` give the
        symbols they name (a symbol left out: 1 where its bounds allow, e.g. a batch of 1)."""
        m = self.manifest
        if not m.caches:
            raise KilnError(f"model '{self.path}' keeps no KV cache in place: it has no past input that a present "
                            "output extends (or was built with the bind_kv_caches pass disabled)")
        bounds = self._symbols.bounds
        unknown = [s for s in dims if s not in bounds or any(s == c["capacity"] for c in m.caches)]
        if unknown:
            raise KilnError(f"new_cache: no symbol {', '.join(unknown)} to size (the model's: "
                            f"{', '.join(s for s in bounds if not any(s == c['capacity'] for c in m.caches))})")
        values = {s: dims[s] if s in dims else min(max(lo, 1), hi) for s, (lo, hi) in bounds.items()}
        for c in m.caches:
            values[c["capacity"]] = bounds[c["capacity"]][1] if capacity is None else capacity
        for s, v in values.items():
            lo, hi = bounds[s]
            if not lo <= v <= hi:
                raise KilnError(f"new_cache: {s} = {v} is outside the bounds the bundle was built for "
                                f"({s} = {lo}..{hi})")
        return KVCache(m, values)

    def _bind(self, inputs: dict, out: dict | None = None, cache: KVCache | None = None) -> dict:
        """Validate inputs, point the call's argument arrays at them; return the outputs to
        write (fresh arrays, or the caller's `out`, checked). With a cache, each past input is
        the entries it holds and each present is written into it: both point at its buffer."""
        shared = {}  # input or output name -> the cache buffer it points at
        if cache is not None:
            inputs = self._with_cache(inputs, cache, shared)
        if inputs.keys() != self._in_names:
            names = [s["name"] for s in self.inputs]
            missing = [n for n in names if n not in inputs]
            extra = [n for n in inputs if n not in names]
            raise KilnError(f"inputs: missing {missing}, unexpected {extra}; the model takes {names}")
        arrays = []
        for i, (name, dt, shape) in enumerate(self._in_specs):
            a = inputs[name]
            if name not in shared and not (type(a) is np.ndarray and a.dtype == dt and
                                           (a.shape == shape or shape is None) and a.flags.c_contiguous):
                a = self._check_input(self.inputs[i], a)  # converted where it may be, else a named error
            arrays.append(a)
        out_specs = self._out_specs
        if self._symbols is not None:  # the symbols' values from the shapes, checked before anything runs
            capacities = {c["capacity"]: cache.buffers[c["present"]].shape[c["axis"]]
                          for c in cache.specs} if cache is not None else None
            values = self._values = self._symbols.bind([a.shape for a in arrays], arrays, capacities)
            out_specs = [(name, dt, shape) for (name, dt, _), shape in
                         zip(self._out_specs, self._symbols.output_shapes(values))]
        for i, ((name, _, _), a) in enumerate(zip(self._in_specs, arrays)):
            self._in_ptrs[i] = _address(shared[name]) if name in shared else _address(a)
        self._keep = None  # (the last call's inputs: buffers the pool may hand out again)
        if out is None:  # (views of buffers the caller let go of, where outputs are large: artifacts/output_pool.py)
            out = {name: self._outputs.array(shape, dt) for name, dt, shape in out_specs if name not in shared}
        for i, (name, dt, shape) in enumerate(out_specs):
            if name in shared:  # (a present: the cache's buffer, which holds this many entries after the call)
                self._out_ptrs[i] = _address(shared[name])
                self._cache_length = shape[next(c["axis"] for c in cache.specs if c["present"] == name)]
                continue
            a = out.get(name) if isinstance(out, dict) else None
            if not (type(a) is np.ndarray and a.dtype == dt and a.shape == shape and a.flags.c_contiguous
                    and a.flags.writeable):
                raise KilnError(f"out['{name}']: expected a writable C-contiguous {dt} array of shape {shape}, "
                                f"got {type(a).__name__ if not isinstance(a, np.ndarray) else f'{a.dtype} {a.shape}'}")
            self._out_ptrs[i] = _address(a)
        self._keep = arrays  # the pointers above must outlive the call
        return out

    def _overlap_error(self, outs: dict) -> KilnError:
        """The error for the entry's code 5: which of the caller's arrays share memory (kernels
        write the outputs in place while the inputs are still read). A KV cache's past input
        is its present's buffer by design."""
        pasts = {c["past"] for c in self.manifest.caches}
        named = [(f"input '{name}'", a) for (name, _, _), a in zip(self._in_specs, self._keep) if name not in pasts]
        named += [(f"out['{name}']", a) for name, a in outs.items()]
        spans = sorted((_address(a), _address(a) + a.nbytes, what) for what, a in named if a.nbytes)
        pairs = [(first, second) for (_, end, first), (start, _, second) in zip(spans, spans[1:]) if start < end]
        first, second = pairs[0] if pairs else ("two arrays", "another")
        return KilnError(f"{first} and {second} share memory: outputs are written while the inputs are read; "
                         "pass separate arrays (nothing was run)")

    def _with_cache(self, inputs: dict, cache: KVCache, shared: dict) -> dict:
        """The inputs with each past input taken from the cache (its entries so far)."""
        if not isinstance(cache, KVCache) or cache.specs != self.manifest.caches:
            raise KilnError("cache: expected a KVCache from this module's new_cache()")
        given = [c["past"] for c in cache.specs if c["past"] in inputs]
        if given:
            raise KilnError(f"inputs: {', '.join(given)} come from the cache; leave them out when passing cache=")
        inputs = dict(inputs)
        for c in cache.specs:
            inputs[c["past"]] = cache.past(c)
            shared[c["past"]] = shared[c["present"]] = cache.buffers[c["present"]]
        return inputs

    def run(self, inputs: dict, out: dict | None = None, cache: KVCache | None = None) -> dict:
        """The model's outputs for `inputs` (name -> array). With `out` (name -> array of each
        output's dtype and shape), they are written there and `out` is returned: a loop that
        calls the model many times allocates nothing (`out_shapes` gives their shapes: an
        output whose size the call counts, a NonZero's, is written at the front of an array of
        its greatest shape, and a view of that part returned). With `cache` (`new_cache()`), the past
        inputs come from it, this call's entries are appended to it in place, and the
        presents returned are views of it."""
        with self._lock:
            outs = self._bind(inputs, out, cache)
            rc = self._run(self._weights_ptr, self._arena_ptr, self._in_ptrs, self._out_ptrs,
                           *self._dims_arg(), self._threads)
            if rc == 0 and self._symbols is not None and self._symbols.late:
                outs = self._counted_views(outs)
        if rc == OVERLAPPING_BUFFERS:
            raise self._overlap_error(outs)
        if rc in (2, 3) and self._symbols is not None and self._symbols.late:
            fault = self._symbols.late_fault(rc)
            what = "fell outside the bounds it was built for" if rc == 2 else "differ where the model needs them equal"
            raise KilnError(f"model '{self.path}': sizes it counted or read from its data while running {what} "
                            f"({fault + '; ' if fault else ''}the call stopped there)")
        if rc != 0:
            raise KilnError(f"model '{self.path}' returned error code {rc}")
        if cache is not None:
            cache.length = self._cache_length
            outs = {**outs, **{c["present"]: cache.past(c) for c in cache.specs}}
        return outs

    def out_shapes(self, inputs: dict) -> dict:
        """The shape each `out=` array must have for these inputs: an output whose size the call
        counts (a NonZero's) at its greatest, of which `run` returns the part written."""
        if self._symbols is None:
            return {name: shape for name, _, shape in self._out_specs}
        arrays = [self._check_input(spec, inputs[spec["name"]]) for spec in self.inputs]
        with self._lock:
            shapes = self._symbols.output_shapes(self._symbols.bind([a.shape for a in arrays], arrays))
        return {name: shape for (name, _, _), shape in zip(self._out_specs, shapes)}

    def _counted_views(self, outs: dict) -> dict:
        """Outputs whose sizes the call counted (a NonZero's): each was allocated (or passed
        in `out`) at its greatest shape and written at its counted one, at the front."""
        shapes = self._symbols.output_shapes(self._symbols.after_call(self._values))
        views = dict(outs)
        for (name, _, _), shape in zip(self._out_specs, shapes):
            a = outs.get(name)
            if a is not None and a.shape != shape:
                views[name] = a.reshape(-1)[:int(np.prod(shape, dtype=np.int64))].reshape(shape)
        return views

    def profile(self, inputs: dict | None = None, repeat: int = 20) -> list[dict]:
        """Median wall time of each kernel call, in call order."""
        calls = self.manifest.calls
        fn = self._lib.kiln_run_dims_profiled if self._symbols else self._lib.kiln_run_profiled
        fn.argtypes = [ctypes.c_void_p] * (6 if self._symbols else 5) + [ctypes.c_int]
        times = np.zeros((repeat, len(calls)))
        inputs = inputs if inputs is not None else self.random_inputs()
        for r in range(repeat + 1):
            row = np.zeros(max(len(calls), 1))
            with self._lock:
                outs = self._bind(inputs)
                fn(self._weights_ptr, self._arena_ptr, self._in_ptrs, self._out_ptrs, *self._dims_arg(),
                   row.ctypes.data, self._threads)
            if r:  # the first run warms caches
                times[r - 1] = row[:len(calls)]
        del outs
        med = np.median(times, axis=0)
        return [{**c, "ms": float(ms)} for c, ms in zip(calls, med)]

    def _dims_arg(self) -> tuple:
        return self._dims_args

    def random_inputs(self, seed: int = 0, dims: dict | None = None) -> dict:
        """Inputs of the right shapes and dtypes: standard normal floats, zero integers (an
        integer input whose values are read as sizes: their value in `dims`, by the element's
        symbol or the input's name, else their least). A symbolic dim takes its value in
        `dims`, else its greatest."""
        rng = np.random.default_rng(seed)
        values = {**(self._symbols.greatest() if self._symbols else {}), **(dims or {})}
        shapes = {s["name"]: [dim_value(d, values) for d in s["shape"]] for s in self.inputs}
        out = {s["name"]: (rng.standard_normal(shapes[s["name"]]).astype(numpy_dtype(s["dtype"]))
                           if s["dtype"].startswith(("float", "bfloat"))
                           else np.zeros(shapes[s["name"]], numpy_dtype(s["dtype"])))
               for s in self.inputs}
        for d in self.manifest.derived:  # (an element read as it is: ir/value_symbols.py)
            if d.get("expr", [None])[0] == "read":
                given = (dims or {}).get(d["name"], (dims or {}).get(d["expr"][1], d["least"]))
                out[d["expr"][1]].reshape(-1)[d["expr"][2]] = given
        return out

    def __call__(self, *args, **kwargs) -> dict:
        named = dict(zip((s["name"] for s in self.inputs), args))
        named.update(kwargs)
        return self.run(named)

    def benchmark(self, warmup: int = 10, repeat: int = 50, inputs: dict | None = None) -> dict:
        """Latency in ms over `repeat` runs after `warmup` runs, on random (or given) inputs."""
        if inputs is None:
            inputs = self.random_inputs()
        for _ in range(warmup):
            self.run(inputs)
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            self.run(inputs)
            times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
        return {"median_ms": times[len(times) // 2], "mean_ms": sum(times) / len(times), "min_ms": times[0],
                "p90_ms": times[int(len(times) * 0.9) - 1 if len(times) > 1 else 0], "repeat": repeat}


def load(path: str, threads: int | None = None) -> Module:
    """The bundle at `path`, ready to run on `threads` threads (default: KILN_NUM_THREADS, else the
    usable cores)."""
    return Module(path, threads)
