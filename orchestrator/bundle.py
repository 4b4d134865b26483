"""Assemble a bundle from compiled kernels: plan memory, generate the entry, link, manifest."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import math
import os
import shutil
import tempfile
from dataclasses import dataclass

from ..artifacts.c_header import HEADER, model_header
from ..artifacts.link import entry_source, find_linker, link_key, link_shared
from ..artifacts.errors import KilnError
from ..artifacts.manifest import COUNTED, MANIFEST, OVERLAPPING_BUFFERS, Manifest, dim_c
from ..artifacts.memory_plan import pack_constants, plan_arena
from ..artifacts.store import TemporaryBlob


def _is_loop(step) -> bool:
    return hasattr(step, "trip")  # ir.lower.loops.LoopCall (not imported: a whole-model hit needs no compiler)


def _kernel_calls(steps):
    """The kernel calls of `steps`, those in loops' bodies too."""
    for st in steps:
        if _is_loop(st):
            yield from _kernel_calls(st.steps)
        else:
            yield st


def _loops(steps):
    """The loops of `steps`, those in loops' bodies too."""
    for st in steps:
        if _is_loop(st):
            yield st
            yield from _loops(st.steps)


def _swaps(lowered, loop) -> bool:
    """Does a carried value's new value live in another carried value's state buffer (a body
    that swaps two values)? Then the copies go through scratch buffers."""
    states = [lowered.storage(s) for _, s, _ in loop.state]
    return any(lowered.storage(leave) in states[:i] + states[i + 1:] for i, (_, _, leave) in enumerate(loop.state))


def _runtime_phases(parts: list) -> list:
    """A kernel's thread plan with run-time extents, and guarded phases' conditions, as C
    expressions of `dims`."""
    from ..ir.loop import condition_c, extent_c
    out = []
    for part in parts:
        if len(part) == 3:
            out.append(part)
            continue
        extent, pieces, grain, runtime, *guard = part
        if runtime is not None:
            scale, bound, total = runtime
            pieces = f"kiln_pieces({extent_c(scale)}, {bound}, {total}, {pieces})"
        out.append((extent_c(extent), pieces, grain, *(condition_c(g) for g in guard)))
    return out


def _dim_c(d, symbols: list) -> str:
    """A size (an int or a Dim) as a C expression of `dims` (long long)."""
    from ..ir.symbolic import dim_to_json
    return dim_c(dim_to_json(d), symbols)


def _nbytes_c(t, symbols: list) -> "int | str":
    """A tensor's bytes: an int, or a C expression of `dims` for a symbolic shape."""
    return t.nbytes if t.is_static else f"(size_t){_dim_c(t.nbytes, symbols)}"


def _preconditions(lowered) -> list[tuple[str, int]]:
    """What the entry checks before it runs anything, (C condition, error code): each
    symbol within its bounds (2: the caller's, and those read from inputs' values), each pair
    of sizes that must agree equal (3), each KV cache's new length within its capacity (4),
    the caller's buffers disjoint (5: outputs are written while inputs are still read,
    `output_homes`; a KV cache's past input may be its present's buffer, so it is left out)."""
    symbols, late = list(lowered.symbols), _late(lowered)
    out = [(f"dims[{k}] >= {lo}LL && dims[{k}] <= {hi}LL", 2) for k, (s, (lo, hi)) in enumerate(lowered.symbols.items())
           if not isinstance(lowered.derived.get(s), tuple) and s not in late]  # (a floor_div's: within by definition)
    out += [(cond, 3) for cond, needs in _size_checks(lowered) if not needs]
    for c in lowered.caches:
        out.append((f"{_dim_c(lowered.types[c.present].shape[c.axis], symbols)} <= dims[{symbols.index(c.capacity)}]",
                    4))
    pasts = {c.past for c in lowered.caches}
    buffers = [(f"inputs[{i}]", lowered.types[t]) for i, t in enumerate(lowered.inputs) if t not in pasts] + \
        [(f"outputs[{i}]", lowered.types[t]) for i, t in enumerate(lowered.outputs)]
    buffers = [(p, t) for p, t in buffers if t.nbytes != 0]
    if len(buffers) > 1:  # (a late size is at its greatest until counted: what the caller allocates)
        starts = ", ".join(p for p, _ in buffers)
        sizes = ", ".join(str(_nbytes_c(t, symbols)) for _, t in buffers)
        out.append((f"kiln_disjoint({len(buffers)}, (void*[]){{{starts}}}, (size_t[]){{{sizes}}})",
                    OVERLAPPING_BUFFERS))
    return out


