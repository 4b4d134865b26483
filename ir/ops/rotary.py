"""Rotary position embeddings as onnxruntime computes them: com.microsoft.RotaryEmbedding,
and the rotation GroupQueryAttention applies to queries and keys (ir/ops/
group_query_attention.py). Built from ONNX's ops, so the rotation is an elementwise
prologue of whatever reads it.

The first `rotary_dim` features of each head are rotated in pairs by the angle of the
token's position (cos and sin looked up in the caches by position), the rest pass through:
pairs are (i, i + rotary_dim / 2), or (2i, 2i + 1) when interleaved.
"""
from __future__ import annotations

import numpy as np

from ..dtypes import DTYPES
from ..graph import Node, ShapeError, UnsupportedError
from ..symbolic import is_symbolic
from .elementwise import ADD, CAST, MUL, SUB
from .functions import ROTARY_EMBEDDING as ONNX_ROTARY_EMBEDDING
from .node_builder import NodeBuilder
from .quantize import CONTRIB
from .registry import OPAQUE, OpDef, expanded_only, register
from .shape import CONCAT, GATHER, IDENTITY, RESHAPE, SLICE, UNSQUEEZE

ROTARY_EMBEDDING = CONTRIB + ONNX_ROTARY_EMBEDDING  # (onnxruntime's, before ONNX had one)


def _last(body: NodeBuilder, x: str, start: int, end: int) -> str:
    """x[..., start:end]."""
    return body.add(SLICE, [x, body.const(np.array([start], np.int64)), body.const(np.array([end], np.int64)),
                            body.const(np.array([-1], np.int64))])


def rotate(body: NodeBuilder, x: str, rank: int, head_size: int, cos: str, sin: str, rotary_dim: int,
           interleaved: bool, out: str = "") -> str:
    """x [..., head_size] (of that rank; a tensor of the expansion, not typed yet) with its
    first rotary_dim features rotated; cos and sin broadcast against x[..., :rotary_dim / 2]."""
    half = rotary_dim // 2
    if interleaved:  # pairs (2i, 2i + 1): view the rotated part as [..., half, 2]
        pairs = body.reshaped(_last(body, x, 0, rotary_dim), [0] * (rank - 1) + [half, 2])
        x1, x2 = _last(body, pairs, 0, 1), _last(body, pairs, 1, 2)
        cos, sin = (body.add(UNSQUEEZE, [c, body.const(np.array([-1], np.int64))]) for c in (cos, sin))
    else:
        x1, x2 = _last(body, x, 0, half), _last(body, x, half, rotary_dim)
    y1 = body.add(SUB, [body.add(MUL, [x1, cos]), body.add(MUL, [x2, sin])])
    y2 = body.add(ADD, [body.add(MUL, [x2, cos]), body.add(MUL, [x1, sin])])
    if interleaved:
        rotated = body.reshaped(body.add(CONCAT, [y1, y2], axis=-1), [0] * (rank - 1) + [rotary_dim])
    else:
        rotated = body.add(CONCAT, [y1, y2], axis=-1)
    if rotary_dim == head_size:
        return body.add(IDENTITY, [rotated], out) if out else rotated
    return body.add(CONCAT, [rotated, _last(body, x, rotary_dim, head_size)], out, axis=-1)


def cache_rows(body: NodeBuilder, cache: str, positions: str) -> str:
    """cos or sin of each position: rows of the cache [max_position, rotary_dim / 2]."""
    return body.add(GATHER, [cache, positions], axis=0)


def _expand_rotary_embedding(g, node: Node) -> list[Node]:
    """com.microsoft.RotaryEmbedding(input, position_ids, cos_cache, sin_cache): input
    [batch, seq, hidden] or [batch, heads, seq, head_size]; position_ids [batch, seq], or
    [1] holding the first position (the rest follow it)."""
    x, positions, cos_cache, sin_cache = node.inputs[:4]
    a = node.attrs
    for name, default in (("is_packed_batching", 0), ("scale", 1.0)):
        if a.get(name, default) != default:
            raise UnsupportedError(f"{node.describe()}: {name}={a[name]} is not supported")
    shape, half = g.types[x].shape, g.types[cos_cache].shape[-1]
    num_heads, rotary_dim = int(a.get("num_heads", 0)), int(a.get("rotary_embedding_dim", 0))
    if len(shape) not in (3, 4) or is_symbolic(shape[-1]):
        raise ShapeError(f"{node.describe()}: input {g.types[x]} must be [batch, seq, hidden] or [batch, heads, seq, "
                         "head_size] with a fixed last dim")
    if len(shape) == 4:
        head_size = shape[3]
    elif num_heads:
        head_size = shape[2] // num_heads
    elif rotary_dim:
        raise ShapeError(f"{node.describe()}: rotary_embedding_dim needs num_heads for a 3-D input")
    else:
        head_size = 2 * half
    rotary_dim = rotary_dim or head_size
    if rotary_dim % 2 or rotary_dim > head_size or half != rotary_dim // 2 or \
            (len(shape) == 3 and shape[2] % head_size):
        raise ShapeError(f"{node.describe()}: input {g.types[x]}, caches of {half} columns and rotary_embedding_dim "
                         f"{rotary_dim} do not fit heads of {head_size}")
    body = NodeBuilder(g, node)
    pos_shape = g.types[positions].shape
    if len(pos_shape) == 1:  # (the first position; the sequence follows it)
        steps = body.arange(shape[-2] if len(shape) == 4 else shape[1])
        positions = body.add(ADD, [body.add(CAST, [positions], to=DTYPES["int64"].onnx), steps])
    cos, sin = cache_rows(body, cos_cache, positions), cache_rows(body, sin_cache, positions)  # [(batch,) seq, half]
    if len(shape) == 4:  # [batch, heads, seq, head]: the heads axis broadcast
        if len(pos_shape) == 2:
            cos, sin = (body.add(UNSQUEEZE, [c, body.const(np.array([1], np.int64))]) for c in (cos, sin))
        rotate(body, x, 4, head_size, cos, sin, rotary_dim, bool(a.get("interleaved", 0)), node.outputs[0])
        return body.nodes
    heads = body.reshaped(x, [0, 0, shape[2] // head_size, head_size])  # [batch, seq, heads, head]
    cos, sin = (body.add(UNSQUEEZE, [c, body.const(np.array([-2], np.int64))]) for c in (cos, sin))
    rotated = rotate(body, heads, 4, head_size, cos, sin, rotary_dim, bool(a.get("interleaved", 0)))
    body.add(RESHAPE, [rotated, body.const(np.array([0, 0, -1], np.int64))], node.outputs[0])
    return body.nodes


register(OpDef(ROTARY_EMBEDDING, OPAQUE, expanded_only, expand=_expand_rotary_embedding))
