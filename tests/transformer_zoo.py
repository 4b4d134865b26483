"""Transformer models in the spellings exporters write, built with onnx.helper (random
weights, fixed seeds): what BERT, GPT-2, T5, Swin and wav2vec2 exports from torch look like
to Kiln, at small sizes. Each function returns (model, feeds).

The spellings follow the two torch exporters: TorchScript (`torch.onnx.export`: masks as
Cast/Sub/Mul arithmetic, positions as constants) and dynamo (`dynamo=True`: comparisons and
Where over boolean masks, Expand to the score shape, GatherND/ScatterND for indexing).
"""
from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto, helper

from .model_zoo import GraphMaker

FLOAT_MIN = np.float32(np.finfo(np.float32).min)  # what torch writes for a masked score


def _model(g: GraphMaker, inputs: list, outputs: list, opset: int = 18, name: str = "model") -> onnx.ModelProto:
    ins = [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs]
    outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs]
    graph = helper.make_graph(g.nodes, name, ins, outs, g.inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


def _out(g: GraphMaker, tensor: str, name: str) -> str:
    g.nodes.append(helper.make_node("Identity", [tensor], [name], name=g.name("out")))
    return name


def _i64(*values) -> np.ndarray:
    return np.array(values, np.int64)


def _layernorm(g: GraphMaker, x: str, d: int) -> str:
    return g.op("LayerNormalization", [x, g.const(1 + 0.1 * g.rng.standard_normal(d).astype(np.float32)),
                                       g.const(0.1 * g.rng.standard_normal(d).astype(np.float32))], axis=-1,
                epsilon=1e-5)


def _gelu_erf(g: GraphMaker, x: str) -> str:
    erf = g.op("Erf", [g.op("Div", [x, g.const(np.float32(math.sqrt(2)))])])
    return g.op("Mul", [g.op("Mul", [x, g.op("Add", [erf, g.const(np.float32(1))])]), g.const(np.float32(0.5))])


def _gelu_tanh(g: GraphMaker, x: str) -> str:
    """GPT-2's gelu_new: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    cube = g.op("Pow", [x, g.const(np.float32(3))])
    inner = g.op("Mul", [g.op("Add", [x, g.op("Mul", [cube, g.const(np.float32(0.044715))])]),
                         g.const(np.float32(math.sqrt(2 / math.pi)))])
    return g.op("Mul", [g.op("Mul", [x, g.const(np.float32(0.5))]),
                        g.op("Add", [g.op("Tanh", [inner]), g.const(np.float32(1))])])


def _heads(g: GraphMaker, t: str, seq: int, heads: int, dh: int, batch: int = 1) -> str:
    t = g.op("Reshape", [t, g.const(_i64(batch, seq, heads, dh))])
    return g.op("Transpose", [t], perm=[0, 2, 1, 3])


def _merge_heads(g: GraphMaker, t: str, seq: int, d: int, batch: int = 1) -> str:
    return g.op("Reshape", [g.op("Transpose", [t], perm=[0, 2, 1, 3]), g.const(_i64(batch, seq, d))])


def _attention(g: GraphMaker, q, k, v, dh: int, bias=None) -> str:
    """softmax(q k^T / sqrt(dh) + bias) v over [batch, heads, seq, dh] operands."""
    scores = g.op("Div", [g.op("MatMul", [q, g.op("Transpose", [k], perm=[0, 1, 3, 2])]),
                          g.const(np.float32(math.sqrt(dh)))])
    if bias is not None:
        scores = g.op("Add", [scores, bias])
    return g.op("MatMul", [g.op("Softmax", [scores], axis=-1), v])


# ---- BERT ---------------------------------------------------------------------------------------

def bert_encoder(exporter: str = "dynamo", seq: int = 32, d: int = 64, heads: int = 4, layers: int = 2,
                 vocab: int = 120, ffn: int = 128):
    """Embeddings (word, position, token type; Gather on a vocabulary), the extended attention
    mask, `layers` post-norm encoder layers, and a pooler over the [CLS] token.

    TorchScript writes the mask as (1 - mask) * finfo.min after Unsqueeze and Cast; dynamo
    as GreaterOrEqual(mask, 1) expanded to the score shape and chosen by Where, picks [CLS]
    with GatherND and writes position ids with ScatterND."""
    g = GraphMaker(21)
    dh = d // heads
    word = g.op("Gather", [g.const((g.rng.standard_normal((vocab, d)) * 0.5).astype(np.float32), "word"),
                           "input_ids"], axis=0)
    if exporter == "dynamo":  # position ids: zeros with an arange scattered in (index_put)
        positions = g.op("ScatterND", [g.const(np.zeros((1, seq), np.int64)), g.const(_i64(*[[0]])),
                                       g.const(np.arange(seq, dtype=np.int64)[None])])
    else:
        positions = g.const(np.arange(seq, dtype=np.int64)[None])
    pos = g.op("Gather", [g.const((g.rng.standard_normal((seq, d)) * 0.5).astype(np.float32), "pos"), positions])
    token_type = g.op("Gather", [g.const((g.rng.standard_normal((2, d)) * 0.5).astype(np.float32), "tt"),
                                 g.const(np.zeros((1, seq), np.int64))])
    h = _layernorm(g, g.op("Add", [g.op("Add", [word, pos]), token_type]), d)

    if exporter == "dynamo":
        keep = g.op("GreaterOrEqual", ["attention_mask", g.const(_i64(1))])
        keep = g.op("Expand", [g.op("Unsqueeze", [keep, g.const(_i64(1, 2))]), g.const(_i64(1, heads, seq, seq))])
        mask = g.op("Where", [keep, g.const(np.float32(0)), g.const(FLOAT_MIN)])
    else:
        m = g.op("Cast", [g.op("Unsqueeze", ["attention_mask", g.const(_i64(1, 2))])], to=TensorProto.FLOAT)
        mask = g.op("Mul", [g.op("Sub", [g.const(np.float32(1)), m]), g.const(FLOAT_MIN)])

    for _ in range(layers):
        q, k, v = (_heads(g, g.linear(h, d, d), seq, heads, dh) for _ in range(3))
        attn = _merge_heads(g, _attention(g, q, k, v, dh, mask), seq, d)
        h = _layernorm(g, g.op("Add", [h, g.linear(attn, d, d)]), d)
        h = _layernorm(g, g.op("Add", [h, g.linear(_gelu_erf(g, g.linear(h, d, ffn)), ffn, d)]), d)

    if exporter == "dynamo":
        cls = g.op("GatherND", [h, g.const(_i64(*[[0]]))], batch_dims=1)  # [1, d]
    else:
        cls = g.op("Gather", [h, g.const(np.array(0, np.int64))], axis=1)
    pooled = g.op("Tanh", [g.linear(cls, d, d)])
    model = _model(g, [("input_ids", TensorProto.INT64, [1, seq]), ("attention_mask", TensorProto.INT64, [1, seq])],
                   [_out(g, h, "last_hidden_state"), _out(g, pooled, "pooler_output")], name=f"bert_{exporter}")
    rng = np.random.default_rng(22)
    mask = np.ones((1, seq), np.int64)
    mask[0, seq - seq // 4:] = 0  # padding at the end
    return model, {"input_ids": rng.integers(0, vocab, (1, seq)).astype(np.int64), "attention_mask": mask}


# ---- GPT-2 --------------------------------------------------------------------------------------

def gpt2_block(seq: int = 24, d: int = 64, heads: int = 4, dtype=np.float32):
    """A pre-norm causal decoder block: fused QKV projection split three ways, a causal mask
    built from Range and LessOrEqual (dynamo's spelling) chosen by Where, tanh-GELU. With
    dtype float16, converted by onnxconverter-common's convert_float_to_float16."""
    g = GraphMaker(31)
    dh = d // heads
    h = _layernorm(g, "x", d)
    qkv = g.linear(h, d, 3 * d)
    q, k, v = g.op("Split", [qkv, g.const(_i64(d, d, d))], n_out=3, axis=-1)
    q, k, v = (_heads(g, t, seq, heads, dh) for t in (q, k, v))
    rows = g.op("Range", [g.const(np.int64(0)), g.const(np.int64(seq)), g.const(np.int64(1))])
    causal = g.op("LessOrEqual", [g.op("Unsqueeze", [rows, g.const(_i64(0))]),
                                  g.op("Unsqueeze", [rows, g.const(_i64(1))])])  # [seq, seq]: key <= query
    scores = g.op("Div", [g.op("MatMul", [q, g.op("Transpose", [k], perm=[0, 1, 3, 2])]),
                          g.const(np.float32(math.sqrt(dh)))])
    scores = g.op("Where", [causal, scores, g.const(FLOAT_MIN)])
    attn = _merge_heads(g, g.op("MatMul", [g.op("Softmax", [scores], axis=-1), v]), seq, d)
    x1 = g.op("Add", ["x", g.linear(attn, d, d)])
    y = g.op("Add", [x1, g.linear(_gelu_tanh(g, g.linear(_layernorm(g, x1, d), d, 4 * d)), 4 * d, d)])
    model = _model(g, [("x", TensorProto.FLOAT, [1, seq, d])], [_out(g, y, "y")], name="gpt2_block")
    feeds = {"x": np.random.default_rng(32).standard_normal((1, seq, d)).astype(np.float32)}
    if dtype == np.float16:  # converted as users convert models, fp16 inputs and outputs
        import warnings

        from onnxconverter_common import float16
        with warnings.catch_warnings():  # it says so when the mask's finfo.min becomes -1e4: intended
            warnings.simplefilter("ignore", UserWarning)
            return float16.convert_float_to_float16(model), {"x": feeds["x"].astype(np.float16)}
    return model, feeds


# ---- T5 ---------------------------------------------------------------------------------------

def _relative_buckets(g: GraphMaker, seq: int, buckets: int = 16, max_distance: int = 64) -> str:
    """T5's bidirectional relative position buckets, as its export computes them from
    Range: exact buckets for small distances, log-spaced ones beyond (all foldable)."""
    ctx = g.op("Unsqueeze", [g.op("Range", [g.const(np.int64(0)), g.const(np.int64(seq)), g.const(np.int64(1))]),
                             g.const(_i64(1))])
    mem = g.op("Unsqueeze", [g.op("Range", [g.const(np.int64(0)), g.const(np.int64(seq)), g.const(np.int64(1))]),
                             g.const(_i64(0))])
    rel = g.op("Sub", [mem, ctx])
    half = buckets // 2
    offset = g.op("Mul", [g.op("Cast", [g.op("Greater", [rel, g.const(np.int64(0))])], to=TensorProto.INT64),
                          g.const(np.int64(half))])
    n = g.op("Abs", [rel])
    exact = half // 2
    is_small = g.op("Less", [n, g.const(np.int64(exact))])
    nf = g.op("Cast", [n], to=TensorProto.FLOAT)
    large = g.op("Div", [g.op("Log", [g.op("Div", [nf, g.const(np.float32(exact))])]),
                         g.const(np.float32(math.log(max_distance / exact)))])
    large = g.op("Cast", [g.op("Mul", [large, g.const(np.float32(half - exact))])], to=TensorProto.INT64)
    large = g.op("Min", [g.op("Add", [large, g.const(np.int64(exact))]), g.const(np.int64(half - 1))])
    return g.op("Add", [offset, g.op("Where", [is_small, n, large])])


def t5_block(seq: int = 40, d: int = 64, heads: int = 4, ffn: int = 128):
    """An encoder block with T5's RMS norm (Pow, ReduceMean, Sqrt, Div as exported), no
    attention scaling, and a relative position bias: a Gather of learned per-bucket head
    biases at buckets computed from Range, added to the scores."""
    g = GraphMaker(41)
    dh = d // heads

    def rms_norm(x):
        var = g.op("ReduceMean", [g.op("Pow", [x, g.const(np.float32(2))]), g.const(_i64(-1))], keepdims=1)
        normed = g.op("Div", [x, g.op("Sqrt", [g.op("Add", [var, g.const(np.float32(1e-6))])])])
        return g.op("Mul", [g.const(1 + 0.1 * g.rng.standard_normal(d).astype(np.float32)), normed])

    table = g.const((g.rng.standard_normal((16, heads)) * 0.5).astype(np.float32), "rel_bias")
    bias = g.op("Unsqueeze", [g.op("Transpose", [g.op("Gather", [table, _relative_buckets(g, seq)])], perm=[2, 0, 1]),
                              g.const(_i64(0))])  # [1, heads, seq, seq]
    h = rms_norm("x")
    q, k, v = (_heads(g, g.op("MatMul", [h, g.weight((d, d), 1 / math.sqrt(d))]), seq, heads, dh) for _ in range(3))
    scores = g.op("Add", [g.op("MatMul", [q, g.op("Transpose", [k], perm=[0, 1, 3, 2])]), bias])
    attn = _merge_heads(g, g.op("MatMul", [g.op("Softmax", [scores], axis=-1), v]), seq, d)
    x1 = g.op("Add", ["x", g.op("MatMul", [attn, g.weight((d, d), 1 / math.sqrt(d))])])
    ff = g.op("Relu", [g.op("MatMul", [rms_norm(x1), g.weight((d, ffn), 1 / math.sqrt(d))])])
    y = g.op("Add", [x1, g.op("MatMul", [ff, g.weight((ffn, d), 1 / math.sqrt(ffn))])])
    model = _model(g, [("x", TensorProto.FLOAT, [1, seq, d])], [_out(g, y, "y")], name="t5_block")
    return model, {"x": np.random.default_rng(42).standard_normal((1, seq, d)).astype(np.float32)}


# ---- Swin ----------------------------------------------------------------------------------------

def swin_block(size: int = 8, window: int = 4, d: int = 32, heads: int = 2):
    """A shifted-window block: torch.roll as Slice+Concat, window partition and reverse as
    Reshape/Transpose, a relative position bias gathered from its table, and the shifted
    windows' attention mask built as the export builds it: ScatterND writes region ids
    into a zero image, then window-partitioned ids compare with Equal (all folded)."""
    g = GraphMaker(51)
    dh, shift = d // heads, window // 2
    nw, ws2 = (size // window) ** 2, window * window

    def roll(x, s):  # over H and W of [1, H, W, C]
        for axis in (1, 2):
            tail = g.op("Slice", [x, g.const(_i64(size - s)), g.const(_i64(size)), g.const(_i64(axis))])
            head = g.op("Slice", [x, g.const(_i64(0)), g.const(_i64(size - s)), g.const(_i64(axis))])
            x = g.op("Concat", [tail, head], axis=axis)
        return x

    def partition(x, c):  # [1, H, W, c] -> [nw, ws2, c]
        x = g.op("Reshape", [x, g.const(_i64(1, size // window, window, size // window, window, c))])
        x = g.op("Transpose", [x], perm=[0, 1, 3, 2, 4, 5])
        return g.op("Reshape", [x, g.const(_i64(nw, ws2, c))])

    # Region ids: three bands per axis, written with ScatterND as img_mask[:, h, w, :] = cnt.
    bands = [slice(0, size - window), slice(size - window, size - shift), slice(size - shift, size)]
    idx, upd, cnt = [], [], 0
    for hs in bands:
        for wsl in bands:
            for i in range(hs.start, hs.stop):
                for j in range(wsl.start, wsl.stop):
                    idx.append([0, i, j, 0])
                    upd.append(float(cnt))
            cnt += 1
    img = g.op("ScatterND", [g.const(np.zeros((1, size, size, 1), np.float32)), g.const(np.array(idx, np.int64)),
                             g.const(np.array(upd, np.float32))])
    ids = g.op("Reshape", [partition(img, 1), g.const(_i64(nw, ws2))])
    same = g.op("Equal", [g.op("Unsqueeze", [ids, g.const(_i64(1))]), g.op("Unsqueeze", [ids, g.const(_i64(2))])])
    mask = g.op("Where", [same, g.const(np.float32(0)), g.const(np.float32(-100))])  # [nw, ws2, ws2]
    mask = g.op("Unsqueeze", [mask, g.const(_i64(1))])  # [nw, 1, ws2, ws2]

    coords = np.stack(np.meshgrid(np.arange(window), np.arange(window), indexing="ij")).reshape(2, -1)
    rel = (coords[:, :, None] - coords[:, None, :]).transpose(1, 2, 0) + window - 1
    index = (rel[..., 0] * (2 * window - 1) + rel[..., 1]).astype(np.int64)
    table = g.const((g.rng.standard_normal(((2 * window - 1) ** 2, heads)) * 0.2).astype(np.float32), "rpb")
    bias = g.op("Unsqueeze", [g.op("Transpose", [g.op("Gather", [table, g.const(index)])], perm=[2, 0, 1]),
                              g.const(_i64(0))])  # [1, heads, ws2, ws2]

    x = g.op("Reshape", ["x", g.const(_i64(1, size, size, d))])
    shifted = partition(roll(_layernorm(g, x, d), size - shift), d)
    qkv = g.linear(shifted, d, 3 * d)
    q, k, v = (g.op("Transpose", [g.op("Reshape", [t, g.const(_i64(nw, ws2, heads, dh))])], perm=[0, 2, 1, 3])
               for t in g.op("Split", [qkv, g.const(_i64(d, d, d))], n_out=3, axis=-1))
    scores = g.op("Mul", [g.op("MatMul", [q, g.op("Transpose", [k], perm=[0, 1, 3, 2])]),
                          g.const(np.float32(dh ** -0.5))])
    scores = g.op("Add", [g.op("Add", [scores, bias]), mask])
    attn = g.op("MatMul", [g.op("Softmax", [scores], axis=-1), v])
    attn = g.op("Reshape", [g.op("Transpose", [attn], perm=[0, 2, 1, 3]), g.const(_i64(nw, ws2, d))])
    attn = g.linear(attn, d, d)
    back = g.op("Reshape", [attn, g.const(_i64(1, size // window, size // window, window, window, d))])
    back = g.op("Reshape", [g.op("Transpose", [back], perm=[0, 1, 3, 2, 4, 5]), g.const(_i64(1, size, size, d))])
    x1 = g.op("Add", [x, roll(back, shift)])
    y = g.op("Add", [x1, g.linear(_gelu_erf(g, g.linear(_layernorm(g, x1, d), d, 2 * d)), 2 * d, d)])
    y = g.op("Reshape", [y, g.const(_i64(1, size * size, d))])
    model = _model(g, [("x", TensorProto.FLOAT, [1, size * size, d])], [_out(g, y, "y")], name="swin_block")
    return model, {"x": np.random.default_rng(52).standard_normal((1, size * size, d)).astype(np.float32)}


# ---- wav2vec2 -----------------------------------------------------------------------------------

def wav2vec2_features(samples: int = 1600, channels: int = 32):
    """The feature encoder: a waveform through strided 1-D convolutions, the first one
    followed by GroupNorm with one group per channel (exported as InstanceNormalization
    and an affine Mul/Add), GELU after each, then LayerNorm over channels and the feature
    projection."""
    g = GraphMaker(61)

    def conv1d(x, cin, cout, k, stride):
        return g.op("Conv", [x, g.weight((cout, cin, k), math.sqrt(1 / (cin * k)))], kernel_shape=[k],
                    strides=[stride], pads=[0, 0])

    x = g.op("Unsqueeze", ["input_values", g.const(_i64(1))])  # [1, 1, samples]
    h = conv1d(x, 1, channels, 10, 5)
    h = g.op("InstanceNormalization", [h, g.const(np.ones(channels, np.float32)),
                                       g.const(np.zeros(channels, np.float32))], epsilon=1e-5)
    h = g.op("Add", [g.op("Mul", [h, g.const((1 + 0.1 * g.rng.standard_normal((channels, 1))).astype(np.float32))]),
                     g.const((0.1 * g.rng.standard_normal((channels, 1))).astype(np.float32))])
    h = _gelu_erf(g, h)
    for k, stride in ((3, 2), (3, 2), (2, 2)):
        h = _gelu_erf(g, conv1d(h, channels, channels, k, stride))
    h = _layernorm(g, g.op("Transpose", [h], perm=[0, 2, 1]), channels)
    y = g.linear(h, channels, 48)
    model = _model(g, [("input_values", TensorProto.FLOAT, [1, samples])], [_out(g, y, "features")],
                   name="wav2vec2_features")
    return model, {"input_values": np.random.default_rng(62).standard_normal((1, samples)).astype(np.float32)}
