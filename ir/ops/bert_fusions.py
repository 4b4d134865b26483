"""The fused ops onnxruntime's transformer optimizer writes into BERT-style encoders (what
`onnxruntime.transformers.optimizer` and HF optimum's ORTOptimizer save as an optimized
model): com.microsoft.EmbedLayerNormalization, Attention, MultiHeadAttention, Gelu,
BiasGelu, FastGelu and QuickGelu (SkipLayerNormalization: ir/ops/skip_norms.py). Each is
built from ONNX's ops, so the encoder compiles as the unfused export does: the QKV
projection one GEMM against its weight, attention MatMul -> Softmax -> MatMul, activations
in their GEMM's epilogue.
"""
from __future__ import annotations

import numpy as np

from ..dtypes import DTYPES, numpy_dtype
from ..graph import Node, ShapeError, UnsupportedError
from ..symbolic import is_symbolic
from .compile_time import RANGE
from .conv_gemm import MATMUL
from .elementwise import ADD, AND, CAST, GELU, GREATER_OR_EQUAL, LESS, LESS_OR_EQUAL, MUL, SIGMOID, WHERE
from .functions import ATTENTION as ONNX_ATTENTION
from .node_builder import NodeBuilder, input_at, output_at
from .quantize import CONTRIB
from .reduce import LAYER_NORMALIZATION, REDUCE_SUM, SOFTMAX
from .registry import OPAQUE, OpDef, expanded_only, register
from .shape import CONCAT, GATHER, IDENTITY, RESHAPE, SLICE, SPLIT, TRANSPOSE, UNSQUEEZE

ATTENTION, EMBED_LAYER_NORMALIZATION = CONTRIB + ONNX_ATTENTION, CONTRIB + "EmbedLayerNormalization"
MULTI_HEAD_ATTENTION = CONTRIB + "MultiHeadAttention"
INT32, INT64, BOOL = (DTYPES[t].onnx for t in ("int32", "int64", "bool"))  # (Cast's `to` codes)


# ---- activations ------------------------------------------------------------------------------

def _expand_gelu(g, node: Node) -> list[Node]:
    return [Node(GELU, [node.inputs[0]], [node.outputs[0]], {}, node.name)]


def _expand_bias_gelu(g, node: Node) -> list[Node]:
    body = NodeBuilder(g, node)
    body.add(GELU, [body.add(ADD, node.inputs[:2])], node.outputs[0])
    return body.nodes


def _expand_fast_gelu(g, node: Node) -> list[Node]:
    """0.5 x (1 + tanh(0.797885 x + 0.035677 x^3)): ONNX's tanh Gelu, of x + bias."""
    body = NodeBuilder(g, node)
    x = body.add(ADD, node.inputs[:2]) if input_at(node, 1) else node.inputs[0]
    body.add(GELU, [x], node.outputs[0], approximate="tanh")
    return body.nodes


def _expand_quick_gelu(g, node: Node) -> list[Node]:
    """x * sigmoid(alpha x)."""
    body = NodeBuilder(g, node)
    x = node.inputs[0]
    alpha = numpy_dtype(g.types[x].dtype).type(node.attrs.get("alpha", 1.702))
    body.add(MUL, [x, body.add(SIGMOID, [body.add(MUL, [x, body.const(alpha)])])], node.outputs[0])
    return body.nodes


# ---- EmbedLayerNormalization ---------------------------------------------------------------

