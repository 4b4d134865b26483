"""Which schedules of one kernel to try next: a local search over its knobs.

A kernel's space is the product of its knobs' choices (KernelCall.space), hundreds of points for
a conv; a tune affords a few dozen trials per kernel. So the search walks it from the rules'
point as a coordinate descent: first every single knob moved away from the rules (the knobs
that matter most first: the conv's path, then the register tile), then, from the best point
measured so far, every single move again, for as long as a move improves it. Starting points
from earlier tunes (a record from another toolchain, a similar kernel's schedule) go first.

Points lowering refuses (a tile that another path's GEMM cannot take) and points whose kernel
is one already tried are skipped without a trial.
"""
from __future__ import annotations

import json

from ..ir.schedule import canonical, normalize

# The order knobs are explored in: the ones that change most first.
KNOB_ORDER = ("conv_path", "tile", "window_rows", "split", "prefetch", "panel_chunk_kib")
IMPROVES = 0.97  # a point must measure this much faster than the best so far to move there
LOSES = 1.1  # a point predicted this much slower than the rules waits until the others are tried


def _ordered(space: dict) -> list:
    return sorted(space, key=lambda k: KNOB_ORDER.index(k) if k in KNOB_ORDER else len(KNOB_ORDER))


class KernelSearch:
    """The search state of one kernel: what was tried, how it measured, what comes next."""

    def __init__(self, space: dict, starts: list[dict] = (), predict=None):
        """predict: point -> expected ratio or None (orchestrator/tune_knowledge.py): the
        queue is tried best-predicted first, points predicted to lose last."""
        self.space = space  # knob -> (choices, default)
        self.predict = predict
        self.tried: dict[str, float | None] = {canonical({}): 1.0}  # point -> ratio (None: failed or pending)
        self.pending: set[str] = set()
        self.skipped: set[str] = set()  # points that were no trial (see skip)
        self.best, self.best_ratio = {}, 1.0
        firsts = [normalize(s) for s in starts if s]
        self._queue = firsts + self._moves({})
        self._starts = len(firsts)  # (tried first, whatever is predicted)
        self._center = canonical({})  # the point whose moves are queued

    def _moves(self, center: dict) -> list[dict]:
        moves = []
        for knob in _ordered(self.space):
            choices, default = self.space[knob]
            for value in choices:
                point = {**center, knob: value}
                if value == default:
                    point.pop(knob)
                moves.append(normalize(point))
        return moves

    def next(self) -> dict | None:
        """The next point to try, or None (nothing left until pending results come in)."""
        while self._queue:
            point = self._queue.pop(0 if self._starts else self._most_promising())
            self._starts = max(0, self._starts - 1)
            key = canonical(point)
            if key not in self.tried:
                self.tried[key] = None
                self.pending.add(key)
                return point
        if not self.pending and canonical(self.best) != self._center:  # moved: explore around the new best
            self._center = canonical(self.best)
            self._queue = self._moves(self.best)
            return self.next()
        return None

    def _most_promising(self) -> int:
        """The queue's index to try next: in order, unless predictions say otherwise."""
        if self.predict is None:
            return 0
        guesses = [self.predict(p) for p in self._queue]
        known = [(g, i) for i, g in enumerate(guesses) if g is not None]
        if not known or min(known)[0] >= 1.0:  # (nothing expected to win: the usual order, losers last)
            return next((i for i, g in enumerate(guesses) if g is None or g < LOSES), 0)
        return min(known)[1]

    def log(self) -> list:
        """(point, ratio or None) of every point measured but the rules' own."""
        return [(json.loads(k), r) for k, r in self.tried.items()
                if k != canonical({}) and k not in self.pending and k not in self.skipped]

    @property
    def exhausted(self) -> bool:
        return not self._queue and not self.pending and canonical(self.best) == self._center

    def skip(self, point: dict) -> None:
        """A point that is no trial (lowering refused it, or its kernel was already tried)."""
        self.pending.discard(canonical(point))
        self.skipped.add(canonical(point))

    def requeue(self, point: dict) -> None:
        """A point whose measurement said nothing about it (another candidate's fault): again, next."""
        key = canonical(point)
        self.pending.discard(key)
        self.tried.pop(key, None)
        self._queue.insert(0, normalize(point))

    def result(self, point: dict, ratio: float | None) -> None:
        key = canonical(point)
        self.pending.discard(key)
        self.tried[key] = ratio
        if ratio is not None and ratio < self.best_ratio * IMPROVES:
            self.best, self.best_ratio = normalize(point), ratio

    def ranked(self, n: int) -> list[tuple[dict, float]]:
        """The n best measured points but the rules' own, best first."""
        done = [(json.loads(k), r) for k, r in self.tried.items() if r is not None and k != canonical({})]
        return sorted(done, key=lambda p: p[1])[:n]
