"""com.microsoft.GroupQueryAttention: causal self-attention with a KV cache, fewer key and
value heads than query heads (each serves num_heads / kv_num_heads query heads), rotary
embeddings applied inside, as onnxruntime-genai's model builder writes every layer of a
Llama, Mistral, Phi-3, Qwen or Gemma.

Built from ONNX's ops and a kiln.CacheWrite, so the KV cache is one that
ir/passes/kv_cache.py keeps in place, and attention is the MatMul -> Softmax -> MatMul that
fuses like any other:
  - query, key and value [batch, seq, heads * head_size] (or one packed tensor) become
    [batch, heads, seq, head_size], queries and keys rotated at their positions;
  - present: the past with this call's keys (values) written at each batch entry's start,
    the rows after them zero. A start is onnxruntime's past_seqlen: seqlens_k + 1 - seq (the
    sequence's length before this call), 0 for a first prompt. Where every sequence fills
    the cache it is the past's length, and the present is Concat(past, new);
  - each key head's group of query heads is one matrix of rows [batch, kv_heads,
    group * seq, head_size], so keys are read once per group, not copied per query head;
  - row r (token s = r mod seq, at position start + s) sees keys 0 .. start + s (only the
    last local_window_size of those, itself included, when a window is set); softcap
    applies to the scores first, then attention_bias is added; a head's sink (head_sink, or
    0 under smooth_softmax) is one more logit in its rows' softmax sums.

present is past + seq long, so total_sequence_length must be past + seq: the module checks
it (a named error before it runs). onnxruntime also runs past and present as one
max-length buffer (past longer than total); Kiln keeps its cache in place its own way
(`Module.new_cache`).
"""
from __future__ import annotations

import numpy as np

from ..dtypes import DTYPES, numpy_dtype
from ..graph import Node, ShapeError, UnsupportedError
from ..symbolic import greatest, is_symbolic, least, require_equal
from .conv_gemm import MATMUL
from .elementwise import (ADD, AND, CAST, EQUAL, GREATER_OR_EQUAL, LESS_OR_EQUAL, MAX, MIN, MOD, MUL, SUB, TANH,
                          WHERE)
from .kv_cache import CACHE_WRITE
from .node_builder import NodeBuilder, input_at
from .quantize import CONTRIB
from .reduce import SOFTMAX
from .registry import OPAQUE, OpDef, expanded_only, register
from .rotary import cache_rows, rotate
from .shape import CONCAT, EXPAND, IDENTITY, RESHAPE, SLICE, SPLIT, TRANSPOSE, UNSQUEEZE

GROUP_QUERY_ATTENTION = CONTRIB + "GroupQueryAttention"
_QUERY, _KEY, _VALUE, _PAST_KEY, _PAST_VALUE, _SEQLENS_K, _TOTAL, _COS, _SIN, _BIAS, _HEAD_SINK = (*range(9), 10, 11)
# Inputs after sin_cache that Kiln does not read, by position.
_UNREAD_INPUTS = {9: "position_ids", 12: "k_scale", 13: "v_scale", 14: "q_norm_weight",
                  15: "k_norm_weight", 16: "query_seqlens"}
# Attributes whose other values ask for what Kiln does not compute: (name, the values it accepts).
_FIXED_ATTRIBUTES = (("causal", (1,)), ("qk_output", (0,)),
                     ("sliding_window_cache", (0,)), ("kv_cache_bit_width", (0,)),
                     ("k_quant_type", ("NONE",)), ("v_quant_type", ("NONE",)))


def _check_supported(node: Node) -> None:
    for i, name in _UNREAD_INPUTS.items():
        if input_at(node, i):
            raise UnsupportedError(f"{node.describe()}: input {i} ({name}) is not supported")
    for name, accepted in _FIXED_ATTRIBUTES:
        value = node.attrs.get(name, accepted[0])
        value = value.decode() if isinstance(value, bytes) else value
        if value not in accepted:
            raise UnsupportedError(f"{node.describe()}: {name}={value!r} is not supported")
    if len(node.outputs) > 3 and node.outputs[3]:
        raise UnsupportedError(f"{node.describe()}: output 3 (output_qk) is not supported")


def _known_size(g, name: str):
    """The value of a one-element size tensor where the build knows it (a constant, or an
    expression of the symbols: genai computes it from the attention mask's shape), else None."""
    value = g.constants.get(name)
    if value is None:
        value = g.symbolic_values.get(name)
    if value is None or np.asarray(value).size != 1:
        return None
    v = np.asarray(value).reshape(-1)[0]
    return v if is_symbolic(v) else int(v)


