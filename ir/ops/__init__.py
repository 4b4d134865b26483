"""Kiln's operators, one definition each (see registry.py), grouped by family."""
from . import (compile_time, control_flow, conv_gemm, einsum, elementwise, functions, grid_sample, indexing,
               kv_cache, matmul_nbits, pool_indices, quantize, recurrent, recurrent_quantized, reduce, shape)
from .registry import (BROADCAST, ELEMWISE, INJECTIVE, OPAQUE, OUT_EWISE_FUSABLE, REDUCTION, REGISTRY, OpDef,
                       op_def)

FAMILIES = (elementwise, shape, indexing, grid_sample, reduce, pool_indices, conv_gemm, einsum, quantize, matmul_nbits,
            recurrent, recurrent_quantized, control_flow, compile_time, functions, kv_cache)  # importing each registers its ops
SUPPORTED_OPS = sorted(REGISTRY)

__all__ = ["FAMILIES", "OpDef", "op_def", "REGISTRY", "SUPPORTED_OPS", "ELEMWISE", "BROADCAST", "INJECTIVE", "REDUCTION",
           "OUT_EWISE_FUSABLE", "OPAQUE"]
