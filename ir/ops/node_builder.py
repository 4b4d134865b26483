"""NodeBuilder: the nodes an op's expansion (OpDef.expand) or a rewrite creates in its place,
named after the node they replace, so expansions never collide."""
from __future__ import annotations

import numpy as np

from ..graph import Node
from ..symbolic import is_symbolic
from .compile_time import RANGE, symbolic_value_node
from .shape import RESHAPE, TRANSPOSE


def input_at(node: Node, index: int) -> str:
    """The node's input `index`, or "" where it is omitted (an optional input past its end)."""
    return node.inputs[index] if index < len(node.inputs) else ""


def output_at(node: Node, index: int) -> str:
    """The node's output `index`, or "" where it is not asked for."""
    return node.outputs[index] if index < len(node.outputs) else ""


class NodeBuilder:
    def __init__(self, g, node: Node):
        self.g, self.node, self.nodes, self.n = g, node, [], 0

    def _fresh(self, kind: str) -> str:
        """A name of this builder's that nothing in the graph has yet: a node an expansion
        made may expand again, its key its parent's (STFT's DFT writes STFT's output)."""
        while True:
            self.n += 1
            name = f"{self.node.key}/{kind}{self.n}"
            if name not in self.g.constants and name not in self.g.types:
                return name

    def const(self, value) -> str:
        return self.g.add_constant(self._fresh("c"), np.asarray(value))

    def add(self, op: str, inputs: list, out: str = "", **attrs) -> str:
        return self.add_many(op, inputs, [out], **attrs)[0]

    def add_many(self, op: str, inputs: list, outs: list, **attrs) -> list[str]:
        """A node of several outputs; a "" in `outs` gets a name of its own."""
        first = self._fresh(op)
        outs = [o or f"{first}_{i}" for i, o in enumerate(outs)]
        self.nodes.append(Node(op, list(inputs), outs, attrs, f"{self.node.name}/{op}_{self.n}"))
        return outs

    def sizes(self, values) -> str:
        """An int64 vector of sizes (or one size, a scalar), some of which may be symbolic: a
        constant, or a tensor the module computes from the symbols (a Reshape's shape over a
        run-time batch)."""
        values = np.array(values, dtype=object)
        if not any(is_symbolic(v) for v in values.reshape(-1)):
            return self.const(values.astype(np.int64))
        out = self._fresh("sizes")
        self.nodes.append(symbolic_value_node(out, values, "int64"))
        return out

    def reshaped(self, name: str, shape: list) -> str:
        return self.add(RESHAPE, [name, self.sizes(shape)])

    def arange(self, limit) -> str:
        """int64 [limit]: 0, 1, ..., limit - 1 (limit may be symbolic)."""
        return self.add(RANGE, [self.const(np.int64(0)), self.sizes(limit), self.const(np.int64(1))])

    def heads_first(self, x: str, heads: int, head_size: int) -> str:
        """[batch, seq, heads * head_size] -> [batch, heads, seq, head_size]: attention's heads."""
        return self.add(TRANSPOSE, [self.reshaped(x, [0, 0, heads, head_size])], perm=[0, 2, 1, 3])
