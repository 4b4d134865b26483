"""The com.microsoft ops onnxruntime-genai's model builder writes into every LLM it exports
(GroupQueryAttention, RotaryEmbedding, SkipSimplifiedLayerNormalization, and
SimplifiedLayerNormalization in the default domain) and SkipLayerNormalization, which
onnxruntime's transformer optimizer writes into BERTs: each against onnxruntime running the
same node, then a genai-shaped int4 decoder generating onnxruntime's tokens."""
import json

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from modelkiln.artifacts.errors import KilnError
from modelkiln.ir.graph import UnsupportedError
from modelkiln.orchestrator.api import build
from tests import genai_zoo, model_zoo
from tests.conftest import shared_cache

HEADS, KV_HEADS = 4, 2
MS_OPSETS = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]


def _session(model):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _compare(model, module, feeds: dict, atol=2e-5, what=""):
    want = dict(zip([o.name for o in model.graph.output], _session(model).run(None, feeds)))
    got = module.run(feeds)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=atol, err_msg=f"{name} {what}")


# ---- GroupQueryAttention ----------------------------------------------------------------------

def _gqa_model(packed: bool, head_size: int, rotary_dim: int | None, head_sink: bool = False, bias_heads: int = 0,
               **attrs):
    """One GQA node as the builder wires it: seqlens_k and total_sequence_length from an
    attention mask [batch, total]; past [batch, kv_heads, past, head_size]; head_sink: a
    logit per head in each softmax's sum (gpt-oss's sinks); bias_heads: an attention_bias
    input [batch, bias_heads, seq, total]."""
    width = (HEADS + 2 * KV_HEADS) * head_size if packed else HEADS * head_size
    f = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("query", f, ["batch", "seq", width])]
    if not packed:
        inputs += [helper.make_tensor_value_info(n, f, ["batch", "seq", KV_HEADS * head_size])
                   for n in ("key", "value")]
    inputs += [helper.make_tensor_value_info(n, f, ["batch", KV_HEADS, "past", head_size])
               for n in ("past_k", "past_v")]
    inputs.append(helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total"]))
    one = helper.make_tensor("one", TensorProto.INT64, [], [1])
    axis = helper.make_tensor("axis", TensorProto.INT64, [1], [1])
    nodes = [helper.make_node("ReduceSum", ["attention_mask", "axis"], ["sum"], keepdims=0),
             helper.make_node("Sub", ["sum", "one"], ["sum_1"]),
             helper.make_node("Cast", ["sum_1"], ["seqlens_k"], to=TensorProto.INT32),
             helper.make_node("Shape", ["attention_mask"], ["mask_shape"]),
             helper.make_node("Gather", ["mask_shape", "one"], ["total64"], axis=0),
             helper.make_node("Cast", ["total64"], ["total"], to=TensorProto.INT32)]
    inits = [one, axis]
    caches = ["", ""]
    if rotary_dim:
        cos, sin = genai_zoo.rotary_caches(64, rotary_dim)
        inits += [helper.make_tensor(n, f, c.shape, c.ravel()) for n, c in (("cos", cos), ("sin", sin))]
        caches = ["cos", "sin"]
    if bias_heads:
        inputs.append(helper.make_tensor_value_info("attention_bias", f, ["batch", bias_heads, "seq", "total"]))
    if head_sink or bias_heads:
        caches += ["", "attention_bias" if bias_heads else ""]
    if head_sink:
        sinks = np.random.default_rng(5).standard_normal(HEADS).astype(np.float32)
        inits.append(helper.make_tensor("sink", f, [HEADS], sinks))
        caches.append("sink")
    qkv = ["query", "", ""] if packed else ["query", "key", "value"]
    nodes.append(helper.make_node("GroupQueryAttention", qkv + ["past_k", "past_v", "seqlens_k", "total"] + caches,
                                  ["out", "present_k", "present_v"], domain="com.microsoft", num_heads=HEADS,
                                  kv_num_heads=KV_HEADS, do_rotary=int(bool(rotary_dim)), **attrs))
    outputs = [helper.make_tensor_value_info(n, f, None) for n in ("out", "present_k", "present_v")]
    return helper.make_model(helper.make_graph(nodes, "gqa", inputs, outputs, inits), opset_imports=MS_OPSETS)


def _gqa_feeds(rng, packed: bool, head_size: int, batch: int, seq: int, past: int, bias_heads: int = 0) -> dict:
    def normal(*shape):
        return rng.standard_normal(shape).astype(np.float32)
    width = (HEADS + 2 * KV_HEADS) * head_size if packed else HEADS * head_size
    feeds = {"query": normal(batch, seq, width), "past_k": normal(batch, KV_HEADS, past, head_size),
             "past_v": normal(batch, KV_HEADS, past, head_size),
             "attention_mask": np.ones((batch, past + seq), np.int64)}
    if not packed:
        feeds.update(key=normal(batch, seq, KV_HEADS * head_size), value=normal(batch, seq, KV_HEADS * head_size))
    if bias_heads:
        feeds["attention_bias"] = normal(batch, bias_heads, seq, past + seq)
    return feeds


GQA_DIMS = {"batch": (1, 2), "seq": (1, 8), "past": (0, 24), "total": (1, 32)}
# (batch, seq, past): prompts from an empty cache, decoding steps, later chunks of a prompt
# (onnxruntime takes those for a batch of one only).
GQA_CALLS = [(1, 5, 0), (2, 1, 5), (1, 1, 17), (2, 4, 0), (1, 3, 6), (1, 8, 24)]
GQA_FORMS = {
    "rotary": dict(head_size=32, rotary_dim=32),
    "partial_rotary": dict(head_size=32, rotary_dim=16),
    "interleaved": dict(head_size=16, rotary_dim=16, rotary_interleaved=1),
    "no_rotary": dict(head_size=16, rotary_dim=None),
    "window": dict(head_size=16, rotary_dim=16, local_window_size=3),
    "softcap": dict(head_size=16, rotary_dim=16, softcap=2.5),
    "scale": dict(head_size=16, rotary_dim=16, scale=0.3),
    "smooth_softmax": dict(head_size=16, rotary_dim=16, smooth_softmax=1),
    "head_sink": dict(head_size=16, rotary_dim=16, head_sink=True, local_window_size=4),
    "bias_per_head": dict(head_size=16, rotary_dim=16, bias_heads=HEADS),
    "bias_shared": dict(head_size=16, rotary_dim=16, bias_heads=1, softcap=2.5),
}


@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
@pytest.mark.parametrize("form", GQA_FORMS)
def test_group_query_attention(form, packed, executor):
    """Output and presents at prompts, decoding steps and later chunks, from one build
    whose batch, sequence and past are symbolic."""
    kw = dict(GQA_FORMS[form])
    head_size, rotary_dim = kw.pop("head_size"), kw.pop("rotary_dim")
    model = _gqa_model(packed, head_size, rotary_dim, **kw)
    module = build(model, dims=GQA_DIMS, executor=executor, cache=shared_cache(), progress=False).load()
    rng = np.random.default_rng(0)
    for batch, seq, past in GQA_CALLS:
        feeds = _gqa_feeds(rng, packed, head_size, batch, seq, past, kw.get("bias_heads", 0))
        _compare(model, module, feeds, what=f"at {batch, seq, past}")


@pytest.mark.parametrize("in_place", [True, False], ids=["cache-in-place", "cache-as-tensors"])
def test_group_query_attention_right_padded_batch(in_place, executor):
    """Sequences of different lengths in one batch, right-padded, as onnxruntime reads them:
    each entry's keys go after its own length (seqlens_k), the rows after them are zeroed,
    its positions start there. A prompt (padded rows' outputs are unspecified: compared
    where they are real), then decoding steps fed onnxruntime's presents."""
    from modelkiln.ir import PassContext
    model = _gqa_model(True, 16, 16, local_window_size=4)
    context = None if in_place else PassContext(disabled_pass={"bind_kv_caches"})
    result = build(model, dims=GQA_DIMS, executor=executor, cache=None, progress=False, pass_context=context)
    assert bool(json.loads(result.files["manifest.json"]).get("caches")) == in_place
    module, session, rng = result.load(), _session(model), np.random.default_rng(4)
    lengths = np.array([5, 3])  # (each sequence's tokens; the mask's sum is what GQA reads)
    feeds = _gqa_feeds(rng, True, 16, 2, 5, 0)
    feeds["attention_mask"] = (np.arange(5)[None] < lengths[:, None]).astype(np.int64)
    for step in range(4):
        want = dict(zip(["out", "present_k", "present_v"], session.run(None, feeds)))
        got = module.run(feeds)
        for name in ("present_k", "present_v"):
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=2e-5, err_msg=f"{name} step {step}")
        for n, rows in enumerate(lengths if step == 0 else [1, 1]):
            np.testing.assert_allclose(got["out"][n, :rows], want["out"][n, :rows], rtol=1e-5, atol=2e-5,
                                       err_msg=f"out of entry {n} step {step}")
        past, lengths = want["present_k"].shape[2], lengths + 1
        feeds = _gqa_feeds(rng, True, 16, 2, 1, past)
        feeds.update(past_k=want["present_k"], past_v=want["present_v"])
        feeds["attention_mask"] = (np.arange(past + 1)[None] < lengths[:, None]).astype(np.int64)


