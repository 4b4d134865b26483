"""The fused ops onnxruntime's transformer optimizer writes into BERT-style encoders
(com.microsoft Attention, EmbedLayerNormalization, SkipLayerNormalization, Gelu, BiasGelu,
FastGelu, QuickGelu), against onnxruntime running the same nodes, then a whole encoder in
the optimizer's spelling with a padding mask, built with a symbolic batch and sequence."""
import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from modelkiln.ir.graph import UnsupportedError
from modelkiln.orchestrator.api import build

OPSETS = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
F = TensorProto.FLOAT


def _model(nodes, inputs, outputs, inits):
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info(o, F, None) for o in outputs], inits)
    return helper.make_model(graph, opset_imports=OPSETS)


def _weight(rng, name, *shape, scale=0.3):
    return numpy_helper.from_array((scale * rng.standard_normal(shape)).astype(np.float32), name)


def _compare(model, feeds_list, dims, executor, atol=2e-5):
    named = {d.dim_param for i in model.graph.input for d in i.type.tensor_type.shape.dim}
    module = build(model, dims={k: v for k, v in dims.items() if k in named}, executor=executor, cache=None,
                   progress=False).load()
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    for feeds in feeds_list:
        got = module.run(feeds)
        for name, want in zip(names, session.run(names, feeds)):
            np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=atol, err_msg=name)


@pytest.mark.parametrize("op,extra", [("Gelu", {}), ("BiasGelu", {"bias": True}), ("FastGelu", {}),
                                      ("FastGelu", {"bias": True}), ("QuickGelu", {}), ("QuickGelu", {"alpha": 1.3})])
def test_gelu_family(op, extra, executor):
    rng = np.random.default_rng(0)
    inputs, inits = ["x"], []
    if extra.get("bias"):
        inits.append(_weight(rng, "b", 24, scale=1.0))
        inputs.append("b")
    attrs = {"alpha": extra["alpha"]} if "alpha" in extra else {}
    model = _model([helper.make_node(op, inputs, ["y"], domain="com.microsoft", **attrs)],
                   [helper.make_tensor_value_info("x", F, ["n", 24])], ["y"], inits)
    feeds = [{"x": (3 * rng.standard_normal((n, 24))).astype(np.float32)} for n in (1, 5)]
    _compare(model, feeds, {"n": (1, 5)}, executor)


def _attention_model(rng, d, heads, mask_kind, unidirectional=0, v_size=None):
    v_size = v_size or d
    inits = [_weight(rng, "w", d, 2 * d + v_size), _weight(rng, "b", 2 * d + v_size)]
    # (ends then starts are 2 * batch long, which a dim_param cannot say: that form's batch is 2)
    batch = 2 if mask_kind == "ends_starts" else "batch"
    inputs = [helper.make_tensor_value_info("x", F, [batch, "seq", d])]
    mask_shapes = {"lengths": ["batch"], "ends_starts": [4], "raw": ["batch", "seq"], "raw3d": ["batch", "seq", "seq"]}
    node_inputs = ["x", "w", "b"]
    if mask_kind:
        inputs.append(helper.make_tensor_value_info("mask", TensorProto.INT32, mask_shapes[mask_kind]))
        node_inputs.append("mask")
    attrs = {"qkv_hidden_sizes": [d, d, v_size]} if v_size != d else {}
    node = helper.make_node("Attention", node_inputs, ["y"], domain="com.microsoft", num_heads=heads,
                            unidirectional=unidirectional, **attrs)
    return _model([node], inputs, ["y"], inits)


def _mask(kind, lengths, seq, starts=None):
    batch = len(lengths)
    if kind == "lengths":
        return np.array(lengths, np.int32)
    if kind == "ends_starts":
        return np.array(list(lengths) + list(starts), np.int32)
    keep = (np.arange(seq)[None] < np.array(lengths)[:, None]).astype(np.int32)
    return keep if kind == "raw" else np.repeat(keep[:, None], seq, axis=1).reshape(batch, seq, seq)


@pytest.mark.parametrize("mask_kind,unidirectional,v_size", [
    (None, 0, None), ("lengths", 0, None), ("ends_starts", 0, None), ("raw", 0, None), ("raw3d", 0, None),
    (None, 1, None), ("raw", 1, None), ("lengths", 0, 48)],
    ids=["no-mask", "lengths", "ends-starts", "raw", "raw-3d", "causal", "raw-causal", "v-size"])
