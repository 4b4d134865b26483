"""Loops the entry function runs: a long Loop's or Scan's body is lowered once and called
once per iteration, over the same buffers (ir/ops/control_flow.py decides which stay loops).

The body is a graph of its own (`loop_body_graph`): its inputs are the iteration number (a
Loop's), its carried state, a slice of each scanned tensor (a Scan's) and the tensors it
reads from the graph around it; it goes through the whole pass pipeline and lowering, and
its tensors are renamed into the model's namespace under the node's key. The entry function
then runs:

    state <- initial values
    (if start_if holds:)
    for it in 0 .. trip - 1 (trip read from `count` at run time, or no limit):
        iteration <- it;  each slice <- row it of its scanned tensor (from the end: reversed)
        the body's kernels
        row it of each scan output <- the body's slice;  state <- the values the body leaves
        (with `until`: stop if the body's condition output is false)
    (`iterations`, where the scan outputs' length is what it ran: the iterations run)
    (the node's state outputs are the state buffers)
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import KilnError
from ..symbolic import Dim


@dataclass
class LoopCall:
    trip: "int | Dim"  # iterations (a Dim: a size known at run time)
    steps: list  # KernelCall | LoopCall: the body, in the model's tensor names
    iteration: str  # the int64 scalar holding the iteration number ("": the body takes none)
    state: list  # (initial value, state buffer the body reads, value the body leaves) per carried value
    feeds: list  # (scanned tensor, the slice buffer the body reads, reversed?) per scan input
    scans: list  # (one iteration's slice, the stacked output, reversed?) per scan output
    name: str
    guard: tuple = ()
    count: str = ""  # an int64 scalar: the trip count, read at run time ("": `trip`, or none)
    start_if: str = ""  # a bool: the loop runs only if it holds ("": always)
    until: str = ""  # the body's bool condition output: the loop stops after an iteration leaving it false
    iterations: str = ""  # an int64 scalar the loop writes the number of iterations it ran to (a counted size)

    def kernel_calls(self) -> list:
        return flatten(self.steps)

    def tensors(self) -> set:
        """The tensors the loop's own copies touch (not its body's kernels')."""
        return ({self.iteration, self.count, self.start_if, self.until, self.iterations} - {""}) | \
            {t for triple in self.state for t in triple} | \
            {t for whole, part, _ in self.feeds + self.scans for t in (whole, part)}


def all_loops(steps: list):
    """Every LoopCall in `steps`, nested ones included."""
    for s in steps:
        if isinstance(s, LoopCall):
            yield s
            yield from all_loops(s.steps)


def flatten(steps: list) -> list:
    """The kernel calls of `steps`, in order, each loop's body once."""
    out = []
    for s in steps:
        out += s.kernel_calls() if isinstance(s, LoopCall) else [s]
    return out


def lower_loop(g, node, config, lower) -> tuple:
    """(LoopCall, the body's LoweredModel renamed into the model's namespace)."""
    from ..ops.control_flow import captured_inputs, loop_body_graph
    from ..passes import default_pipeline
    from ..transform import PassContext

    body, iteration, state_in, slices_in, leaves, scans = loop_body_graph(g, node)
    ctx = PassContext(opt_level=3)
    with ctx:
        body = default_pipeline()(body, ctx)
    inner = lower(body, config)
    if list(body.symbols) != list(g.symbols):  # (the body's kernels index the model's dims[] by these)
        raise KilnError(f"{node.describe()}: its body's sizes {list(body.symbols)} are not the model's "
                        f"{list(g.symbols)}")
    keep = set(captured_inputs(node))
    prefix = f"{node.key}/body/"

    def rename(t: str) -> str:
        return t if not t or t in keep else prefix + t
    inner = renamed(inner, rename)
    a, n = node.attrs, len(state_in)
    call = LoopCall(a["trip"] if isinstance(a["trip"], Dim) else int(a["trip"]), inner.steps, rename(iteration),
                    [(init, rename(s), inner.storage(rename(o))) for init, s, o in zip(node.inputs, state_in, leaves)],
                    [(whole, rename(s), bool(d)) for whole, s, d in zip(node.inputs[n:], slices_in, a["in_dirs"])],
                    [(inner.storage(rename(o)), out, bool(d)) for o, out, d in zip(scans, node.outputs[n:], a["out_dirs"])],
                    f"loop_{node.name}"[:60], node.guard, a.get("count", ""), a.get("start_if", ""),
                    inner.storage(rename(node.attrs["body"].outputs[0])) if a.get("until") else "",
                    node.outputs[-1] if a.get("iterations") else "")
    return call, inner


def renamed(model, rename):
    """A LoweredModel with every tensor name passed through `rename`."""
    from dataclasses import replace

    def step(s):
        if isinstance(s, LoopCall):
            return replace(s, steps=[step(x) for x in s.steps], iteration=rename(s.iteration),
                           state=[tuple(map(rename, t)) for t in s.state],
                           feeds=[(rename(w), rename(p), r) for w, p, r in s.feeds],
                           scans=[(rename(p), rename(w), r) for p, w, r in s.scans],
                           guard=tuple((rename(t), v) for t, v in s.guard), count=rename(s.count),
                           start_if=rename(s.start_if), until=rename(s.until), iterations=rename(s.iterations))
        return replace(s, outputs=[rename(t) for t in s.outputs], inputs=[rename(t) for t in s.inputs],
                       guard=tuple((rename(t), v) for t, v in s.guard))
    return replace(model, steps=[step(s) for s in model.steps], inputs=[rename(t) for t in model.inputs],
                   outputs=[rename(t) for t in model.outputs], types={rename(k): v for k, v in model.types.items()},
                   constants={rename(k): v for k, v in model.constants.items()},
                   aliases={rename(k): rename(v) for k, v in model.aliases.items()})