def test_group_query_attention_keeps_its_cache_in_place(executor):
    """The presents are the pasts' buffers (ir/passes/kv_cache.py), keys read as they lie."""
    model = _gqa_model(True, 16, 16)
    result = build(model, dims=GQA_DIMS, executor=executor, cache=None, progress=False)
    manifest = json.loads(result.files["manifest.json"])
    assert [(c["past"], c["present"]) for c in manifest["caches"]] == [("past_k", "present_k"), ("past_v", "present_v")]
    ops = [op for call in manifest["calls"] for op in call["ops"]]
    assert ops.count("kiln.AppendCache") == 2 and ops.count("kiln.MatMulTransposedB") == 1


def test_group_query_attention_needs_a_full_cache(executor):
    """total_sequence_length must be past + seq (Kiln reads the cache every sequence fills):
    a call where the mask says otherwise is refused by name, nothing run."""
    module = build(_gqa_model(True, 16, 16), dims=GQA_DIMS, executor=executor, cache=shared_cache(), progress=False).load()
    feeds = _gqa_feeds(np.random.default_rng(1), True, 16, 1, 2, 3)
    feeds["attention_mask"] = np.ones((1, 4), np.int64)
    with pytest.raises(KilnError, match="GroupQueryAttention.*total_sequence_length and past \\+ seq"):
        module.run(feeds)