class _Shapes:
    """The sizes the node's inputs give: batch, seq, heads, kv_heads, head_size, past."""

    def __init__(self, g, node: Node):
        a = node.attrs
        self.heads, self.kv_heads = int(a.get("num_heads", 0)), int(a.get("kv_num_heads", 0))
        if self.heads <= 0 or self.kv_heads <= 0 or self.heads % self.kv_heads:
            raise ShapeError(f"{node.describe()}: num_heads {self.heads} must be a positive multiple of kv_num_heads "
                             f"{self.kv_heads}")
        q = g.types[node.inputs[_QUERY]]
        if len(q.shape) != 3 or is_symbolic(q.shape[2]):
            raise ShapeError(f"{node.describe()}: query {q} must be [batch, seq, hidden] with a fixed hidden size")
        self.batch, self.seq, width = q.shape
        self.packed = not input_at(node, _KEY)
        per_token = self.heads + 2 * self.kv_heads if self.packed else self.heads
        if width % per_token:
            raise ShapeError(f"{node.describe()}: query {q} does not split into heads ({per_token} of them)")
        self.head_size = width // per_token
        kv = [self.batch, self.seq, self.kv_heads * self.head_size]
        if not self.packed:
            for i in (_KEY, _VALUE):
                t = g.types[node.inputs[i]] if input_at(node, i) else None
                if t is None or len(t.shape) != 3 or t.shape[2] != kv[2]:
                    raise ShapeError(f"{node.describe()}: {['key', 'value'][i - 1]} {t} must be [batch, seq, {kv[2]}]")
                require_equal(t.shape[0], self.batch, f"{node.describe()}: the batch of query and input {i}")
                require_equal(t.shape[1], self.seq, f"{node.describe()}: the sequence of query and input {i}")
        self.past = 0
        if bool(input_at(node, _PAST_KEY)) != bool(input_at(node, _PAST_VALUE)):
            raise ShapeError(f"{node.describe()}: past_key and past_value come together")
        if input_at(node, _PAST_KEY):
            for i in (_PAST_KEY, _PAST_VALUE):
                t = g.types[node.inputs[i]]
                if len(t.shape) != 4 or t.shape[1] != self.kv_heads or t.shape[3] != self.head_size:
                    raise ShapeError(f"{node.describe()}: input {i} {t} must be [batch, {self.kv_heads}, past, "
                                     f"{self.head_size}]")
                require_equal(t.shape[0], self.batch, f"{node.describe()}: the batch of query and input {i}")
            self.past = g.types[node.inputs[_PAST_KEY]].shape[2]
            require_equal(g.types[node.inputs[_PAST_VALUE]].shape[2], self.past,
                          f"{node.describe()}: the lengths of past_key and past_value")


def _check_total(g, node: Node, s: _Shapes) -> None:
    """total_sequence_length must be past + seq, the present's length (a past longer than
    that is onnxruntime's shared max-length buffer, which Kiln does not read)."""
    total = _known_size(g, node.inputs[_TOTAL])
    if total is None:
        raise UnsupportedError(f"{node.describe()}: total_sequence_length '{node.inputs[_TOTAL]}' must be a size the "
                               "build can compute (a constant, or from the shapes of the inputs, as onnxruntime-genai "
                               "computes it from attention_mask)")
    require_equal(total, s.past + s.seq, f"{node.describe()}: total_sequence_length and past + seq (the "
                                         "present's length)")


def _starts(body: NodeBuilder, node: Node, s: _Shapes) -> str:
    """int64 [batch] (a scalar 0 without a past): where each batch entry's new entries go,
    onnxruntime's past_seqlen. 0 for a first prompt (no past), else seqlens_k + 1 - seq,
    clamped to [0, past]: a sequence shorter than the cache (a right-padded batch)
    continues where it ends, as onnxruntime writes it."""
    if not input_at(node, _PAST_KEY) or s.past == 0:
        return body.const(np.int64(0))
    past = body.sizes(s.past)
    lengths = body.add(CAST, [node.inputs[_SEQLENS_K]], to=DTYPES["int64"].onnx)
    after = body.add(SUB, [lengths, body.sizes(s.seq - 1)])
    clamped = body.add(MIN, [body.add(MAX, [after, body.const(np.int64(0))]), past])
    first_prompt = body.add(EQUAL, [past, body.const(np.int64(0))])
    return body.add(WHERE, [first_prompt, body.const(np.int64(0)), clamped])


