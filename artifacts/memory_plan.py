"""Static memory planning: every intermediate tensor and workspace gets an offset in one arena.

Buffers whose lifetimes (first write .. last read, in kernel order) overlap never share
bytes; the rest are packed greedily, largest first, at the lowest offset that fits, the
way TFLite's arena planner does. A kernel's outputs are live at its own step, as are its
inputs, so a kernel never writes over what it reads.
"""
from __future__ import annotations

ALIGN = 64


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_arena(lifetimes: dict[str, tuple[int, int]], sizes: dict[str, int]) -> tuple[dict[str, int], int]:
    """lifetimes: buffer -> (first step, last step), inclusive; sizes in bytes.
    Returns (offset of each buffer, arena size in bytes)."""
    placed: list[tuple[int, int, int, int]] = []  # offset, end, first, last
    offsets: dict[str, int] = {}
    for name in sorted(lifetimes, key=lambda n: (-sizes[n], n)):
        first, last = lifetimes[name]
        size = _align(max(sizes[name], 1))
        busy = sorted((o, e) for o, e, f, l in placed if f <= last and first <= l)
        offset = 0
        for o, e in busy:
            if offset + size <= o:
                break
            offset = max(offset, _align(e))
        offsets[name] = offset
        placed.append((offset, offset + size, first, last))
    return offsets, max((e for _, e, _, _ in placed), default=0)


def directly_beneath(offsets: dict[str, int], lifetimes: dict[str, tuple[int, int]]) -> dict[str, list[str]]:
    """Each buffer's neighbours beneath it in a plan: the buffers live at the same time at
    lower offsets, less those beneath one of the others (one step of transitive reduction).

    Every buffer placed at the greatest (aligned) end of its neighbours beneath is a valid
    plan for any sizes: each pair live at once keeps its order, and nothing moves up where
    sizes shrink. With sizes known only at run time the entry so packs a call's buffers
    for its own sizes (`plan_arena`'s offsets, at the bounds, are the most they reach)."""
    order = sorted(offsets, key=lambda n: (offsets[n], n))
    below: dict[str, set] = {}
    for i, y in enumerate(order):
        first, last = lifetimes[y]
        below[y] = {x for x in order[:i] if offsets[x] < offsets[y]
                    and lifetimes[x][0] <= last and first <= lifetimes[x][1]}
    out = {}
    for y in order:
        covered = set().union(*(below[z] for z in below[y])) if below[y] else set()
        out[y] = sorted(below[y] - covered, key=lambda n: (offsets[n], n))
    return out


def pack_constants(arrays: dict, out, pieces=lambda v: (v,)) -> dict[str, int]:
    """Lay constants out back to back (64-byte aligned, by name) in one blob, written to
    `out` (anything with write()): the weights file. Returns their offsets. pieces(entry)
    gives an entry's values as arrays in order, so one may be computed just when it is
    written (ir/deferred.py): a few MB are held at a time, never the whole blob."""
    offsets, pos = {}, 0
    for name in sorted(arrays):
        offsets[name] = pos
        pos += _align(arrays[name].nbytes)
    written = 0
    for name, off in offsets.items():
        out.write(bytes(off - written))  # (zero padding)
        written = off
        for piece in pieces(arrays[name]):
            if piece.nbytes:  # as bytes: a buffer of float16 or bfloat16 elements has no memoryview format
                out.write(memoryview(piece.reshape(-1).view("u1")))
            written += piece.nbytes
    out.write(bytes(pos - written))
    return offsets