def test_group_query_attention_refuses_what_it_does_not_compute():
    model = _gqa_model(True, 16, 16, causal=0)
    with pytest.raises(UnsupportedError, match="GroupQueryAttention.*causal=0 is not supported"):
        build(model, dims=GQA_DIMS, cache=None, progress=False)
    model = _gqa_model(True, 16, 16)
    node = model.graph.node[-1]
    node.input.extend(["positions"])
    model.graph.input.append(helper.make_tensor_value_info("positions", TensorProto.INT64, [1, 1]))
    with pytest.raises(UnsupportedError, match="input 9 \\(position_ids\\) is not supported"):
        build(model, dims=GQA_DIMS, cache=None, progress=False)


# ---- RotaryEmbedding ----------------------------------------------------------------------

@pytest.mark.parametrize("layout,positions,interleaved,rotary_dim", [
    ("bsd", "2d", 0, 0), ("bsd", "offset", 1, 0), ("bnsh", "2d", 1, 0), ("bnsh", "offset", 0, 0),
    ("bsd", "2d", 0, 16)], ids=["3d", "3d-offset-interleaved", "4d-interleaved", "4d-offset", "3d-partial"])
def test_rotary_embedding(layout, positions, interleaved, rotary_dim, executor):
    """com.microsoft.RotaryEmbedding over [batch, seq, hidden] or [batch, heads, seq, head],
    positions per token or one offset, halves or interleaved pairs, whole or partial heads."""
    head, heads, batch, seq = 32, 3, 2, 5
    shape = [batch, seq, heads * head] if layout == "bsd" else [batch, heads, seq, head]
    cos, sin = genai_zoo.rotary_caches(40, rotary_dim or head)
    f = TensorProto.FLOAT
    pos_shape = [batch, seq] if positions == "2d" else [1]
    attrs = {"interleaved": interleaved}
    if rotary_dim:
        attrs.update(rotary_embedding_dim=rotary_dim, num_heads=heads)
    node = helper.make_node("RotaryEmbedding", ["x", "positions", "cos", "sin"], ["y"], domain="com.microsoft", **attrs)
    graph = helper.make_graph([node], "rope", [helper.make_tensor_value_info("x", f, shape),
                                               helper.make_tensor_value_info("positions", TensorProto.INT64,
                                                                             pos_shape)],
                              [helper.make_tensor_value_info("y", f, None)],
                              [helper.make_tensor("cos", f, cos.shape, cos.ravel()),
                               helper.make_tensor("sin", f, sin.shape, sin.ravel())])
    model = helper.make_model(graph, opset_imports=MS_OPSETS)
    rng = np.random.default_rng(2)
    pos = rng.integers(0, 35, pos_shape).astype(np.int64)
    feeds = {"x": rng.standard_normal(shape).astype(np.float32), "positions": pos}
    _compare(model, build(model, executor=executor, cache=shared_cache(), progress=False).load(), feeds)