def _positions(body: NodeBuilder, node: Node, s: _Shapes, starts: str) -> str:
    """int64 [batch, seq] (or [seq] without a past): each token's position, start + s, as
    onnxruntime's CPU kernel places them (padding tokens too)."""
    steps = body.arange(s.seq)
    if not input_at(node, _PAST_KEY) or s.past == 0:
        return steps
    return body.add(ADD, [body.add(UNSQUEEZE, [starts, body.const(np.array([-1], np.int64))]), steps])


def _causal_mask(body: NodeBuilder, node: Node, s: _Shapes, starts: str, group: int, window: int) -> str | None:
    """bool [batch, 1, group * seq, past + seq]: may row r (token r mod seq, at start + that)
    see key j? None where every row sees every key (one token, no past, no window)."""
    has_past = input_at(node, _PAST_KEY) and s.past != 0
    if s.seq == 1 and window <= 0 and not has_past:
        return None
    token = body.add(UNSQUEEZE, [body.add(MOD, [body.arange(group * s.seq), body.sizes(s.seq)]),
                                 body.const(np.array([-1], np.int64))])
    if has_past:
        starts = body.add(RESHAPE, [starts, body.const(np.array([-1, 1, 1, 1], np.int64))])
    last = body.add(ADD, [token, starts])
    keys = body.arange(s.past + s.seq)
    allowed = body.add(LESS_OR_EQUAL, [keys, last])
    if window > 0:
        first = body.add(SUB, [last, body.const(np.int64(window - 1))])
        allowed = body.add(AND, [allowed, body.add(GREATER_OR_EQUAL, [keys, first])])
    return allowed


def _bias_rows(g, body: NodeBuilder, node: Node, s: _Shapes, group: int) -> str:
    """attention_bias [batch or 1, heads or 1, seq, past + seq] laid out as the scores are,
    [batch or 1, kv_heads or 1, group * seq, past + seq]: a query head's rows are its kv
    head's group's, in order, so per-head biases reshape in place and one shared by every
    head repeats over the group."""
    bias = node.inputs[_BIAS]
    shape = g.types[bias].shape
    if len(shape) != 4 or shape[1] not in (1, s.heads):
        raise ShapeError(f"{node.describe()}: attention_bias {g.types[bias]} must be [batch or 1, {s.heads} or 1, seq, "
                         "past + seq]")
    if shape[1] == s.heads:
        return body.reshaped(bias, [0, s.kv_heads, group * s.seq, shape[3]])
    repeated = body.add(EXPAND, [body.add(UNSQUEEZE, [bias, body.const(np.array([2], np.int64))]),
                                 body.sizes([shape[0], 1, group, s.seq, shape[3]])])
    return body.reshaped(repeated, [0, 1, group * s.seq, shape[3]])


def _sink_logits(body: NodeBuilder, node: Node, s: _Shapes, group: int, dtype) -> str | None:
    """[1, kv_heads, group * seq, 1]: the logit each row's softmax also sums over (its head's
    head_sink; 0 under smooth_softmax without one), or None for a plain softmax."""
    sink = input_at(node, _HEAD_SINK)
    if not sink:
        return body.const(np.zeros((1, 1, 1, 1), dtype)) if int(node.attrs.get("smooth_softmax", -1)) == 1 else None
    per_head = body.reshaped(sink, [s.kv_heads, group, 1])  # (query head kv * group + g)
    rows = body.add(EXPAND, [per_head, body.sizes([s.kv_heads, group, s.seq])])
    return body.reshaped(rows, [1, s.kv_heads, group * s.seq, 1])


