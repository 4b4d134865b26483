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
from .transformer_zoo import FLOAT_MIN, _gelu_erf, _gelu_tanh, _i64, _layernorm, _model, _out


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
                         max_positions: int = 128, exporter: str = "torchscript"):
    """BERT with input_ids and attention_mask of [batch, seq]: word, position (a Slice of the
    position-id buffer up to seq) and token-type (a Slice expanded to [batch, seq]) embeddings,
    post-norm layers whose heads are split and merged by Reshapes to shapes computed from
    Shape, and the pooler over [CLS]. TorchScript writes the mask as (1 - mask) * finfo.min
    and picks [CLS] with Gather; dynamo compares (GreaterOrEqual), Expands the comparison to
    [batch, heads, seq, seq] with sizes from shapes, chooses with Where, and slices [CLS]
    (Slice, Squeeze)."""
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
    if exporter == "dynamo":
        keep = g.op("Unsqueeze", [g.op("GreaterOrEqual", ["attention_mask", g.const(_i64(1))]), g.const(_i64(1, 2))])
        scores_shape = g.op("Concat", [_size(g, "input_ids", 0), g.const(_i64(heads)), seq, seq], axis=0)
        mask = g.op("Where", [g.op("Expand", [keep, scores_shape]), g.const(np.float32(0)), g.const(FLOAT_MIN)])
    else:
        m = g.op("Cast", [g.op("Unsqueeze", ["attention_mask", g.const(_i64(1, 2))])], to=TensorProto.FLOAT)
        mask = g.op("Mul", [g.op("Sub", [g.const(np.float32(1)), m]), g.const(FLOAT_MIN)])
    for _ in range(layers):
        q, k, v = (_split_heads(g, g.linear(h, d, d), heads, dh) for _ in range(3))
        scores = g.op("Div", [g.op("MatMul", [q, g.op("Transpose", [k], perm=[0, 1, 3, 2])]),
                              g.const(np.float32(math.sqrt(dh)))])
        attn = g.op("MatMul", [g.op("Softmax", [g.op("Add", [scores, mask])], axis=-1), v])
        h = _layernorm(g, g.op("Add", [h, g.linear(_merge_heads(g, attn, d), d, d)]), d)
        h = _layernorm(g, g.op("Add", [h, g.linear(_gelu_erf(g, g.linear(h, d, ffn)), ffn, d)]), d)
    if exporter == "dynamo":
        first = g.op("Slice", [h, g.const(_i64(0)), g.const(_i64(1)), g.const(_i64(1))])
        cls = g.op("Squeeze", [first, g.const(_i64(1))])
    else:
        cls = g.op("Gather", [h, g.const(np.array(0, np.int64))], axis=1)
    pooled = g.op("Tanh", [g.linear(cls, d, d)])
    model = _model(g, [("input_ids", TensorProto.INT64, ["batch", "seq"]),
                       ("attention_mask", TensorProto.INT64, ["batch", "seq"])],
                   [_out(g, h, "last_hidden_state"), _out(g, pooled, "pooler_output")], opset=17,
                   name=f"bert_dynamic_{exporter}")

    def feeds(batch: int, seq: int, seed: int = 0) -> dict:
        rng = np.random.default_rng(seed)
        mask = np.ones((batch, seq), np.int64)
        for row in range(1, batch):  # padding at the end of every row but the first
            mask[row, seq - (row * seq) // (batch + 1):] = 0
        return {"input_ids": rng.integers(0, vocab, (batch, seq)).astype(np.int64), "attention_mask": mask}
    return model, feeds


def gpt2_decoder_dynamic(d: int = 64, heads: int = 4, layers: int = 2, vocab: int = 96, max_positions: int = 128,
                         positions: str = "input", with_past: bool = True):
    """A GPT-2 causal LM with a KV cache, as exported with `past_key_values`: inputs input_ids
    and position_ids [batch, seq] and past_key_i / past_value_i [batch, heads, past, dh];
    outputs logits [batch, seq, vocab] and present_key_i / present_value_i [batch, heads,
    past + seq, dh] (the past concatenated with this step's keys and values). The causal mask
    is a Slice of the [1, 1, max_positions, max_positions] lower-triangular buffer at rows
    key_length - query_length .. key_length, both computed from shapes. Position ids are an
    input, or (positions="range") computed as TorchScript traces `arange(past, past + seq)`
    from the shapes of past_key_0 and input_ids. (The LM head is a
    weight of its own: GPT-2 ties it to the word embedding, which with random weights makes
    greedy decoding repeat its last token.) Without `with_past`, the prefill-only export:
    no past inputs, presents of this step's keys and values alone (same weights)."""
    g = GraphMaker(41)
    dh = d // heads
    wte = (g.rng.standard_normal((vocab, d)) * 0.5).astype(np.float32)
    wpe = (g.rng.standard_normal((max_positions, d)) * 0.1).astype(np.float32)
    position_ids = "position_ids"
    if positions == "range":
        past = g.op("Gather", [g.op("Shape", ["past_key_0"]), g.const(np.array(2, np.int64))], axis=0)
        seq = g.op("Gather", [g.op("Shape", ["input_ids"]), g.const(np.array(1, np.int64))], axis=0)
        position_ids = g.op("Unsqueeze", [g.op("Range", [past, g.op("Add", [past, seq]), g.const(np.int64(1))]),
                                          g.const(_i64(0))])
    h = g.op("Add", [g.op("Gather", [g.const(wte, "wte"), "input_ids"], axis=0),
                     g.op("Gather", [g.const(wpe, "wpe"), position_ids], axis=0)])
    causal = g.const(np.tril(np.ones((max_positions, max_positions), bool))[None, None], "bias")
    inputs, outputs = [("input_ids", TensorProto.INT64, ["batch", "seq"])], []
    if positions == "input":
        inputs.append(("position_ids", TensorProto.INT64, ["batch", "seq"]))
    for layer in range(layers):
        past_k, past_v = f"past_key_{layer}", f"past_value_{layer}"
        if with_past:
            inputs += [(past_k, TensorProto.FLOAT, ["batch", heads, "past", dh]),
                       (past_v, TensorProto.FLOAT, ["batch", heads, "past", dh])]
        qkv = g.linear(_layernorm(g, h, d), d, 3 * d)
        q, k, v = g.op("Split", [qkv, g.const(_i64(d, d, d))], n_out=3, axis=2)
        q, k, v = (_split_heads_back(g, t, heads, dh) for t in (q, k, v))
        if with_past:
            k = g.op("Concat", [past_k, k], axis=-2)
            v = g.op("Concat", [past_v, v], axis=-2)
        outputs += [_out(g, k, f"present_key_{layer}"), _out(g, v, f"present_value_{layer}")]
        scores = g.op("Div", [g.op("MatMul", [q, g.op("Transpose", [k], perm=[0, 1, 3, 2])]),
                              g.const(np.float32(math.sqrt(dh)))])
        query_length = g.op("Unsqueeze", [g.op("Gather", [g.op("Shape", [q]), g.const(np.array(-2, np.int64))],
                                              axis=0), g.const(_i64(0))])
        key_length = g.op("Unsqueeze", [g.op("Gather", [g.op("Shape", [k]), g.const(np.array(-2, np.int64))],
                                            axis=0), g.const(_i64(0))])
        rows = g.op("Slice", [causal, g.op("Sub", [key_length, query_length]), key_length, g.const(_i64(2))])
        mask = g.op("Slice", [rows, g.const(_i64(0)), key_length, g.const(_i64(3))])
        scores = g.op("Where", [mask, scores, g.const(FLOAT_MIN)])
        attn = _merge_heads(g, g.op("MatMul", [g.op("Softmax", [scores], axis=-1), v]), d)
        h = g.op("Add", [h, g.linear(attn, d, d)])
        h = g.op("Add", [h, g.linear(_gelu_tanh(g, g.linear(_layernorm(g, h, d), d, 4 * d)), 4 * d, d)])
    logits = g.op("MatMul", [_layernorm(g, h, d), g.weight((d, vocab), scale=2 / math.sqrt(d), base="lm_head")])
    model = _model(g, inputs, [_out(g, logits, "logits")] + outputs, opset=17, name="gpt2_dynamic")
    return model, {"heads": heads, "dh": dh, "layers": layers, "vocab": vocab, "positions": positions}


def gpt2_merged_decoder(**config):
    """HF optimum's merged decoder: one model whose If on `use_cache_branch` ([1] bool) runs
    the decoder with past (then) or the prefill-only one (else: the past inputs, given empty,
    go unread), each branch reading the model's inputs and weights from around it."""
    with_past, info = gpt2_decoder_dynamic(**config)
    no_past, _ = gpt2_decoder_dynamic(**config, with_past=False)
    then_branch, then_weights = _as_branch(with_past.graph, "then/")
    else_branch, else_weights = _as_branch(no_past.graph, "else/")
    outputs = [o.name for o in with_past.graph.output]
    choose = helper.make_node("If", ["use_cache_branch"], outputs, then_branch=then_branch, else_branch=else_branch,
                              name="optimum::if")
    inputs = list(with_past.graph.input) + [helper.make_tensor_value_info("use_cache_branch", TensorProto.BOOL, [1])]
    graph = helper.make_graph([choose], "gpt2_merged", inputs,
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
                              then_weights + else_weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    return model, {**info, "merged": True}


def _as_branch(graph, prefix: str) -> tuple:
    """A model's graph as an If branch: no inputs (it reads the outer ones by name), every
    tensor it makes and every weight renamed under `prefix`, the weights handed back to go
    to the outer graph."""
    own = {i.name for i in graph.initializer} | {o for n in graph.node for o in n.output}

    def name(t: str) -> str:
        return prefix + t if t in own else t
    nodes = [helper.make_node(n.op_type, [name(i) for i in n.input], [name(o) for o in n.output],
                              name=prefix + n.name, **{a.name: helper.get_attribute_value(a) for a in n.attribute})
             for n in graph.node]
    weights = []
    for init in graph.initializer:
        renamed = TensorProto()
        renamed.CopyFrom(init)
        renamed.name = name(init.name)
        weights.append(renamed)
    outputs = [helper.make_tensor_value_info(name(o.name), TensorProto.FLOAT, None) for o in graph.output]
    return helper.make_graph(nodes, prefix.strip("/"), [], outputs), weights


def _split_heads_back(g: GraphMaker, t: str, heads: int, dh: int) -> str:
    """[batch, seq, d] -> [batch, heads, seq, dh], the new shape as `x.size()[:-1] + (heads, dh)`."""
    prefix = g.op("Slice", [g.op("Shape", [t]), g.const(_i64(0)), g.const(_i64(-1))])
    shape = g.op("Concat", [prefix, g.const(_i64(heads, dh))], axis=0)
    return g.op("Transpose", [g.op("Reshape", [t, shape])], perm=[0, 2, 1, 3])


def greedy_tokens(run, info: dict, prompt: list, steps: int, feed_past: bool = True) -> tuple[list, list]:
    """Greedy generation with a KV cache: the prompt in one call (past length 0), then one token
    per call. run(feeds) -> outputs. Returns the tokens and each call's last logits. Without
    `feed_past`, the feeds hold no past: `run` keeps the cache itself (Kiln's `cache=`)."""
    layers, heads, dh = info["layers"], info["heads"], info["dh"]
    past = {f"past_{kind}_{i}": np.zeros((1, heads, 0, dh), np.float32) for i in range(layers)
            for kind in ("key", "value")}
    ids, tokens, logits = np.array([prompt], np.int64), [], []
    start = 0
    for _ in range(steps + 1):
        feeds = {"input_ids": ids, **(past if feed_past else {})}
        if info.get("merged"):  # (optimum's merged decoder: the prefill takes the branch without past)
            feeds["use_cache_branch"] = np.array([start > 0])
        if info["positions"] == "input":
            feeds["position_ids"] = np.arange(start, start + ids.shape[1], dtype=np.int64)[None]
        out = run(feeds)
        last = out["logits"][0, -1]
        logits.append(last)
        token = int(np.argmax(last))
        tokens.append(token)
        past = {f"past_{kind}_{i}": out[f"present_{kind}_{i}"] for i in range(layers) for kind in ("key", "value")}
        start += ids.shape[1]
        ids = np.array([[token]], np.int64)
    return tokens, logits


def _silu_conv(g: GraphMaker, x: str, cin: int, cout: int, k: int, stride: int = 1) -> str:
    h = g.conv(x, cin, cout, k, stride=stride)
    return g.op("Mul", [h, g.op("Sigmoid", [h])])


def _anchors(g: GraphMaker, feature: str, stride: float) -> tuple[str, str]:
    """YOLOv8's make_anchors as its dynamic export computes it from the feature map's shape:
    cell centres ([h*w, 2], x then y) from float Ranges over Casts of Shape entries, and a
    [h*w, 1] column of the stride from ConstantOfShape."""
    def size(axis):
        return g.op("Gather", [g.op("Shape", [feature]), g.const(np.array(axis, np.int64))], axis=0)
    h, w = size(2), size(3)
    half, one = g.const(np.float32(0.5)), g.const(np.float32(1))
    sx = g.op("Add", [g.op("Range", [g.const(np.float32(0)), g.op("Cast", [w], to=TensorProto.FLOAT), one]), half])
    sy = g.op("Add", [g.op("Range", [g.const(np.float32(0)), g.op("Cast", [h], to=TensorProto.FLOAT), one]), half])
    hw = g.op("Concat", [g.op("Unsqueeze", [h, g.const(_i64(0))]), g.op("Unsqueeze", [w, g.const(_i64(0))])], axis=0)
    gx = g.op("Expand", [g.op("Unsqueeze", [sx, g.const(_i64(0))]), hw])
    gy = g.op("Expand", [g.op("Unsqueeze", [sy, g.const(_i64(1))]), hw])
    grid = g.op("Concat", [g.op("Unsqueeze", [gx, g.const(_i64(-1))]), g.op("Unsqueeze", [gy, g.const(_i64(-1))])],
                axis=-1)
    points = g.op("Reshape", [grid, g.const(_i64(-1, 2))])
    count = g.op("Unsqueeze", [g.op("Mul", [h, w]), g.const(_i64(0))])
    strides = g.op("ConstantOfShape", [g.op("Concat", [count, g.const(_i64(1))], axis=0)],
                   value=helper.make_tensor("v", TensorProto.FLOAT, [1], [stride]))
    return points, strides


def yolo_style_dynamic(classes: int = 3):
    """A YOLOv8-style detector exported with dynamic axes: images [batch, 3, height, width],
    SiLU convs down to strides 8 and 16 (3x3 stride 2, so odd sizes round up), a C2f-like
    block (Split, Concat), SPPF (three 5x5 max pools), a nearest 2x upsample joined to the
    stride-8 map, and a head per scale whose boxes are decoded against anchors computed from
    the feature maps' shapes (`_anchors`). Output [batch, 4 + classes, anchors]: boxes as
    centre and size in pixels, then class scores."""
    g = GraphMaker(61)
    x = _silu_conv(g, "images", 3, 8, 3, 2)
    x = _silu_conv(g, x, 8, 16, 3, 2)
    a, b = g.op("Split", [_silu_conv(g, x, 16, 16, 1), g.const(_i64(8, 8))], n_out=2, axis=1)
    x = _silu_conv(g, g.op("Concat", [a, b, _silu_conv(g, b, 8, 8, 3)], axis=1), 24, 16, 1)
    p3 = _silu_conv(g, x, 16, 32, 3, 2)
    p4 = _silu_conv(g, _silu_conv(g, p3, 32, 32, 3, 2), 32, 16, 1)
    pools = [p4]
    for _ in range(3):
        pools.append(g.op("MaxPool", [pools[-1]], kernel_shape=[5, 5], strides=[1, 1], pads=[2, 2, 2, 2]))
    p4 = _silu_conv(g, g.op("Concat", pools, axis=1), 64, 32, 1)
    up = g.op("Resize", [p4, "", g.const(np.array([1, 1, 2, 2], np.float32))], mode="nearest",
              coordinate_transformation_mode="asymmetric", nearest_mode="floor")
    p3 = _silu_conv(g, g.op("Concat", [up, p3], axis=1), 64, 32, 3)
    no = 4 + classes
    heads, points, strides = [], [], []
    for feature, stride in ((p3, 8.0), (p4, 16.0)):
        y = g.conv(_silu_conv(g, feature, 32, 32, 3), 32, no, 1)
        batch = g.op("Unsqueeze", [g.op("Gather", [g.op("Shape", [y]), g.const(np.array(0, np.int64))], axis=0),
                                   g.const(_i64(0))])
        heads.append(g.op("Reshape", [y, g.op("Concat", [batch, g.const(_i64(no, -1))], axis=0)]))
        p, s = _anchors(g, feature, stride)
        points.append(p)
        strides.append(s)
    out = g.op("Concat", heads, axis=2)
    anchors = g.op("Transpose", [g.op("Concat", points, axis=0)], perm=[1, 0])
    stride_row = g.op("Transpose", [g.op("Concat", strides, axis=0)], perm=[1, 0])
    box = g.op("Slice", [out, g.const(_i64(0)), g.const(_i64(4)), g.const(_i64(1))])
    cls = g.op("Slice", [out, g.const(_i64(4)), g.const(_i64(no)), g.const(_i64(1))])
    lt = g.op("Slice", [box, g.const(_i64(0)), g.const(_i64(2)), g.const(_i64(1))])
    rb = g.op("Slice", [box, g.const(_i64(2)), g.const(_i64(4)), g.const(_i64(1))])
    x1y1, x2y2 = g.op("Sub", [anchors, lt]), g.op("Add", [anchors, rb])
    centre = g.op("Div", [g.op("Add", [x1y1, x2y2]), g.const(np.float32(2))])
    boxes = g.op("Mul", [g.op("Concat", [centre, g.op("Sub", [x2y2, x1y1])], axis=1), stride_row])
    y = g.op("Concat", [boxes, g.op("Sigmoid", [cls])], axis=1)
    return _model(g, [("images", TensorProto.FLOAT, ["batch", 3, "height", "width"])], [_out(g, y, "output0")],
                  opset=17, name="yolo_style_dynamic")


def cnn_dynamic_image():
    """A CNN over images [batch, 3, height, width] of any size in its bounds, odd ones too:
    a strided conv whose output height is ceil(h / 2), SiLU, a depthwise 3x3, average and
    max pools with padding, a nearest 2x upsample joined back, a 1x1 conv, and a classifier
    over the global average (Flatten, Gemm) beside the feature map."""
    g = GraphMaker(71)
    x = _silu_conv(g, "images", 3, 8, 3, 2)
    x = g.conv(x, 8, 8, 3, group=8)
    x = g.op("AveragePool", [x], kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1])
    small = g.op("MaxPool", [x], kernel_shape=[2, 2], strides=[2, 2])
    up = g.op("Resize", [_silu_conv(g, small, 8, 8, 3), "", g.const(np.array([1, 1, 2, 2], np.float32))],
              mode="nearest")
    cropped = g.op("Slice", [x, g.const(_i64(0, 0)), g.op("Slice", [g.op("Shape", [up]), g.const(_i64(2)),
                                                                      g.const(_i64(4))]), g.const(_i64(2, 3))])
    features = g.conv(g.op("Concat", [cropped, up], axis=1), 16, 12, 1)
    pooled = g.op("Flatten", [g.op("GlobalAveragePool", [features])], axis=1)
    logits = g.op("Gemm", [pooled, g.weight((5, 12)), g.const(np.zeros(5, np.float32))], transB=1)
    return _model(g, [("images", TensorProto.FLOAT, ["batch", 3, "height", "width"])],
                  [_out(g, features, "features"), _out(g, logits, "logits")], opset=17, name="cnn_dynamic_image")


def segmentation_dynamic(classes: int = 4):
    """A segmentation net over images [batch, 3, height, width], as torchvision's FCN and a
    UNet export them with dynamic axes: two stride-2 convs (odd sizes round up), a decoder
    that upsamples by a 2x2 ConvTranspose cropped to the skip's size (Slice ends from its
    Shape) and joined to it, a bilinear 2x Resize by scales, and the head's logits resized
    back to the image's own height and width (bilinear, `sizes` from the images' Shape, as
    F.interpolate(size=x.shape[-2:]) exports), beside a bicubic align-corners 2x of the
    coarse map."""
    g = GraphMaker(83)
    skip = g.op("Relu", [g.conv("images", 3, 8, 3, stride=2)])
    coarse = g.op("Relu", [g.conv(skip, 8, 16, 3, stride=2)])
    up = g.op("ConvTranspose", [coarse, g.weight((16, 8, 2, 2)), g.const(np.zeros(8, np.float32))],
              kernel_shape=[2, 2], strides=[2, 2])
    up = g.op("Slice", [up, g.const(_i64(0, 0)), g.op("Slice", [g.op("Shape", [skip]), g.const(_i64(2)),
                                                                 g.const(_i64(4))]), g.const(_i64(2, 3))])
    x = g.op("Relu", [g.conv(g.op("Concat", [skip, up], axis=1), 16, 8, 3)])
    x = g.op("Resize", [x, "", g.const(np.array([1, 1, 2, 2], np.float32))], mode="linear")
    logits = g.conv(x, 8, classes, 1)
    sizes = g.op("Concat", [g.op("Slice", [g.op("Shape", [logits]), g.const(_i64(0)), g.const(_i64(2))]),
                            g.op("Slice", [g.op("Shape", ["images"]), g.const(_i64(2)), g.const(_i64(4))])], axis=0)
    out = g.op("Resize", [logits, "", "", sizes], mode="linear", coordinate_transformation_mode="pytorch_half_pixel")
    aux = g.op("Resize", [g.conv(coarse, 16, classes, 1), "", g.const(np.array([1, 1, 2, 2], np.float32))],
               mode="cubic", coordinate_transformation_mode="align_corners")
    return _model(g, [("images", TensorProto.FLOAT, ["batch", 3, "height", "width"])],
                  [_out(g, out, "out"), _out(g, aux, "aux")], opset=17, name="segmentation_dynamic")


def _pad_to(g: GraphMaker, x: str, like: str) -> str:
    """milesial's UNet: x padded to `like`'s height and width, F.pad(x, [dx // 2, dx - dx // 2,
    dy // 2, dy - dy // 2]) with dy, dx the differences of their Shapes, as TorchScript exports it."""
    def diff(axis):
        return g.op("Sub", [_size(g, like, axis), _size(g, x, axis)])
    dy, dx = diff(2), diff(3)
    two = g.const(_i64(2))
    top, left = g.op("Div", [dy, two]), g.op("Div", [dx, two])
    zeros = g.const(_i64(0, 0))
    pads = g.op("Concat", [zeros, top, left, zeros, g.op("Sub", [dy, top]), g.op("Sub", [dx, left])], axis=0)
    return g.op("Pad", [x, pads], mode="constant")


def unet_dynamic(c: int = 8, classes: int = 3):
    """A small UNet over images [batch, 3, height, width] of any size in its bounds: two 2x2
    max pools down (odd sizes round down), 2x2 ConvTransposes up, each padded to its skip's
    size by the difference of their Shapes (sizes the module computes) and joined to it."""
    g = GraphMaker(89)
    d1 = g.op("Relu", [g.conv("images", 3, c, 3)])
    d2 = g.op("Relu", [g.conv(g.op("MaxPool", [d1], kernel_shape=[2, 2], strides=[2, 2]), c, 2 * c, 3)])
    d3 = g.op("Relu", [g.conv(g.op("MaxPool", [d2], kernel_shape=[2, 2], strides=[2, 2]), 2 * c, 4 * c, 3)])
    x = d3
    for skip, cin, cout in ((d2, 4 * c, 2 * c), (d1, 2 * c, c)):
        up = g.op("ConvTranspose", [x, g.weight((cin, cout, 2, 2)), g.const(np.zeros(cout, np.float32))],
                  kernel_shape=[2, 2], strides=[2, 2])
        joined = g.op("Concat", [skip, _pad_to(g, up, skip)], axis=1)
        x = g.op("Relu", [g.conv(joined, 2 * cout, cout, 3)])
    return _model(g, [("images", TensorProto.FLOAT, ["batch", 3, "height", "width"])],
                  [_out(g, g.conv(x, c, classes, 1), "masks")], opset=17, name="unet_dynamic")


def squeezenet_dynamic(classes: int = 6):
    """SqueezeNet 1.1's shape over images [batch, 3, height, width]: an unpadded stride-2
    conv, 3x3 stride-2 max pools with ceil_mode (whose last window the bounds must show to
    start inside the input), Fire modules (a squeeze 1x1, then 1x1 and 3x3 expands joined),
    a 1x1 classifier conv and a global average."""
    g = GraphMaker(97)

    def fire(x, cin, squeeze, expand):
        s = g.op("Relu", [g.conv(x, cin, squeeze, 1)])
        return g.op("Concat", [g.op("Relu", [g.conv(s, squeeze, expand, 1)]),
                               g.op("Relu", [g.conv(s, squeeze, expand, 3)])], axis=1)
    x = g.op("Relu", [g.conv("images", 3, 16, 3, stride=2, pad=0)])
    x = g.op("MaxPool", [x], kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)
    x = fire(fire(x, 16, 8, 16), 32, 8, 16)
    x = g.op("MaxPool", [x], kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)
    x = g.op("Relu", [g.conv(fire(x, 32, 8, 24), 48, classes, 1)])
    logits = g.op("Flatten", [g.op("GlobalAveragePool", [x])], axis=1)
    return _model(g, [("images", TensorProto.FLOAT, ["batch", 3, "height", "width"])], [_out(g, logits, "logits")],
                  opset=17, name="squeezenet_dynamic")


def vit_dynamic(d: int = 32, heads: int = 2, patch: int = 4, classes: int = 5):
    """A ViT over images [batch, 3, height, width] as torch exports one with dynamic axes:
    patches flattened to (height//p)*(width//p) tokens, the class token expanded to the
    batch through TorchScript's spelling of expand(batch, -1, -1) (a Where on an Equal of the
    shape with -1, decided by the bounds), heads split by a Reshape with a -1 (the dynamo
    exporter's allowzero=1 spelling) whose size is a whole multiple of tokens + 1, one
    attention block and a head on the class token."""
    g = GraphMaker(101)
    p = g.conv("images", 3, d, patch, stride=patch, pad=0)
    shape = g.op("Concat", [g.op("Slice", [g.op("Shape", [p]), g.const(_i64(0)), g.const(_i64(2))]),
                            g.const(_i64(-1))], axis=0)
    tokens = g.op("Transpose", [g.op("Reshape", [p, shape])], perm=[0, 2, 1])  # [batch, patches, d]
    want = g.op("Concat", [_size(g, tokens, 0), g.const(_i64(-1, -1))], axis=0)
    minus_one = g.const(_i64(-1, -1, -1))
    expand_to = g.op("Where", [g.op("Equal", [want, minus_one]), g.const(_i64(1, 1, 1)), want])
    cls = g.op("Expand", [g.weight((1, 1, d)), expand_to])
    x = g.op("Concat", [cls, tokens], axis=1)  # [batch, patches + 1, d]
    qkv = g.op("MatMul", [x, g.weight((d, 3 * d))])
    q, k, v = g.op("Split", [qkv, g.const(_i64(d, d, d))], n_out=3, axis=2)

    def split_heads(t):
        shape = g.op("Concat", [_size(g, t, 0), g.const(_i64(-1, heads, d // heads))], axis=0)
        return g.op("Transpose", [g.op("Reshape", [t, shape], allowzero=1)], perm=[0, 2, 1, 3])
    q, k, v = split_heads(q), split_heads(k), split_heads(v)
    scores = g.op("Mul", [g.op("MatMul", [q, g.op("Transpose", [k], perm=[0, 1, 3, 2])]),
                          g.const(np.float32(1 / math.sqrt(d // heads)))])
    attended = g.op("Transpose", [g.op("MatMul", [g.op("Softmax", [scores], axis=-1), v])], perm=[0, 2, 1, 3])
    flat_shape = g.op("Concat", [g.const(_i64(-1)), _size(g, x, 1), g.const(_i64(d))], axis=0)
    x = g.op("Add", [x, g.op("Reshape", [attended, flat_shape], allowzero=1)])
    first = g.op("Gather", [x, g.const(np.array(0, np.int64))], axis=1)
    logits = g.op("MatMul", [first, g.weight((d, classes))])
    return _model(g, [("images", TensorProto.FLOAT, ["batch", 3, "height", "width"])], [_out(g, logits, "logits")],
                  opset=17, name="vit_dynamic")


def audio_dynamic(channels: int = 16, groups: int = 4):
    """wav2vec2's feature encoder over waveforms [batch, samples]: strided Conv1ds, a
    GroupNorm as TorchScript exports it (Reshape to [batch, groups, -1], InstanceNormalization,
    Reshape back, scale and shift), GELU (Erf), and a grouped conv positional embedding whose
    output is trimmed by one step (a Slice to -1), under a LayerNorm over channels last."""
    g = GraphMaker(103)
    x = g.op("Unsqueeze", ["wav", g.const(_i64(1))])
    x = g.op("Conv", [x, g.weight((channels, 1, 10))], kernel_shape=[10], strides=[5])
    grouped = g.op("Reshape", [x, g.const(_i64(0, groups, -1))])
    normed = g.op("InstanceNormalization", [grouped, g.const(np.ones(groups, np.float32)),
                                            g.const(np.zeros(groups, np.float32))], epsilon=1e-5)
    x = g.op("Reshape", [normed, g.op("Shape", [x])])
    x = g.op("Add", [g.op("Mul", [x, g.const((np.random.default_rng(1).random((channels, 1)) + 0.5)
                                                .astype(np.float32))]), g.const(np.full((channels, 1), 0.1, np.float32))])
    x = _gelu_erf(g, x)
    x = _gelu_erf(g, g.op("Conv", [x, g.weight((channels, channels, 3))], kernel_shape=[3], strides=[2]))
    pos = g.op("Conv", [x, g.weight((channels, channels // 4, 8))], kernel_shape=[8], pads=[4, 4], group=4)
    pos = g.op("Slice", [pos, g.const(_i64(0)), g.const(_i64(-1)), g.const(_i64(2))])
    x = g.op("Transpose", [g.op("Add", [x, _gelu_erf(g, pos)])], perm=[0, 2, 1])
    out = _layernorm(g, x, channels)
    return _model(g, [("wav", TensorProto.FLOAT, ["batch", "samples"])], [_out(g, out, "features")],
                  opset=17, name="audio_dynamic")


def swin_dynamic(d: int = 16, window: int = 4):
    """A Swin stage over images [batch, 3, height, width] as TorchScript exports HF's: 4x4
    patches, the map padded to a multiple of the window by ((window - w % window) % window)
    (Mod of sizes, which may be negative before the second Mod), cut into windows (Reshape,
    Transpose), a per-window product, the windows put back and the padding cropped (Slice to
    the Shape's sizes), then patch merging: the four step-2 Slices x[:, 0::2, 0::2], ...
    joined and projected (their sizes agree where the map's are even: heights and widths
    that are multiples of 8; elsewhere the Concat is refused at run time, as onnxruntime
    fails there too)."""
    g = GraphMaker(107)
    x = g.op("Transpose", [g.conv("images", 3, d, 4, stride=4, pad=0)], perm=[0, 2, 3, 1])  # [b, h, w, d]
    w_const = g.const(_i64(window))

    def pad_to_window(axis):
        return g.op("Mod", [g.op("Sub", [w_const, g.op("Mod", [_size(g, x, axis), w_const])]), w_const])
    pad_h, pad_w = pad_to_window(1), pad_to_window(2)
    zeros = g.const(_i64(0, 0))
    padded = g.op("Pad", [x, g.op("Concat", [zeros, zeros, g.const(_i64(0)), pad_h, pad_w, g.const(_i64(0))],
                                  axis=0)])  # (at the bottom and right only)
    hp, wp = _size(g, padded, 1), _size(g, padded, 2)
    rows, cols = g.op("Div", [hp, w_const]), g.op("Div", [wp, w_const])
    windows = g.op("Reshape", [padded, g.op("Concat", [_size(g, padded, 0), rows, w_const, cols, w_const,
                                                      g.const(_i64(d))], axis=0)])
    windows = g.op("Transpose", [windows], perm=[0, 1, 3, 2, 4, 5])
    windows = g.op("Relu", [g.op("MatMul", [windows, g.weight((d, d))])])
    back = g.op("Reshape", [g.op("Transpose", [windows], perm=[0, 1, 3, 2, 4, 5]),
                            g.op("Concat", [_size(g, padded, 0), hp, wp, g.const(_i64(d))], axis=0)])
    cropped = g.op("Slice", [back, g.const(_i64(0, 0)), g.op("Concat", [_size(g, x, 1), _size(g, x, 2)], axis=0),
                             g.const(_i64(1, 2))])
    x = g.op("Add", [x, cropped])
    parts = [g.op("Slice", [x, g.const(_i64(r, c)), g.const(_i64(2 ** 62, 2 ** 62)), g.const(_i64(1, 2)),
                            g.const(_i64(2, 2))]) for r, c in ((0, 0), (1, 0), (0, 1), (1, 1))]
    merged = g.op("MatMul", [g.op("Concat", parts, axis=-1), g.weight((4 * d, 2 * d))])
    return _model(g, [("images", TensorProto.FLOAT, ["batch", 3, "height", "width"])], [_out(g, merged, "merged")],
                  opset=17, name="swin_dynamic")
