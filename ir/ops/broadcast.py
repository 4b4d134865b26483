"""Numpy-style broadcasting of shapes, as ONNX defines it for its multidirectional ops."""
from __future__ import annotations

import numpy as np

from ..graph import Node, ShapeError
from ..symbolic import shape_is_static


def broadcast(shapes, node: Node) -> tuple:
    if all(shape_is_static(s) for s in shapes):
        try:
            return tuple(int(d) for d in np.broadcast_shapes(*shapes))
        except ValueError:
            raise ShapeError(f"{node.describe()}: input shapes {' and '.join(map(str, shapes))} do not broadcast")
    return _broadcast_symbolic(shapes, node)


def _broadcast_symbolic(shapes, node: Node) -> tuple:
    """A symbolic dim is never a broadcast 1 (as TVM and IREE assume); it meets a static 1 or
    itself. Meeting another size is refused for now (a TypeError: not supported yet)."""
    rank = max(len(s) for s in shapes)
    out = []
    for axis in range(rank):
        sizes = {s[axis - rank + len(s)] for s in shapes if axis - rank + len(s) >= 0} - {1}
        if len(sizes) > 1:
            if all(isinstance(d, int) for d in sizes):
                raise ShapeError(f"{node.describe()}: input shapes {' and '.join(map(str, shapes))} do not broadcast")
            raise TypeError(f"sizes {' and '.join(map(str, sizes))} must agree at run time")
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)
