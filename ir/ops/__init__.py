"""Kiln's operators, one definition each (see registry.py), grouped by family."""
from . import (bert_fusions, col2im, compile_time, control_flow, conv_gemm, counted_sizes, determinant, einsum,
               elementwise, functions, gather_block_quantized, grid_sample, group_query_attention, indexing, kv_cache,
               matmul_nbits, old_names, pool_indices, quantize, recurrent, recurrent_quantized, reduce, roi_align,
               rotary, sequences, shape, skip_norms, spectral, unique)
from .registry import (BROADCAST, ELEMWISE, INJECTIVE, OPAQUE, OUT_EWISE_FUSABLE, REDUCTION, REGISTRY, OpDef,
                       op_def)

# (importing each registers its ops)
FAMILIES = (elementwise, shape, indexing, grid_sample, reduce, skip_norms, pool_indices, conv_gemm, einsum, quantize,
            matmul_nbits, gather_block_quantized, rotary, group_query_attention, bert_fusions, recurrent,
            recurrent_quantized, control_flow, compile_time, functions, kv_cache, counted_sizes, roi_align, spectral,
            determinant, old_names, col2im, unique, sequences)
SUPPORTED_OPS = sorted(REGISTRY)

__all__ = ["FAMILIES", "OpDef", "op_def", "REGISTRY", "SUPPORTED_OPS", "ELEMWISE", "BROADCAST", "INJECTIVE", "REDUCTION",
           "OUT_EWISE_FUSABLE", "OPAQUE"]