def test_attention(mask_kind, unidirectional, v_size, executor):
    """Every mask_index form onnxruntime reads (right padding as lengths, left padding as
    ends then starts, raw 2-D and 3-D masks), causal, a V of another width."""
    rng = np.random.default_rng(1)
    model = _attention_model(rng, 32, 4, mask_kind, unidirectional, v_size)
    feeds = []
    for batch, seq in ((2, 7), (2, 5)) if mask_kind == "ends_starts" else ((1, 7), (3, 5)):
        f = {"x": rng.standard_normal((batch, seq, 32)).astype(np.float32)}
        if mask_kind:
            lengths = [seq - (i % 3) for i in range(batch)]
            f["mask"] = _mask(mask_kind, lengths, seq, starts=[i % 2 for i in range(batch)])
        feeds.append(f)
    dims = {"batch": (1, 3), "seq": (1, 8)}
    _compare(model, feeds, dims, executor)


def test_attention_refuses_a_past():
    rng = np.random.default_rng(2)
    model = _attention_model(rng, 32, 4, None)
    model.graph.node[0].input.extend(["", "past"])
    model.graph.input.append(helper.make_tensor_value_info("past", F, [2, 1, 4, 3, 8]))
    with pytest.raises(UnsupportedError, match="Attention.*input 4 \\(past\\) is not supported"):
        build(model, dims={"batch": (1, 1), "seq": (1, 8)}, cache=None, progress=False)


def _optimized_bert(rng, d=32, heads=4, layers=2, vocab=50, ffn=64, activation="BiasGelu"):
    """An encoder as onnxruntime's transformer optimizer leaves one: EmbedLayerNormalization
    (words, positions, segments; its mask_index into every Attention), then per layer
    Attention, its output projection, SkipLayerNormalization (bias fused), the MLP with a
    fused Gelu, SkipLayerNormalization."""
    inits, nodes = [], []

    def weight(name, *shape, scale=0.3):
        inits.append(_weight(rng, name, *shape, scale=scale))
        return name
    nodes.append(helper.make_node(
        "EmbedLayerNormalization", ["input_ids", "segment_ids", weight("words", vocab, d), weight("positions", 16, d),
                                    weight("segments", 2, d), weight("emb_gamma", d, scale=1.0),
                                    weight("emb_beta", d), "attention_mask"],
        ["h0", "mask_index"], domain="com.microsoft", epsilon=1e-12))
    hidden = "h0"
    for i in range(layers):
        nodes.append(helper.make_node("Attention", [hidden, weight(f"qkv{i}", d, 3 * d), weight(f"qkv_b{i}", 3 * d),
                                                    "mask_index"], [f"att{i}"], domain="com.microsoft",
                                      num_heads=heads))
        nodes.append(helper.make_node("MatMul", [f"att{i}", weight(f"o{i}", d, d)], [f"proj{i}"]))
        nodes.append(helper.make_node("SkipLayerNormalization", [f"proj{i}", hidden, weight(f"ln1_g{i}", d, scale=1.0),
                                                                 weight(f"ln1_b{i}", d), weight(f"o_b{i}", d)],
                                      [f"n1_{i}"], domain="com.microsoft", epsilon=1e-12))
        nodes.append(helper.make_node("MatMul", [f"n1_{i}", weight(f"up{i}", d, ffn)], [f"up{i}_out"]))
        nodes.append(helper.make_node(activation, [f"up{i}_out", weight(f"up_b{i}", ffn)], [f"act{i}"],
                                      domain="com.microsoft"))
        nodes.append(helper.make_node("MatMul", [f"act{i}", weight(f"down{i}", ffn, d)], [f"down{i}_out"]))
        hidden = f"h{i + 1}"
        nodes.append(helper.make_node("SkipLayerNormalization", [f"down{i}_out", f"n1_{i}",
                                                                 weight(f"ln2_g{i}", d, scale=1.0),
                                                                 weight(f"ln2_b{i}", d), weight(f"down_b{i}", d)],
                                      [hidden], domain="com.microsoft", epsilon=1e-12))
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT32, ["batch", "seq"])
              for n in ("input_ids", "segment_ids", "attention_mask")]
    return _model(nodes, inputs, [hidden], inits)