def _expand_embed_layer_normalization(g, node: Node) -> list[Node]:
    """LayerNormalization(word[ids] + position[positions] (+ segment[segment_ids])), with
    mask_index the number of ones in each mask row (int32) and embedding_sum the sum before
    the normalization."""
    ids, segment_ids, words, positions_table, segments = (input_at(node, i) for i in range(5))
    gamma, beta, mask, position_ids = (input_at(node, i) for i in range(5, 9))
    if bool(segment_ids) != bool(segments):
        raise ShapeError(f"{node.describe()}: segment_ids and segment_embedding come together")
    body = NodeBuilder(g, node)
    seq = g.types[ids].shape[1]
    if not position_ids:
        position_ids = body.arange(seq)
    total = body.add(ADD, [body.add(GATHER, [words, ids], axis=0), body.add(GATHER, [positions_table, position_ids],
                                                                              axis=0)])
    if segment_ids:
        total = body.add(ADD, [total, body.add(GATHER, [segments, segment_ids], axis=0)])
    if output_at(node, 2):
        total = body.add(IDENTITY, [total], node.outputs[2])
    body.add(LAYER_NORMALIZATION, [total, gamma, beta], node.outputs[0] or "", axis=-1,
             epsilon=float(node.attrs.get("epsilon", 1e-12)))
    if output_at(node, 1):
        if not mask:
            raise UnsupportedError(f"{node.describe()}: output mask_index needs the mask input")
        body.add(CAST, [body.add(REDUCE_SUM, [mask, body.const(np.array([1], np.int64))], keepdims=0)],
                 node.outputs[1], to=INT32)
    return body.nodes


# ---- Attention ----------------------------------------------------------------------------

