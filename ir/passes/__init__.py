"""Graph passes and the default pipeline."""
from ..transform import Sequential
from .eliminate_common_subexpr import eliminate_common_subexpr
from .eliminate_dead_code import eliminate_dead_code
from .elementwise_before_layout import elementwise_before_layout
from .fuse_ops import fuse_ops, groups_of
from .infer_types import fold_constants, infer_types
from .integer_products import integer_products
from .kv_cache import bind_kv_caches
from .quantized_moves import quantized_moves
from .simplify_inference import simplify_inference
from .trim_conv_windows import trim_conv_windows
from .weight_only_blocks import weight_only_blocks
from .widen_half_products import widen_half_products


def default_pipeline(extra=()) -> Sequential:
    """The passes `build` runs, in order; `extra` passes run before fusion. Types and
    parameters are inferred again right before fusion, for whatever the passes between
    rewrote or added (a custom pass adds plain ONNX-style nodes and nothing else)."""
    return Sequential([infer_types, integer_products, weight_only_blocks, quantized_moves, fold_constants,
                       widen_half_products, simplify_inference, trim_conv_windows, elementwise_before_layout,
                       eliminate_common_subexpr, eliminate_dead_code,
                       *extra, infer_types, bind_kv_caches, fuse_ops],
                      name="default_pipeline")


__all__ = ["default_pipeline", "infer_types", "integer_products", "weight_only_blocks", "quantized_moves",
           "fold_constants", "widen_half_products", "simplify_inference", "trim_conv_windows",
           "elementwise_before_layout",
           "eliminate_common_subexpr", "eliminate_dead_code", "bind_kv_caches", "fuse_ops", "groups_of"]