def _expand(g, node: Node) -> list[Node]:
    _check_supported(node)
    s = _Shapes(g, node)
    _check_total(g, node, s)
    a, body = node.attrs, NodeBuilder(g, node)
    dtype = numpy_dtype(g.types[node.inputs[_QUERY]].dtype)
    h, group = s.head_size, s.heads // s.kv_heads

    if s.packed:
        q, k, v = body.add_many(SPLIT, [node.inputs[_QUERY], body.const(np.array(
            [s.heads * h, s.kv_heads * h, s.kv_heads * h], np.int64))], ["", "", ""], axis=2)
    else:
        q, k, v = node.inputs[_QUERY], node.inputs[_KEY], node.inputs[_VALUE]

    q, k, v = (body.heads_first(x, n, h) for x, n in ((q, s.heads), (k, s.kv_heads), (v, s.kv_heads)))
    starts = _starts(body, node, s)

    if int(a.get("do_rotary", 0)):
        cos_cache, sin_cache = input_at(node, _COS), input_at(node, _SIN)
        if not (cos_cache and sin_cache):
            raise ShapeError(f"{node.describe()}: do_rotary=1 needs cos_cache and sin_cache")
        rotary_dim = 2 * g.types[cos_cache].shape[-1]
        if rotary_dim > h or g.types[sin_cache].shape != g.types[cos_cache].shape:
            raise ShapeError(f"{node.describe()}: caches {g.types[cos_cache]} and {g.types[sin_cache]} do not fit "
                             f"heads of {h}")
        held = g.types[cos_cache].shape[0]
        if greatest(s.past + s.seq) > least(held):  # (a cache an If picks holds its least for all it can tell)
            raise ShapeError(f"{node.describe()}: the rotary caches hold {held} positions, past + seq may reach "
                             f"{greatest(s.past + s.seq)}: bound the past and the sequence so that they sum to at "
                             f"most {least(held)}")
        positions = _positions(body, node, s, starts)
        cos, sin = (body.add(UNSQUEEZE, [cache_rows(body, c, positions), body.const(np.array([-3], np.int64))])
                    for c in (cos_cache, sin_cache))  # [(batch,) 1, seq, rotary_dim / 2]
        interleaved = bool(a.get("rotary_interleaved", 0))
        q, k = (rotate(body, x, 4, h, cos, sin, rotary_dim, interleaved) for x in (q, k))

    def present(new: str, past_index: int, out_index: int) -> str:
        out = node.outputs[out_index] if out_index < len(node.outputs) else ""
        if input_at(node, past_index):
            return body.add(CACHE_WRITE, [node.inputs[past_index], new, starts], out, axis=2)
        return body.add(IDENTITY, [new], out) if out else new
    keys, values = present(k, _PAST_KEY, 1), present(v, _PAST_VALUE, 2)

    scale = float(a.get("scale", 0.0)) or 1.0 / float(np.sqrt(h))
    rows = body.add(MUL, [body.reshaped(q, [0, s.kv_heads, -1, h]), body.const(dtype.type(scale))])
    scores = body.add(MATMUL, [rows, body.add(TRANSPOSE, [keys], perm=[0, 1, 3, 2])])  # [b, kv_heads, rows, keys]
    softcap = float(a.get("softcap", 0.0))
    if softcap > 0:
        scores = body.add(MUL, [body.add(TANH, [body.add(MUL, [scores, body.const(dtype.type(1 / softcap))])]),
                                body.const(dtype.type(softcap))])
    if input_at(node, _BIAS):  # (after the softcap, as onnxruntime adds it)
        scores = body.add(ADD, [scores, _bias_rows(g, body, node, s, group)])
    allowed = _causal_mask(body, node, s, starts, group, int(a.get("local_window_size", -1)))
    if allowed is not None:
        scores = body.add(WHERE, [allowed, scores, body.const(dtype.type(-np.inf))])
    sink = _sink_logits(body, node, s, group, dtype)
    if sink is None:
        probs = body.add(SOFTMAX, [scores], axis=-1)
    else:  # (one more logit per row in the softmax's sum, dropped after)
        column = body.add(EXPAND, [sink, body.sizes([s.batch, s.kv_heads, group * s.seq, 1])])
        probs = body.add(SOFTMAX, [body.add(CONCAT, [scores, column], axis=-1)], axis=-1)
        probs = body.add(SLICE, [probs, body.const(np.array([0], np.int64)), body.sizes([s.past + s.seq]),
                                 body.const(np.array([-1], np.int64))])
    context = body.add(MATMUL, [probs, values])  # [b, kv_heads, rows, h]
    per_head = body.add(TRANSPOSE, [body.reshaped(context, [0, s.heads, -1, h])], perm=[0, 2, 1, 3])
    body.add(RESHAPE, [per_head, body.const(np.array([0, 0, s.heads * h], np.int64))], node.outputs[0])
    return body.nodes


register(OpDef(GROUP_QUERY_ATTENTION, OPAQUE, expanded_only, expand=_expand))
