"""infer_types and fold_constants: one walk in topological order (ir/ops/inference.py).

Both evaluate nodes whose inputs are all constants. infer_types folds only what shapes
depend on (int64/bool results, Shape, Range, ConstantOfShape), which is what makes the
Shape->Gather->Concat->Reshape chains of PyTorch's exporter static; fold_constants folds
float math on weights too.
"""
from __future__ import annotations

from ..graph import Graph
from ..ops.inference import resolve
from ..transform import graph_pass


@graph_pass(opt_level=0)
def infer_types(g: Graph, ctx) -> Graph:
    return resolve(g, fold_floats=False)


@graph_pass(opt_level=1)
def fold_constants(g: Graph, ctx) -> Graph:
    return resolve(g, fold_floats=True)