def _size_checks(lowered) -> list[tuple[str, set]]:
    """Each pair of sizes the model needs equal as a C condition, with the counted sizes it
    waits for (none: checked before anything runs)."""
    from ..ir.symbolic import Dim
    symbols, needs = list(lowered.symbols), _counts_needed(lowered)
    out = []
    for a, b, _, unless in lowered.checks:
        skip = f"*(const unsigned char*)inputs[{lowered.inputs.index(unless[0])}] == {int(unless[1])} || " \
            if unless else ""
        waits = set().union(*(needs.get(s, set()) for d in (a, b) if isinstance(d, Dim) for s in d.symbols))
        out.append((f"{skip}{_dim_c(a, symbols)} == {_dim_c(b, symbols)}", waits))
    return out


def _late(lowered) -> list:
    from ..ir.symbolic import late_symbols
    return late_symbols(lowered.derived)


def _uses(size, symbols) -> bool:
    """Does a size (an int or a Dim) read any of `symbols`?"""
    return not isinstance(size, int) and bool(set(size.symbols) & set(symbols))


def _counts_needed(lowered) -> dict[str, set]:
    """For each late symbol (ir.symbolic.late_symbols), the counted sizes it is computed from."""
    from ..ir.symbolic import definition_symbols
    needs: dict[str, set] = {}
    for s in _late(lowered):
        d = lowered.derived[s]
        needs[s] = {s} if _counted(d) else set().union(*(needs.get(t, set()) for t in definition_symbols(d)))
    return needs


def _after_count(lowered, bound: set, new: str, guarded: set) -> list[str]:
    """The entry's statements once count `new` is known (`bound`: every count known by then,
    it too): the late symbols that waited for it and no other unknown count computed anew,
    then the bounds of the late value symbols and the size checks among them. A count in a
    branch taken at run time (`guarded`) keeps its greatest where the branch did not run, and
    the checks that wait for it are made only where it did (`kiln_ran<k>`, artifacts/link.py)."""
    from ..artifacts import expressions
    from ..ir.value_symbols import to_json
    symbols, lines = list(lowered.symbols), []
    lo, hi = lowered.symbols[new]  # (a size read from data may fall outside the bounds its buffers have)
    lines.append(f"if (!(dims[{symbols.index(new)}] >= {lo}LL && dims[{symbols.index(new)}] <= {hi}LL)) KILN_FAIL(2);")
    for s, waits in _counts_needed(lowered).items():
        d, k = lowered.derived[s], symbols.index(s)
        if _counted(d) or new not in waits or not waits <= bound:
            continue
        value = f"{_dim_c(d[0], symbols)} / {d[1]}LL" if isinstance(d, tuple) else \
            expressions.c(to_json(d.expr), symbols, lowered.inputs)
        lines.append(f"dims[{k}] = {value};")
        if not isinstance(d, tuple):  # (a quotient is within its bounds by its definition)
            lo, hi = lowered.symbols[s]
            lines.append(f"if (!(dims[{k}] >= {lo}LL && dims[{k}] <= {hi}LL)) KILN_FAIL(2);")
    for cond, waits in _size_checks(lowered):
        if new in waits and waits <= bound:
            ran = "".join(f"!kiln_ran{symbols.index(c)} || " for c in sorted(waits & guarded))
            lines.append(f"if (!({ran}{cond})) KILN_FAIL(3);")
    return lines


