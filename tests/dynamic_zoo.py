"""Models exported with dynamic axes, built with onnx.helper (random weights, fixed seeds): the
spellings torch's TorchScript exporter writes when asked for `dynamic_axes`, where every size
that depends on the input is computed from its shape at run time (Shape -> Gather ->
Unsqueeze -> Concat -> Reshape, Slice ends taken from a Shape). Each function returns the
model and a function giving feeds for a (batch, seq).
"""
from __future__ import annotations

import math

import numpy as np
from onnx import TensorProto, helper

from .model_zoo import GraphMaker
from .transformer_zoo import FLOAT_MIN, _gelu_erf, _i64, _layernorm, _model, _out


def _size(g: GraphMaker, tensor: str, axis: int) -> str:
    """A [1] int64 tensor: dimension `axis` of `tensor`, as exporters compute it."""
    return g.op("Unsqueeze", [g.op("Gather", [g.op("Shape", [tensor]), g.const(np.array(axis, np.int64))], axis=0),
                              g.const(_i64(0))])


def _split_heads(g: GraphMaker, t: str, heads: int, dh: int) -> str:
    shape = g.op("Concat", [_size(g, t, 0), _size(g, t, 1), g.const(_i64(heads, dh))], axis=0)
    return g.op("Transpose", [g.op("Reshape", [t, shape])], perm=[0, 2, 1, 3])


def _merge_heads(g: GraphMaker, t: str, d: int) -> str:
    t = g.op("Transpose", [t], perm=[0, 2, 1, 3])
    return g.op("Reshape", [t, g.op("Concat", [_size(g, t, 0), _size(g, t, 1), g.const(_i64(d))], axis=0)])


def bert_encoder_dynamic(d: int = 64, heads: int = 4, layers: int = 2, vocab: int = 120, ffn: int = 128,
                         max_positions: int = 128):
    """BERT with input_ids and attention_mask of [batch, seq]: word, position (a Slice of the
    position-id buffer up to seq) and token-type (a Slice expanded to [batch, seq]) embeddings,
    the mask as (1 - mask) * finfo.min, post-norm layers whose heads are split and merged by
    Reshapes to shapes computed from Shape, and the pooler over [CLS]."""
    g = GraphMaker(31)
    dh = d // heads
    seq = _size(g, "input_ids", 1)
    word = g.op("Gather", [g.const((g.rng.standard_normal((vocab, d)) * 0.5).astype(np.float32), "word"),
                           "input_ids"], axis=0)
    position_ids = g.op("Slice", [g.const(np.arange(max_positions, dtype=np.int64)[None]), g.const(_i64(0)), seq,
                                  g.const(_i64(1))])
    pos = g.op("Gather", [g.const((g.rng.standard_normal((max_positions, d)) * 0.5).astype(np.float32), "pos"),
                          position_ids])
    token_types = g.op("Slice", [g.const(np.zeros((1, max_positions), np.int64)), g.const(_i64(0)), seq,
                                 g.const(_i64(1))])
    token_types = g.op("Expand", [token_types, g.op("Concat", [_size(g, "input_ids", 0), seq], axis=0)])
    token_type = g.op("Gather", [g.const((g.rng.standard_normal((2, d)) * 0.5).astype(np.float32), "tt"),
                                 token_types])
    h = _layernorm(g, g.op("Add", [g.op("Add", [word, pos]), token_type]), d)
    m = g.op("Cast", [g.op("Unsqueeze", ["attention_mask", g.const(_i64(1, 2))])], to=TensorProto.FLOAT)
    mask = g.op("Mul", [g.op("Sub", [g.const(np.float32(1)), m]), g.const(FLOAT_MIN)])
    for _ in range(layers):
        q, k, v = (_split_heads(g, g.linear(h, d, d), heads, dh) for _ in range(3))
        scores = g.op("Div", [g.op("MatMul", [q, g.op("Transpose", [k], perm=[0, 1, 3, 2])]),
                              g.const(np.float32(math.sqrt(dh)))])
        attn = g.op("MatMul", [g.op("Softmax", [g.op("Add", [scores, mask])], axis=-1), v])
        h = _layernorm(g, g.op("Add", [h, g.linear(_merge_heads(g, attn, d), d, d)]), d)
        h = _layernorm(g, g.op("Add", [h, g.linear(_gelu_erf(g, g.linear(h, d, ffn)), ffn, d)]), d)
    cls = g.op("Gather", [h, g.const(np.array(0, np.int64))], axis=1)
    pooled = g.op("Tanh", [g.linear(cls, d, d)])
    model = _model(g, [("input_ids", TensorProto.INT64, ["batch", "seq"]),
                       ("attention_mask", TensorProto.INT64, ["batch", "seq"])],
                   [_out(g, h, "last_hidden_state"), _out(g, pooled, "pooler_output")], opset=17, name="bert_dynamic")

    def feeds(batch: int, seq: int, seed: int = 0) -> dict:
        rng = np.random.default_rng(seed)
        mask = np.ones((batch, seq), np.int64)
        for row in range(1, batch):  # padding at the end of every row but the first
            mask[row, seq - (row * seq) // (batch + 1):] = 0
        return {"input_ids": rng.integers(0, vocab, (batch, seq)).astype(np.int64), "attention_mask": mask}
    return model, feeds
