"""Numpy-style broadcasting of shapes, as ONNX defines it for its multidirectional ops."""
from __future__ import annotations

import numpy as np

from ..graph import Node, ShapeError


def broadcast(shapes, node: Node) -> tuple[int, ...]:
    try:
        return tuple(int(d) for d in np.broadcast_shapes(*shapes))
    except ValueError:
        raise ShapeError(f"{node.describe()}: input shapes {' and '.join(map(str, shapes))} do not broadcast")