# ---- the normalizations -----------------------------------------------------------------------

def _norm_model(op: str, inputs: list, outputs: list, domain: str, **attrs):
    f, d = TensorProto.FLOAT, 48
    shapes = {"x": ["batch", 7, d], "skip": ["batch", 7, d]}
    graph = helper.make_graph(
        [helper.make_node(op, inputs, outputs, domain=domain, **attrs)], "norm",
        [helper.make_tensor_value_info(n, f, shapes[n]) for n in inputs if n in shapes],
        [helper.make_tensor_value_info(o, f, None) for o in outputs if o],
        [helper.make_tensor(n, f, [d], np.random.default_rng(i).standard_normal(d).astype(np.float32))
         for i, n in enumerate(["gamma", "beta", "bias"]) if n in inputs])
    return helper.make_model(graph, opset_imports=MS_OPSETS)


@pytest.mark.parametrize("op,domain,inputs,outputs,attrs", [
    ("SimplifiedLayerNormalization", "", ["x", "gamma"], ["y"], {}),
    ("SimplifiedLayerNormalization", "", ["x", "gamma"], ["y", "inv_std"], {"epsilon": 1e-3}),
    ("SkipSimplifiedLayerNormalization", "com.microsoft", ["x", "skip", "gamma"], ["y", "", "", "sum"], {}),
    ("SkipSimplifiedLayerNormalization", "com.microsoft", ["x", "skip", "gamma", "bias"], ["y", "", "inv_std", "sum"],
     {"epsilon": 1e-4}),
    ("SkipLayerNormalization", "com.microsoft", ["x", "skip", "gamma", "beta"], ["y"], {}),
    ("SkipLayerNormalization", "com.microsoft", ["x", "skip", "gamma", "beta", "bias"], ["y", "mean", "inv_std", "sum"],
     {"epsilon": 1e-5}),
    ("SkipLayerNormalization", "com.microsoft", ["x", "skip", "gamma", "", "bias"], ["y", "", "", "sum"], {}),
], ids=["rms", "rms-inv-std", "skip-rms", "skip-rms-bias-all", "skip-ln", "skip-ln-bias-all", "skip-ln-no-beta"])
def test_normalizations(op, domain, inputs, outputs, attrs, executor):
    model = _norm_model(op, inputs, outputs, domain, **attrs)
    module = build(model, dims={"batch": (1, 3)}, executor=executor, cache=shared_cache(), progress=False).load()
    rng = np.random.default_rng(3)
    for batch in (1, 3):
        feeds = {n: (3 * rng.standard_normal((batch, 7, 48)) + 1).astype(np.float32) for n in ("x", "skip")
                 if n in inputs}
        _compare(model, module, feeds, atol=1e-5, what=f"batch {batch}")