@pytest.mark.parametrize("activation", ["BiasGelu", "FastGelu"])
def test_an_optimized_bert_encoder(activation, executor):
    """The whole encoder with padded batches, one build for batch 1-3 and sequence 1-16."""
    rng = np.random.default_rng(3)
    model = _optimized_bert(rng, activation=activation)
    feeds = []
    for batch, seq in ((1, 9), (3, 16), (2, 4)):
        lengths = [seq - (2 * i) % seq for i in range(batch)]
        feeds.append({"input_ids": rng.integers(0, 50, (batch, seq)).astype(np.int32),
                      "segment_ids": (np.arange(seq)[None] >= seq // 2).repeat(batch, 0).astype(np.int32),
                      "attention_mask": (np.arange(seq)[None] < np.array(lengths)[:, None]).astype(np.int32)})
    _compare(model, feeds, {"batch": (1, 3), "seq": (1, 16)}, executor, atol=5e-5)


def test_int32_ids_gathered_into_a_layer_norm(executor):
    """int32 indices (BERT exports often take int32 ids) in a Gather fused into the kernel
    of the LayerNormalization reading it: the index widens to i64 (it was a malformed
    kernel)."""
    rng = np.random.default_rng(4)
    nodes = [helper.make_node("Gather", ["table", "ids"], ["rows"]),
             helper.make_node("LayerNormalization", ["rows", "gamma"], ["y"], axis=-1)]
    model = _model(nodes, [helper.make_tensor_value_info("ids", TensorProto.INT32, ["batch", 5])], ["y"],
                   [_weight(rng, "table", 50, 16), _weight(rng, "gamma", 16)])
    feeds = [{"ids": np.array([[1, 2, 3, -1, 49]] * n, np.int32)} for n in (1, 2)]
    _compare(model, feeds, {"batch": (1, 2)}, executor)


def _mha_model(rng, kind):
    """com.microsoft.MultiHeadAttention as the optimizer fuses it: self attention with the
    projections' bias and a raw padding mask, cross attention (keys of another length, a V
    of another width, lengths as the mask), a causal decoder step with a past and presents,
    and self attention with an attention_bias."""
    d, heads, v_size = 32, 4, 48 if kind == "cross" else 32
    inputs = [helper.make_tensor_value_info("q", F, ["batch", "seq", d])]
    kv_len = "kv" if kind == "cross" else "seq"
    inputs += [helper.make_tensor_value_info("k", F, ["batch", kv_len, d]),
               helper.make_tensor_value_info("v", F, ["batch", kv_len, v_size])]
    node_inputs, inits, outputs, attrs = ["q", "k", "v", "", "", "", "", ""], [], ["y"], {}
    if kind in ("self", "cross"):
        inits.append(_weight(rng, "bias", 2 * d + v_size))
        node_inputs[3] = "bias"
    if kind == "self":
        inputs.append(helper.make_tensor_value_info("mask", TensorProto.INT32, ["batch", "seq"]))
        node_inputs[4] = "mask"
    if kind == "cross":
        inputs.append(helper.make_tensor_value_info("mask", TensorProto.INT32, ["batch"]))
        node_inputs[4] = "mask"
    if kind == "bias":
        inputs.append(helper.make_tensor_value_info("attention_bias", F, [1, heads, "seq", "seq"]))
        node_inputs[5] = "attention_bias"
    if kind == "past":
        inputs += [helper.make_tensor_value_info(n, F, ["batch", heads, "past", d // heads])
                   for n in ("past_k", "past_v")]
        node_inputs[6:8] = ["past_k", "past_v"]
        outputs += ["present_k", "present_v"]
        attrs["unidirectional"] = 1
    node = helper.make_node("MultiHeadAttention", node_inputs, outputs, domain="com.microsoft", num_heads=heads,
                            **attrs)
    return _model([node], inputs, outputs, inits)


@pytest.mark.parametrize("kind", ["self", "cross", "past", "bias"])
def test_multi_head_attention(kind, executor):
    rng = np.random.default_rng(6)
    model = _mha_model(rng, kind)
    feeds = []
    for batch, seq, kv, past in ((1, 6, 9, 0), (3, 4, 2, 5), (2, 1, 7, 11)):
        f = {"q": rng.standard_normal((batch, seq, 32)).astype(np.float32)}
        keys = kv if kind == "cross" else seq
        f["k"] = rng.standard_normal((batch, keys, 32)).astype(np.float32)
        f["v"] = rng.standard_normal((batch, keys, 48 if kind == "cross" else 32)).astype(np.float32)
        if kind == "self":
            f["mask"] = (np.arange(seq)[None] < np.maximum(seq - np.arange(batch), 1)[:, None]).astype(np.int32)
        if kind == "cross":
            f["mask"] = np.maximum(kv - np.arange(batch), 1).astype(np.int32)
        if kind == "bias":
            f["attention_bias"] = rng.standard_normal((1, 4, seq, seq)).astype(np.float32)
        if kind == "past":
            f.update(past_k=rng.standard_normal((batch, 4, past, 8)).astype(np.float32),
                     past_v=rng.standard_normal((batch, 4, past, 8)).astype(np.float32))
        feeds.append(f)
    _compare(model, feeds, {"batch": (1, 3), "seq": (1, 8), "kv": (1, 10), "past": (0, 12)}, executor)
    if kind == "past":  # (its present is Concat(past, new): kept in place like any KV cache)
        result = build(model, dims={"batch": (1, 3), "seq": (1, 8), "past": (0, 12)}, executor=executor, cache=None,
                       progress=False)
        assert [(c["past"], c["present"]) for c in result.load().manifest.caches] == \
            [("past_k", "present_k"), ("past_v", "present_v")]
