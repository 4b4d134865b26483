"""Kiln's graph level: ONNX frontend, graph IR, passes, and lowering to loop-nest kernels.

Exports load lazily: a codegen worker imports `ir.loop` (plain data) without pulling in
numpy or onnx.
"""
_EXPORTS = {
    "Graph": "graph", "Node": "graph", "TensorType": "graph", "KilnError": "graph", "ShapeError": "graph",
    "UnsupportedError": "graph", "from_onnx": "frontend_onnx",
    "Pass": "transform", "PassContext": "transform", "PassInstrument": "transform", "Sequential": "transform",
    "PassTimingInstrument": "transform", "DumpIR": "transform", "graph_pass": "transform",
}


def __getattr__(name):
    if name in _EXPORTS:
        import importlib
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(name)