# ---- a decoder as onnxruntime-genai exports it ------------------------------------------------

def test_a_genai_int4_decoder_generates_onnxruntimes_tokens(executor):
    """A Llama-shaped decoder written as genai's builder writes it for the CPU (int4
    MatMulNBits, packed QKV, GQA with the rotation inside, skip RMS norms, the embedding tied
    to the LM head's codes by GatherBlockQuantized): one build generates greedily for a
    batch of two prompts, its cache in place, the tokens and logits onnxruntime gives; fed
    the past as arrays too."""
    model, info = genai_zoo.llama_decoder(tied=True)
    assert "GatherBlockQuantized" in [n.op_type for n in model.graph.node]
    dims = {"batch_size": (1, 2), "sequence_length": (1, 16), "past_sequence_length": (0, 64),
            "total_sequence_length": (1, 80)}
    result = build(model, dims=dims, executor=executor, cache=None, progress=False)
    manifest = json.loads(result.files["manifest.json"])
    assert len(manifest["caches"]) == 2 * info["layers"]
    ops = [op for call in manifest["calls"] for op in call["ops"]]
    assert ops.count("com.microsoft.MatMulNBits") == 5 * info["layers"] + 1  # (every weight as 4-bit codes)
    module = result.load()
    prompts = [[5, 17, 3, 40, 11], [7, 7, 1, 2, 90]]
    want_tokens, want_logits = genai_zoo.greedy_tokens(lambda f: model_zoo.onnxruntime_outputs(model, f), info,
                                                       prompts, 16)
    cache = module.new_cache(batch_size=2)
    for run, feed_past in ((lambda f: module.run(f, cache=cache), False), (module.run, True)):
        tokens, logits = genai_zoo.greedy_tokens(run, info, prompts, 16, feed_past=feed_past)
        assert tokens == want_tokens
        for step, (got, want) in enumerate(zip(logits, want_logits)):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"step {step}")


# ---- GatherBlockQuantized -----------------------------------------------------------------------