def _caches(lowered) -> tuple:
    """entry_source's `caches`: each KV cache's input and output, and its blocks (the dims
    before its axis) with their bytes at the past's length and at the capacity."""
    if not lowered.caches:
        return ()
    from ..ir.dtypes import DTYPES
    symbols = list(lowered.symbols)
    pairs = []
    for c in lowered.caches:
        t, layout = lowered.types[c.past], lowered.cache_layout(c.present)
        shape = t.shape
        row = math.prod(shape[c.axis + 1:]) * DTYPES[t.dtype].itemsize  # (bytes of one entry of one block)
        pairs.append((lowered.inputs.index(c.past), lowered.outputs.index(c.present),
                      _dim_c(math.prod(shape[:c.axis]), symbols),
                      f"({_dim_c(shape[c.axis] * row, symbols)})", f"({_dim_c(layout[c.axis] * row, symbols)})"))
    return len(lowered.inputs), pairs


def _derived(lowered) -> tuple:
    """entry_source's `derived`: the caller's symbols (they come first), and each derived
    one's value as C: floor(numerator / divisor), the numerator never negative in bounds, or
    a value symbol's expression, which reads the inputs (ir/value_symbols.py)."""
    if not lowered.derived:
        return ()
    from ..artifacts import expressions
    from ..ir.value_symbols import to_json
    symbols, late = list(lowered.symbols), set(_late(lowered))
    return (len(symbols) - len(lowered.derived),
            [f"{lowered.symbols[s][1]}LL" if s in late else  # (the greatest until the counts are known)
             f"{_dim_c(d[0], symbols)} / {d[1]}LL" if isinstance(d, tuple) else
             expressions.c(to_json(d.expr), symbols, lowered.inputs) for s, d in lowered.derived.items()],
            bool(late))


def _counted(definition) -> bool:
    """Is a derived symbol a size a kernel counts while the call runs (value_symbols.counted)?"""
    return not isinstance(definition, tuple) and definition.expr[0] == COUNTED


def _derived_json(name: str, definition, bounds: tuple) -> dict:
    """The manifest's entry for a derived symbol."""
    from ..ir.symbolic import dim_to_json
    from ..ir.value_symbols import to_json
    if isinstance(definition, tuple):
        return {"name": name, "numerator": dim_to_json(definition[0]), "divisor": definition[1], "least": bounds[0],
                "greatest": bounds[1]}
    return {"name": name, "expr": to_json(definition.expr), "what": definition.what, "least": bounds[0],
            "greatest": bounds[1]}


def output_homes(lowered) -> dict[str, int]:
    """Tensors computed straight into the caller's output buffers: {storage: output index}.
    An output's storage lives there unless it is an input, a constant, a KV cache's present
    (in place already), empty, or claimed by another output first; those are copied at the
    end. Writing in place saves a pass over each output (a 3 -> 64 7x7 conv at 512 x 512
    spent a tenth of its time copying its 16 MiB output) and its arena space."""
    claimed = set(lowered.inputs) | set(lowered.constants) | {c.present for c in lowered.caches}
    homes = {}
    for i, o in enumerate(lowered.outputs):
        s = lowered.storage(o)
        nbytes = lowered.types[o].nbytes  # (an empty output has nothing to save: it keeps its arena slot)
        if s not in claimed and s not in homes and lowered.types[s].nbytes == nbytes and nbytes != 0:
            homes[s] = i
    return homes


