"""A kernel's schedule as data: the knobs its code depends on, their choices and their values.

Lowering makes a choice wherever a kernel's code could be written more than one way (a GEMM's
register tile, a conv's path, a depthwise window's passes). Each such choice is a *knob*:
`KernelBuilder.knob(name, default, choices)` returns the value the kernel's schedule gives, or
the hand-written rule's (`default`), and notes the choices, so lowering one kernel with the
defaults also says what could be tuned in it (`KernelCall.space`). A *schedule* is the dict of
knobs set away from their defaults: {} is today's rules, and a schedule names only knobs the
kernel consulted. Knobs that change the generated code rather than the loop nest (prefetching,
B's chunking) travel to codegen in `Kernel.schedule` (`CODEGEN_OPTIONS`), checked by ir.verify.

Records of tuned schedules (orchestrator/tuning_records.py) hold this module's
`SPACE_VERSION`: bump it whenever a knob's meaning or choices change, so that no record
measured for another space is ever applied.

Pure data: imported by lowering, the verifier and the tuner alike.
"""
from __future__ import annotations

import json

SPACE_VERSION = 1

# name -> what it decides. The one list of knobs: lowering consults no other, and a schedule
# naming anything else is refused.
KNOBS = {
    "tile": "a GEMM's register tile (rows, columns): rows x columns/vector accumulators",
    "reduce_interleave": "partial results a vectorized reduction keeps in flight (LLVM's interleave count)",
    "piece_work": "estimated operations in each part a phase is divided into across threads",
    "split": "how threads divide a GEMM phase: by row blocks ('m') or column panels ('n')",
    "conv_path": "a conv's GEMM form: 'implicit' (input read in place), 'im2col', 'pointwise' "
                 "(weights x input, 1x1), 'weights_rows' (few output channels), 'winograd' (F(2x2, 3x3)) "
                 "or 'winograd4' (F(4x4, 3x3))",
    "window_rows": "depthwise window rows summed per pass over an output row",
    "prefetch": "packed B prefetched into L2 by the micro-kernel: 'auto' (past 512 KiB), 'off', 'on'",
    "panel_chunk_kib": "KiB of packed B every row block passes over before the next chunk",
    "tile_unit": "an 8-bit GEMM on AMX's tile unit ('on') or AVX-512 VNNI ('off'), where the target has both",
}

# Knobs read by codegen, carried in Kernel.schedule, with the values it accepts.
CODEGEN_OPTIONS = {"prefetch": ("auto", "off", "on"), "panel_chunk_kib": (96, 192, 384, 768, 1536),
                   "reduce_interleave": (1, 2, 4, 8), "piece_work": (37_500, 75_000, 150_000, 300_000, 600_000)}
PANEL_CHUNK_KIB = 384  # the rule's: B's chunk stays in L2 with A's rows beside it
REDUCE_INTERLEAVE = 4  # the rule's: one chain of vector adds or maxes waits on each step's latency
# Knobs that only change how threads share a kernel: not tuned for one thread.
THREAD_KNOBS = ("piece_work",)


class ScheduleError(ValueError):
    """A schedule that does not fit the kernel it is applied to."""


def gemm_tiles(vector_width: int, n: int) -> tuple:
    """The register tiles a float GEMM of n columns may take at this vector width: every one
    fits the register file (accumulators + B's vectors + a broadcast), 32 vectors at 16 lanes,
    16 at 8 (AVX2), 32 at 4 (NEON; SSE's 16 hold the smaller ones)."""
    vw = vector_width
    if vw >= 16:
        wide = ((14, 32), (12, 32), (8, 32), (6, 64), (4, 64), (8, 48), (28, 16))
        narrow = ((28, 16), (24, 16), (16, 16), (8, 16))
    elif vw == 8:
        wide = ((6, 16), (4, 16), (5, 16), (4, 24), (2, 32), (12, 8))
        narrow = ((12, 8), (8, 8), (14, 8), (6, 8))
    else:
        wide = ((6, 8), (4, 8), (8, 8), (4, 16), (12, 4))
        narrow = ((12, 4), (8, 4), (6, 4))
    return narrow if n <= vw else wide


def canonical(schedule: dict) -> str:
    """A schedule's canonical text: what a record stores and what keys compare."""
    return json.dumps(normalize(schedule), sort_keys=True, separators=(",", ":"))


def normalize(schedule: dict) -> dict:
    """Tuples as lists (JSON's form) and knobs sorted: equal schedules compare equal."""
    return {k: list(v) if isinstance(v, (tuple, list)) else v for k, v in sorted(schedule.items())}


def check(schedule) -> dict:
    """A schedule read from outside (a record): a dict of known knobs to JSON scalars or short
    lists of ints. Raises ScheduleError naming what is wrong."""
    if not isinstance(schedule, dict):
        raise ScheduleError(f"a schedule is a dict of knobs, not {type(schedule).__name__}")
    schedule = normalize(schedule)
    for name, value in schedule.items():
        if name not in KNOBS:
            raise ScheduleError(f"unknown knob '{name}' (known: {', '.join(KNOBS)})")
        plain = isinstance(value, (str, int)) and not isinstance(value, bool)
        ints = isinstance(value, list) and len(value) <= 4 and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value)
        if not (plain or ints):
            raise ScheduleError(f"knob '{name}' has a value of the wrong kind: {value!r}")
    return schedule


def value_of(choice):
    """A knob's value as lowering compares it: a list read from JSON is the tuple it was."""
    return tuple(choice) if isinstance(choice, list) else choice