def _gather_block_quantized_model(dtype: str, bits: int, block: int, columns: int, zero_points: bool):
    """A table of 40 rows quantized in blocks along its columns, as genai's builder ties the
    embedding to the LM head's MatMulNBits codes (uint8, codes lowest bits first), or as
    int4/uint4 elements."""
    from onnx import numpy_helper
    rng, rows = np.random.default_rng(bits + block), 40
    blocks = -(-columns // block)
    scales = numpy_helper.from_array(rng.uniform(0.01, 0.1, (rows, blocks)).astype(np.float32), "scales")
    inputs, inits = ["data", "ids", "scales"], [scales]
    if dtype == "uint8":
        codes = rng.integers(0, 1 << bits, (rows, columns)).astype(np.uint8)
        per_byte = 8 // bits
        packed = np.sum(codes.reshape(rows, -1, per_byte).astype(np.uint16) << (np.arange(per_byte) * bits), axis=-1)
        inits.append(numpy_helper.from_array(packed.astype(np.uint8), "data"))
        if zero_points:
            zp = np.zeros((rows, -(-blocks // per_byte) * per_byte), np.uint8)
            zp[:, :blocks] = rng.integers(0, 1 << bits, (rows, blocks))
            inits.append(numpy_helper.from_array(np.sum(zp.reshape(rows, -1, per_byte).astype(np.uint16) <<
                                                        (np.arange(per_byte) * bits), axis=-1).astype(np.uint8), "zp"))
    else:
        kind = TensorProto.INT4 if dtype == "int4" else TensorProto.UINT4
        low, high = (-8, 8) if dtype == "int4" else (0, 16)
        inits.append(helper.make_tensor("data", kind, [rows, columns],
                                        rng.integers(low, high, rows * columns).tolist()))
        if zero_points:
            inits.append(helper.make_tensor("zp", kind, [rows, blocks],
                                            rng.integers(low, high, rows * blocks).tolist()))
    if zero_points:
        inputs.append("zp")
    node = helper.make_node("GatherBlockQuantized", inputs, ["y"], domain="com.microsoft", bits=bits, block_size=block,
                            gather_axis=0, quantize_axis=1)
    graph = helper.make_graph([node], "gbq", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=MS_OPSETS)


@pytest.mark.parametrize("dtype,bits,block,columns,zero_points", [
    ("uint8", 4, 32, 64, True), ("uint8", 4, 16, 48, False), ("uint8", 8, 32, 64, True), ("uint8", 2, 32, 64, True),
    ("int4", 4, 16, 32, False), ("uint4", 4, 16, 32, True)],
    ids=["u8-4bit-zp", "u8-4bit", "u8-8bit-zp", "u8-2bit-zp", "int4", "uint4-zp"])
def test_gather_block_quantized(dtype, bits, block, columns, zero_points, executor):
    """Rows (negative indices too) gathered and dequantized, against onnxruntime; the
    weights file holds the codes, not a float table."""
    model = _gather_block_quantized_model(dtype, bits, block, columns, zero_points)
    result = build(model, dims={"batch": (1, 4)}, executor=executor, cache=None, progress=False)
    module = result.load()
    for ids in (np.array([[0, 39, 7]]), np.array([[3, -1, 12], [25, 25, -40], [1, 2, 3], [38, 0, 9]])):
        _compare(model, module, {"ids": ids.astype(np.int64)}, atol=1e-6, what=f"ids {ids.tolist()}")
    assert module.manifest.weights_bytes < 40 * columns * 4 / 2  # (the table as float32: 4 bytes a value)


def test_phi3_long_rope_caches_picked_by_the_bounds(executor):
    """Phi-3's two rotary caches, picked by an If on total length > its original context
    (48 here): bounds within the original decide the If when Kiln builds, and the decoder
    generates onnxruntime's tokens; bounds across it are refused, naming the caches the If
    picks between and the bound that decides it."""
    model, info = genai_zoo.llama_decoder(long_rope=48, max_length=96)
    prompts = [[5, 17, 3, 40, 11]]
    dims = {"batch_size": (1, 1), "sequence_length": (1, 16), "past_sequence_length": (0, 32),
            "total_sequence_length": (1, 48)}
    module = build(model, dims=dims, executor=executor, cache=shared_cache(), progress=False).load()
    want_tokens, want_logits = genai_zoo.greedy_tokens(lambda f: model_zoo.onnxruntime_outputs(model, f), info,
                                                       prompts, 16)
    tokens, logits = genai_zoo.greedy_tokens(module.run, info, prompts, 16)
    assert tokens == want_tokens
    for step, (got, want) in enumerate(zip(logits, want_logits)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"step {step}")
    with pytest.raises(KilnError, match=r"rotary caches hold taken\(.*\) \? 96 : 48 positions, past \+ seq may reach "
                                        r"80: bound .* at most 48"):
        build(model, dims={**dims, "total_sequence_length": (1, 80), "past_sequence_length": (0, 64)},
              executor=executor, cache=None, progress=False)


def test_group_query_attention_names_sizes_that_differ():
    """Sizes the op needs equal that the model fixes apart (a key of another batch) are a
    build error naming them, not a check every call would fail."""
    model = _gqa_model(False, 16, 16)
    for vi in model.graph.input:
        if vi.name in ("query", "key"):
            vi.type.tensor_type.shape.dim[0].dim_value = 1 if vi.name == "query" else 2
    with pytest.raises(KilnError, match="GroupQueryAttention.*the batch of query and input 1: 2 and 1 differ"):
        build(model, dims=GQA_DIMS, cache=None, progress=False)