def _locations(lowered, weight_offsets, arena_offsets):
    """The entry function's plan: ("call", symbol, argument locations, guard, index, phases)
    and ("loop", ...) items (artifacts.link.entry_source), and the outputs' locations."""
    from ..ir.loop import SYMBOLS
    from ..ir.parallel import thread_plan
    symbols = list(lowered.symbols)
    greatest = tuple(hi for _, hi in lowered.symbols.values())

    presents = {c.present for c in lowered.caches}
    homes = output_homes(lowered)

    def loc(tensor: str) -> tuple:
        t = lowered.storage(tensor)
        if t in lowered.inputs:
            return ("input", lowered.inputs.index(t))
        if t in presents:  # (a KV cache: written in place in the caller's buffer)
            return ("output", lowered.outputs.index(t))
        if t in homes:
            return ("output", homes[t])
        if t in weight_offsets:
            return ("weights", weight_offsets[t])
        return ("arena", arena_offsets[t])

    def guard(g):
        return [(loc(t), value) for t, value in g]

    index = 0

    def items(steps) -> list:
        nonlocal index
        out = []
        for st in steps:
            if _is_loop(st):
                nbytes = [_nbytes_c(lowered.types[s], symbols) for _, s, _ in st.state]
                swap = [("arena", arena_offsets[f"swap:{id(st)}:{i}"]) for i in range(len(st.state))] \
                    if _swaps(lowered, st) else None
                if st.count:  # (read at run time)
                    trip = loc(st.count)
                elif not isinstance(st.trip, int):  # (a size: a C expression of dims)
                    trip = _dim_c(st.trip, symbols)
                else:
                    trip = st.trip if st.trip or not st.until else None  # (None: a while loop's no limit)
                ran = [s for s, t in counts.items()
                       if st.iterations and lowered.storage(t) == lowered.storage(st.iterations)]
                out.append(("loop", trip, loc(st.iteration) if st.iteration else None,
                            [(loc(init), loc(state), n) for (init, state, _), n in zip(st.state, nbytes)],
                            [(loc(whole), loc(part), _nbytes_c(lowered.types[part], symbols), rev)
                             for whole, part, rev in st.feeds],
                            items(st.steps),
                            [(loc(leave), loc(state), n) for (_, state, leave), n in zip(st.state, nbytes)], swap,
                            [(loc(part), loc(whole), _nbytes_c(lowered.types[part], symbols), rev)
                             for part, whole, rev in st.scans],
                            guard(st.guard), loc(st.start_if) if st.start_if else None,
                            loc(st.until) if st.until else None,
                            (loc(st.iterations), lowered.symbols[ran[0]][1]) if ran else None))
                for s in ran:  # (the scan outputs' length: what the loop counted)
                    bound.add(s)
                    out.append(("bind", symbols.index(s), loc(st.iterations), guard(st.guard),
                                _after_count(lowered, bound, s, guarded)))
                continue
            args = [loc(t) for t in st.outputs] + [loc(t) for t in st.inputs]
            args += [("arena", arena_offsets[f"ws:{index}:{j}"]) for j in range(len(st.workspaces))]
            if any(b.name == SYMBOLS for b in st.kernel.buffers):  # (its last buffer: see KernelBuilder.kernel)
                args.append(("dims", 0))
            parts = thread_plan(st.kernel, greatest)
            out.append(("call", st.kernel.symbol, args, guard(st.guard), index,
                        _runtime_phases(parts) if symbols else parts))
            index += 1
            for s, t in counts.items():
                if lowered.storage(t) in {lowered.storage(o) for o in st.outputs}:
                    bound.add(s)
                    out.append(("bind", symbols.index(s), loc(t), guard(st.guard),
                                _after_count(lowered, bound, s, guarded)))
        return out

    # Sizes kernels count (a NonZero's): read from what the kernel wrote right after its call.
    counts = {s: d.expr[1] for s, d in lowered.derived.items() if _counted(d)}
    bound: set = set()
    # (a count in a loop's body is bound there, each iteration)
    where = {lowered.storage(o): st.guard for st in _kernel_calls(lowered.steps) for o in st.outputs} \
        if counts else {}
    where.update({lowered.storage(loop.iterations): loop.guard for loop in _loops(lowered.steps)
                  if loop.iterations and counts})
    guarded = {s for s, t in counts.items() if where[lowered.storage(t)]}  # (counted in a branch taken at run time)

    plan = items(lowered.steps)
    outputs = [(loc(o), _nbytes_c(lowered.types[o], symbols)) for o in lowered.outputs]
    return plan, outputs


