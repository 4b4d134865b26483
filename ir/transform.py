"""Pass infrastructure in TVM's grammar: Pass, Sequential, PassContext, instruments.

A pass is a pure Graph -> Graph function with a name and the opt level it needs. The
PassContext in force decides which passes run (opt_level, disabled_pass) and which
instruments watch them (timing, IR dumps), so passes never print.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Callable, Iterable

from .graph import Graph


class PassContext:
    _local = threading.local()

    def __init__(self, opt_level: int = 3, disabled_pass: Iterable[str] = (), config: dict | None = None,
                 instruments: Iterable["PassInstrument"] = ()):
        self.opt_level = opt_level
        self.disabled_pass = set(disabled_pass)
        self.config = dict(config or {})
        self.instruments = list(instruments)

    @classmethod
    def current(cls) -> "PassContext":
        stack = getattr(cls._local, "stack", None)
        return stack[-1] if stack else cls()

    def __enter__(self) -> "PassContext":
        self._local.__dict__.setdefault("stack", []).append(self)
        return self

    def __exit__(self, *exc) -> None:
        self._local.stack.pop()

    def should_run(self, p: "Pass") -> bool:
        return p.opt_level <= self.opt_level and p.name not in self.disabled_pass


class Pass:
    name = "pass"
    opt_level = 0

    def transform(self, graph: Graph, ctx: PassContext) -> Graph:
        raise NotImplementedError

    def __call__(self, graph: Graph, ctx: PassContext | None = None) -> Graph:
        ctx = ctx or PassContext.current()
        if not ctx.should_run(self):
            return graph
        for inst in ctx.instruments:
            inst.run_before_pass(self, graph)
        out = self.transform(graph, ctx)
        for inst in ctx.instruments:
            inst.run_after_pass(self, out)
        return out

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} opt_level={self.opt_level}>"


class FunctionPass(Pass):
    def __init__(self, fn: Callable[[Graph, PassContext], Graph], name: str, opt_level: int):
        self.fn, self.name, self.opt_level = fn, name, opt_level

    def transform(self, graph: Graph, ctx: PassContext) -> Graph:
        return self.fn(graph, ctx)


def graph_pass(opt_level: int = 0, name: str | None = None):
    """Decorator: turn `fn(graph, ctx) -> graph` into a Pass. The graph passed in may be
    changed in place; the pass infrastructure hands each pass its own copy."""
    def wrap(fn):
        def copying(graph: Graph, ctx: PassContext) -> Graph:
            return fn(graph.copy(), ctx)
        return FunctionPass(copying, name or fn.__name__, opt_level)
    return wrap


class Sequential(Pass):
    def __init__(self, passes: Iterable[Pass], name: str = "sequential", opt_level: int = 0):
        self.passes, self.name, self.opt_level = list(passes), name, opt_level

    def transform(self, graph: Graph, ctx: PassContext) -> Graph:
        for p in self.passes:
            graph = p(graph, ctx)
        return graph


class PassInstrument:
    def run_before_pass(self, p: Pass, graph: Graph) -> None:
        pass

    def run_after_pass(self, p: Pass, graph: Graph) -> None:
        pass


class PassTimingInstrument(PassInstrument):
    """Wall time of each pass, in the order they ran."""

    def __init__(self):
        self.timings: list[tuple[str, float]] = []
        self._start: list[float] = []

    def run_before_pass(self, p, graph):
        self._start.append(time.perf_counter())

    def run_after_pass(self, p, graph):
        self.timings.append((p.name, (time.perf_counter() - self._start.pop()) * 1000))

    def render(self) -> str:
        return "\n".join(f"{name:32s} {ms:9.2f} ms" for name, ms in self.timings)


class DumpIR(PassInstrument):
    """Write the graph after every pass to DIR/NN_<pass>.txt."""

    def __init__(self, directory: str):
        self.directory, self.count = directory, 0
        os.makedirs(directory, exist_ok=True)

    def run_after_pass(self, p, graph):
        if isinstance(p, Sequential):
            return
        path = os.path.join(self.directory, f"{self.count:02d}_{p.name}.txt")
        with open(path, "w") as f:
            f.write(graph.summary() + "\n")
        self.count += 1
