"""Numpy-style broadcasting of shapes, as ONNX defines it for its multidirectional ops."""
from __future__ import annotations

import numpy as np

from ..graph import Node, ShapeError
from ..symbolic import require_equal, shape_is_static


def broadcast(shapes, node: Node) -> tuple:
    if all(shape_is_static(s) for s in shapes):
        try:
            return tuple(int(d) for d in np.broadcast_shapes(*shapes))
        except ValueError:
            raise ShapeError(f"{node.describe()}: input shapes {' and '.join(map(str, shapes))} do not broadcast")
    return _broadcast_symbolic(shapes, node)


def _broadcast_symbolic(shapes, node: Node) -> tuple:
    """A symbolic dim is never a broadcast 1 (as TVM and IREE assume); it meets a static 1, or
    a size it must then equal at run time (the module checks before it runs)."""
    rank = max(len(s) for s in shapes)
    out = []
    for axis in range(rank):
        sizes = list(dict.fromkeys(s[axis - rank + len(s)] for s in shapes if axis - rank + len(s) >= 0))
        sizes = [d for d in sizes if not (isinstance(d, int) and d == 1)]
        if len([d for d in sizes if isinstance(d, int)]) > 1:
            raise ShapeError(f"{node.describe()}: input shapes {' and '.join(map(str, shapes))} do not broadcast")
        size = sizes[0] if sizes else 1
        for other in sizes[1:]:
            size = require_equal(size, other, f"{node.describe()}, axis {axis}")
        out.append(size)
    return tuple(out)