def _loop_tensors(loop) -> set:
    """Every tensor a loop's iterations touch: they live from its first step to its last."""
    out = set(loop.tensors()) | {t for t, _ in loop.guard}
    for st in loop.steps:
        out |= _loop_tensors(st) if _is_loop(st) else set(st.outputs + st.inputs + [t for t, _ in st.guard])
    return out


def plan_memory(lowered):
    """(offsets of every intermediate tensor and workspace, the arena size, C statements
    computing the offsets known at run time). Time steps are kernel calls in order; what a
    loop touches lives through all of its steps. With symbolic dims the arena is sized at
    the bounds, and an offset that depends on the symbols is `at[i]`, which the entry
    computes from the call's sizes (`_run_time_offsets`)."""
    from ..ir.symbolic import greatest
    lifetimes: dict[str, list[int]] = {}
    late = set(_late(lowered))
    sizes: dict[str, int] = {}
    actual: dict[str, object] = {}  # each buffer's bytes as a size (a Dim where symbolic)
    external = set(lowered.inputs) | set(lowered.constants) | {c.present for c in lowered.caches} | \
        set(output_homes(lowered))

    def use(t: str, first: int, last: int) -> None:
        s = lowered.storage(t)
        if not s or s in external:
            return
        span = lifetimes.setdefault(s, [first, last])
        span[0], span[1] = min(span[0], first), max(span[1], last)
        sizes[s] = lowered.types[s].greatest_nbytes  # (planned at the symbols' bounds)
        # (a size known only after a count is placed as planned: offsets are computed before
        # the first kernel, and 100 - n at n's greatest would be its least)
        nbytes = lowered.types[s].nbytes
        actual[s] = sizes[s] if _uses(nbytes, late) else nbytes

    index = 0

    def walk(steps, time: int) -> int:
        nonlocal index
        for st in steps:
            if _is_loop(st):
                first = time
                time = max(walk(st.steps, time), first + 1)
                for t in _loop_tensors(st):
                    use(t, first, time - 1)
                if _swaps(lowered, st):
                    for i, (_, state, _) in enumerate(st.state):
                        lifetimes[f"swap:{id(st)}:{i}"] = [first, time - 1]
                        sizes[f"swap:{id(st)}:{i}"] = lowered.types[state].greatest_nbytes
                        actual[f"swap:{id(st)}:{i}"] = lowered.types[state].nbytes
                continue
            for t in st.outputs + st.inputs + [t for t, _ in st.guard]:  # (a guard is read at the call)
                use(t, time, time)
            for j, n in enumerate(st.workspaces):
                lifetimes[f"ws:{index}:{j}"] = [time, time]
                sizes[f"ws:{index}:{j}"], actual[f"ws:{index}:{j}"] = 4 * greatest(n), 4 * n  # (n: a Dim per image)
            index += 1
            time += 1
        return time

    end = walk(lowered.steps, 0)
    for o in lowered.outputs:  # (one copied at the end lives until then)
        s = lowered.storage(o)
        if s in lifetimes:
            lifetimes[s][1] = end
    from ..ir.graph import ShapeError  # (here: a whole-model hit imports this module, not numpy)
    from ..ir.validate import MAX_ARENA_BYTES
    offsets, total = plan_arena({k: tuple(v) for k, v in lifetimes.items()}, sizes)
    if total > MAX_ARENA_BYTES:
        raise ShapeError(f"the model needs a {total / 2**30:.1f} GiB arena for its intermediate tensors, more than "
                         f"the {MAX_ARENA_BYTES / 2**30:.0f} GiB allowed (KILN_MAX_ARENA_BYTES)")
    if not lowered.symbols:
        return offsets, total, []
    placed, statements = _run_time_offsets(offsets, {k: tuple(v) for k, v in lifetimes.items()}, actual,
                                           list(lowered.symbols))
    return placed, total, statements