def _hidden_sizes(g, node: Node) -> tuple[int, int, int]:
    width = g.types[node.inputs[1]].shape[1]
    sizes = node.attrs.get("qkv_hidden_sizes")
    sizes = [int(v) for v in sizes] if sizes is not None and len(sizes) else [width // 3] * 3
    heads = int(node.attrs["num_heads"])
    if len(sizes) != 3 or sum(sizes) != width or sizes[0] != sizes[1] or any(v % heads for v in sizes):
        raise ShapeError(f"{node.describe()}: weights {g.types[node.inputs[1]]} do not split into Q, K and V of "
                         f"{sizes} ({heads} heads each; Q and K alike)")
    return tuple(sizes)


def _allowed_keys(body: NodeBuilder, node: Node, mask: str, batch, seq, unidirectional: bool, total=None,
                  past=0) -> str | None:
    """bool, broadcast against the scores [batch, heads, seq, total] (total keys, past of
    them cached; total is seq without): may a query see a key? From the mask as onnxruntime
    reads its shapes: [batch] (each row's length, right padding), [2 * batch] (ends, then
    starts: left padding), [batch, total] or [batch, seq, total] (1 keeps, 0 masks); and
    causal where unidirectional (query i sees keys up to past + i)."""
    g = body.g
    total = seq if total is None else total
    keys = body.arange(total)
    allowed = None
    if mask:
        shape = g.types[mask].shape
        column = body.const(np.array([-1, 1, 1, 1], np.int64))
        if len(shape) == 1:  # (lengths, or ends then starts)
            bounds = body.add(CAST, [mask], to=INT64)
            if shape[0] == batch:
                allowed = body.add(LESS, [keys, body.add(RESHAPE, [bounds, column])])
            elif shape[0] != 2 * batch:
                raise UnsupportedError(f"{node.describe()}: mask_index {g.types[mask]} is neither [batch] nor "
                                       "[2 * batch] (the 3 * batch + 2 form is not supported)")
            else:
                def half(first, last):
                    part = body.add(SLICE, [bounds, body.sizes([first]), body.sizes([last]),
                                            body.const(np.array([0], np.int64))])
                    return body.add(RESHAPE, [part, column])
                ends, starts = half(0, batch), half(batch, 2 * batch)
                allowed = body.add(AND, [body.add(LESS, [keys, ends]), body.add(GREATER_OR_EQUAL, [keys, starts])])
        elif len(shape) == 2:  # [batch, keys]
            keep = body.add(CAST, [mask], to=BOOL)
            allowed = body.add(RESHAPE, [keep, body.const(np.array([0, 1, 1, -1], np.int64))])
        elif len(shape) == 3:  # [batch, seq, keys]
            allowed = body.add(UNSQUEEZE, [body.add(CAST, [mask], to=BOOL), body.const(np.array([1], np.int64))])
        else:
            raise UnsupportedError(f"{node.describe()}: mask_index {g.types[mask]} (4-D, Megatron's) is not supported")
    if unidirectional:
        last = body.add(RANGE, [body.sizes(past), body.sizes(past + seq), body.const(np.int64(1))])
        causal = body.add(LESS_OR_EQUAL, [keys, body.add(UNSQUEEZE, [last, body.const(np.array([-1], np.int64))])])
        allowed = causal if allowed is None else body.add(AND, [allowed, causal])
    return allowed


def _expand_attention(g, node: Node) -> list[Node]:
    """softmax(Q K^T * scale + mask) V per head, Q, K and V one GEMM of the input and the
    merged weights (and bias); a masked score gets mask_filter_value added, as onnxruntime
    does (so a row masked whole averages its values instead of giving NaN)."""
    for i, name in ((4, "past"), (5, "attention_bias"), (6, "past_sequence_length")):
        if input_at(node, i):
            raise UnsupportedError(f"{node.describe()}: input {i} ({name}) is not supported")
    for name in ("do_rotary", "past_present_share_buffer"):
        if node.attrs.get(name, 0):
            raise UnsupportedError(f"{node.describe()}: {name}={node.attrs[name]} is not supported")
    if output_at(node, 1):
        raise UnsupportedError(f"{node.describe()}: output 1 (present) is not supported: the past is not")
    x = g.types[node.inputs[0]]
    if len(x.shape) != 3 or is_symbolic(x.shape[2]):
        raise ShapeError(f"{node.describe()}: input {x} must be [batch, seq, hidden] with a fixed hidden size")
    heads = int(node.attrs["num_heads"])
    q_size, _, v_size = _hidden_sizes(g, node)
    batch, seq = x.shape[0], x.shape[1]
    body = NodeBuilder(g, node)
    dtype = numpy_dtype(x.dtype)
    qkv = body.add(MATMUL, node.inputs[:2])
    if input_at(node, 2):
        qkv = body.add(ADD, [qkv, node.inputs[2]])
    q, k, v = body.add_many(SPLIT, [qkv, body.const(np.array([q_size, q_size, v_size], np.int64))], ["", "", ""],
                            axis=2)
    scale = float(node.attrs.get("scale", 0.0)) or 1.0 / float(np.sqrt(q_size // heads))
    q = body.add(MUL, [body.heads_first(q, heads, q_size // heads), body.const(dtype.type(scale))])
    k = body.heads_first(k, heads, q_size // heads)
    scores = body.add(MATMUL, [q, body.add(TRANSPOSE, [k], perm=[0, 1, 3, 2])])
    allowed = _allowed_keys(body, node, input_at(node, 3), batch, seq, bool(node.attrs.get("unidirectional", 0)))
    _attend(body, node, scores, allowed, body.heads_first(v, heads, v_size // heads), v_size, dtype)
    return body.nodes


def _attend(body: NodeBuilder, node: Node, scores: str, allowed: str | None, values: str, v_size: int, dtype) -> None:
    """The node's output: softmax over the scores, mask_filter_value added where a key is
    not allowed, times the values [batch, heads, keys, v_size / heads], heads merged."""
    if allowed is not None:
        masked = body.const(dtype.type(node.attrs.get("mask_filter_value", -10000.0)))
        scores = body.add(ADD, [scores, body.add(WHERE, [allowed, body.const(dtype.type(0)), masked])])
    context = body.add(MATMUL, [body.add(SOFTMAX, [scores], axis=-1), values])
    merged = body.add(TRANSPOSE, [context], perm=[0, 2, 1, 3])
    body.add(RESHAPE, [merged, body.const(np.array([0, 0, v_size], np.int64))], node.outputs[0])


def _expand_multi_head_attention(g, node: Node) -> list[Node]:
    """com.microsoft.MultiHeadAttention with query [batch, seq, d], key and value [batch,
    keys, d or d_v] (self or cross attention): the projections' bias added, heads split,
    scores scaled, attention_bias added, key_padding_mask and unidirectional masked as
    Attention's, and a past [batch, heads, past, head] extended by this call's keys and
    values (present = Concat(past, new), kept in place like any KV cache)."""
    for i, name in ((8, "past_sequence_length"), (9, "cache_indirection")):
        if input_at(node, i):
            raise UnsupportedError(f"{node.describe()}: input {i} ({name}) is not supported")
    if output_at(node, 3):
        raise UnsupportedError(f"{node.describe()}: output 3 (qk) is not supported")
    query, key, value, bias, mask, attention_bias, past_key, past_value = (input_at(node, i) for i in range(8))
    heads = int(node.attrs["num_heads"])
    q = g.types[query]
    if not (key and value) or len(q.shape) != 3 or len(g.types[key].shape) != 3 or \
            len(g.types[value].shape) != 3:
        raise UnsupportedError(f"{node.describe()}: only query, key and value of [batch, seq, hidden] are supported "
                               "(not the packed or BNSH forms)")
    if bool(past_key) != bool(past_value):
        raise ShapeError(f"{node.describe()}: past_key and past_value come together")
    d, v_size = q.shape[2], g.types[value].shape[2]
    if is_symbolic(d) or is_symbolic(v_size) or d % heads or v_size % heads or g.types[key].shape[2] != d:
        raise ShapeError(f"{node.describe()}: query {q}, key {g.types[key]} and value {g.types[value]} do not split "
                         f"into {heads} heads")
    body, dtype = NodeBuilder(g, node), numpy_dtype(q.dtype)
    kv_len = g.types[key].shape[1]
    if bias:
        qb, kb, vb = body.add_many(SPLIT, [bias, body.const(np.array([d, d, v_size], np.int64))], ["", "", ""],
                                   axis=0)
        query, key, value = (body.add(ADD, [t, b]) for t, b in ((query, qb), (key, kb), (value, vb)))
    keys, values = body.heads_first(key, heads, d // heads), body.heads_first(value, heads, v_size // heads)
    past = 0
    if past_key:
        past = g.types[past_key].shape[2]
        keys = body.add(CONCAT, [past_key, keys], output_at(node, 1), axis=2)
        values = body.add(CONCAT, [past_value, values], output_at(node, 2), axis=2)
    elif output_at(node, 1) or output_at(node, 2):
        keys = body.add(IDENTITY, [keys], output_at(node, 1)) if output_at(node, 1) else keys
        values = body.add(IDENTITY, [values], output_at(node, 2)) if output_at(node, 2) else values
    scale = float(node.attrs.get("scale", 0.0)) or 1.0 / float(np.sqrt(d // heads))
    rows = body.add(MUL, [body.heads_first(query, heads, d // heads), body.const(dtype.type(scale))])
    scores = body.add(MATMUL, [rows, body.add(TRANSPOSE, [keys], perm=[0, 1, 3, 2])])
    if attention_bias:
        scores = body.add(ADD, [scores, attention_bias])
    total = past + kv_len
    allowed = _allowed_keys(body, node, mask, q.shape[0], q.shape[1], bool(node.attrs.get("unidirectional", 0)),
                            total, past)
    _attend(body, node, scores, allowed, values, v_size, dtype)
    return body.nodes


register(
    OpDef(CONTRIB + GELU, OPAQUE, expanded_only, expand=_expand_gelu),
    OpDef(CONTRIB + "BiasGelu", OPAQUE, expanded_only, expand=_expand_bias_gelu),
    OpDef(CONTRIB + "FastGelu", OPAQUE, expanded_only, expand=_expand_fast_gelu),
    OpDef(CONTRIB + "QuickGelu", OPAQUE, expanded_only, expand=_expand_quick_gelu),
    OpDef(EMBED_LAYER_NORMALIZATION, OPAQUE, expanded_only, expand=_expand_embed_layer_normalization),
    OpDef(ATTENTION, OPAQUE, expanded_only, expand=_expand_attention),
    OpDef(MULTI_HEAD_ATTENTION, OPAQUE, expanded_only, expand=_expand_multi_head_attention),
)