def _run_time_offsets(offsets: dict, lifetimes: dict, actual: dict, symbols: list) -> tuple[dict, list]:
    """(offsets, C statements computing those known at run time): each buffer at the
    greatest end of its neighbours directly beneath it in the plan at the bounds
    (artifacts.memory_plan.directly_beneath), for the call's own sizes. Planned at the
    bounds, a call of one image, where a batch of up to 8 was planned, found each tensor's
    first eighth in a slot eight times its size: MobileNetV2 at 224 x 224 ran 1.09x its
    static time. An offset that no run-time size moves stays an int; the arena stays sized
    at the bounds, the most any offset reaches."""
    from ..artifacts.memory_plan import directly_beneath
    beneath = directly_beneath(offsets, lifetimes)
    placed, statements = {}, []

    def end(x: str):
        size = actual[x]
        if isinstance(placed[x], int) and isinstance(size, int):
            return placed[x] + -(-max(size, 1) // 64) * 64  # (as plan_arena aligns)
        return f"kiln_end({placed[x]}, {size if isinstance(size, int) else _dim_c(size, symbols)})"

    for y in sorted(offsets, key=lambda n: (offsets[n], n)):
        ends = [end(x) for x in beneath[y]]
        fixed = max((e for e in ends if isinstance(e, int)), default=0)
        moving = [e for e in ends if not isinstance(e, int)]
        if not moving:
            placed[y] = fixed
            continue
        value = moving.pop() if not fixed else f"{fixed}LL"
        for e in moving:
            value = f"kiln_max({value}, {e})"
        placed[y] = f"at[{len(statements)}]"
        statements.append(f"{placed[y]} = {value};")
    return placed, statements


@dataclass
class Prepared:
    """A bundle but its library: what needs no object, made while the kernels compile."""
    manifest: Manifest
    entry: str
    files: dict
    linker: str | None


def prepare(lowered, target, manifest_extra: dict) -> Prepared:
    """The weights packed, the memory planned, the manifest and the entry source written."""
    from ..ir.deferred import pieces
    from ..ir.loop import uses_tiles
    from ..ir.parallel import MIN_PIECE_WORK
    from ..ir.symbolic import dim_to_json
    linker = find_linker(target.arch)
    types = lowered.types
    weights = TemporaryBlob()  # (written as packed, one constant at a time: never held whole)
    weight_offsets = pack_constants(lowered.constants, weights, pieces)
    offsets, arena_bytes, arena_at = plan_memory(lowered)
    plan, outputs = _locations(lowered, weight_offsets, offsets)
    manifest = Manifest(
        **manifest_extra,
        inputs=[{"name": n, "shape": [dim_to_json(d) for d in types[n].shape], "dtype": types[n].dtype}
                for n in lowered.inputs],
        outputs=[{"name": n, "shape": [dim_to_json(d) for d in types[n].shape], "dtype": types[n].dtype}
                 for n in lowered.outputs],
        symbols=[{"name": s, "least": lo, "greatest": hi} for s, (lo, hi) in lowered.symbols.items()
                 if s not in lowered.derived],
        derived=[_derived_json(s, d, lowered.symbols[s]) for s, d in lowered.derived.items()],
        checks=[{"left": dim_to_json(a), "right": dim_to_json(b), "where": where,
                 **({"unless": {"input": unless[0], "value": unless[1]}} if unless else {})}
                for a, b, where, unless in lowered.checks],
        caches=[{"past": c.past, "present": c.present, "axis": c.axis, "capacity": c.capacity} for c in lowered.caches],
        arena_bytes=arena_bytes, weights_bytes=len(weights), weights_sha256=weights.sha256,
        runnable=linker is not None,
        # (a kernel's precision named where it is bf16: a float32 bundle's manifest is what it was)
        calls=[{"name": c.name, "symbol": c.kernel.symbol, "ops": c.ops,
                **({"precision": c.precision} if c.precision != "fp32" else {})} for c in lowered.calls])
    entry = entry_source(plan, outputs, arena_bytes, manifest.signature(),
                         MIN_PIECE_WORK if lowered.symbols else 0, _preconditions(lowered), _derived(lowered),
                         _caches(lowered), arena_at, any(uses_tiles(c.kernel.body) for c in lowered.calls))
    return Prepared(manifest, entry, {manifest.weights_file: weights, "kiln_entry.c": entry.encode()}, linker)


def assemble(lowered, objects: dict[str, bytes], target, manifest_extra: dict, store=None,
             object_keys=(), prepared: Prepared | None = None) -> dict:
    """Return the bundle's files as {filename: bytes}; links model.so with the target's C
    compiler (a cross compiler for another architecture), or where there is none keeps the
    objects. With a store, the linked library is cached too: a warm build does not run the
    linker. `prepared`: what prepare() made of the model already."""
    p = prepared or prepare(lowered, target, manifest_extra)
    manifest, entry, linker, files = p.manifest, p.entry, p.linker, dict(p.files)
    if linker is not None:
        key = link_key(list(object_keys), entry, linker) if store is not None else None
        library = store.get(key) if key else None
        if library is None:
            with tempfile.TemporaryDirectory(prefix="kiln-bundle-") as tmp:
                so = os.path.join(tmp, "model.so")
                link_shared(objects, entry, so, linker, store)
                with open(so, "rb") as f:
                    library = f.read()
            if key:
                store.put(key, library)
        files[manifest.library] = library
        manifest.library_bytes, manifest.library_sha256 = len(library), hashlib.sha256(library).hexdigest()
    else:
        for sym, obj in objects.items():
            files[f"objects/{sym}.o"] = obj
    files[MANIFEST] = manifest.to_bytes()
    files[HEADER] = model_header(manifest).encode()
    return files


def _check_replaceable(path: str) -> None:
    """An export replaces only what an export made: a bundle, an empty folder or nothing.
    Anything else at `path` (a file, a cache store, a user's folder) is refused by name."""
    if not os.path.lexists(path):
        return
    if os.path.islink(path) or not os.path.isdir(path):
        raise KilnError(f"'{path}' exists and is not a folder: choose another output path")
    if os.listdir(path) and not os.path.isfile(os.path.join(path, MANIFEST)):
        raise KilnError(f"'{path}' exists and is not a Kiln bundle (no {MANIFEST}); exporting there would "
                        "replace what it holds: choose another output path")


def write_bundle(files: dict[str, bytes], path: str) -> str:
    """Write a bundle folder atomically: build it beside `path`, then swap it in. Only a
    previous bundle (or an empty folder) at `path` is replaced."""
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".kiln-export-", dir=parent)
    try:
        for name, data in files.items():
            full = os.path.join(staging, name)
            os.makedirs(os.path.dirname(full), exist_ok=True)
            if hasattr(data, "write_to"):  # a blob in the store: hard-linked, not rewritten
                data.write_to(full)
                continue
            with open(full, "wb") as f:
                f.write(data)
        with _swap_lock(parent):  # checked here: another export may be mid-swap until now
            _check_replaceable(path)
            _swap_in(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return path


@contextlib.contextmanager
def _swap_lock(parent: str):
    """Exports into one folder take turns at the swap (an flock on the folder itself: no
    lock file is left behind); writing the staging folders runs in parallel."""
    fd = os.open(parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _swap_in(staging: str, path: str) -> None:
    """Replace `path` by `staging`: move the old bundle aside, the new one in, remove the old
    one and any an interrupted export left aside before."""
    prefix = path + ".old-"
    if os.path.lexists(path):
        old = prefix + os.path.basename(staging)
        os.replace(path, old)
    os.replace(staging, path)
    parent, name = os.path.split(prefix)
    for leftover in os.listdir(parent):
        if leftover.startswith(name):
            shutil.rmtree(os.path.join(parent, leftover), ignore_errors=True)
