"""Decoders shaped as onnxruntime-genai's model builder writes them for the CPU, random
weights: the ops and names a user's genai int4 Llama/Mistral/Qwen export has, small.

Per layer: SkipSimplifiedLayerNormalization (the residual's sum carried to the next),
one packed QKV MatMul, com.microsoft.GroupQueryAttention with the rotation inside
(do_rotary, cos/sin caches as weights) and the KV cache as past_key_values.i.key/value
[batch, kv_heads, past, head_size], the output projection, a SiLU-gated MLP. The attention
mask [batch, total] gives GQA its seqlens_k and total_sequence_length as the builder
computes them (ReduceSum - 1, and the mask's Shape). `int4` quantizes every MatMul with
onnxruntime's MatMulNBitsQuantizer, as the builder's int4 precision does.
"""
from __future__ import annotations

import logging

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


class _Graph:
    def __init__(self, seed: int):
        self.nodes, self.inits, self.rng, self.n = [], [], np.random.default_rng(seed), 0

    def const(self, value, name: str = "") -> str:
        self.n += 1
        name = name or f"c{self.n}"
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def op(self, op: str, inputs: list, outputs: int | list = 1, domain: str = "", **attrs) -> str | list:
        self.n += 1
        names = outputs if isinstance(outputs, list) else [f"{op}_{self.n}_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op, inputs, names, name=f"/{op}_{self.n}", domain=domain, **attrs))
        return names[0] if len(names) == 1 else names

    def linear(self, x: str, k: int, n: int) -> str:
        return self.op("MatMul", [x, self.const((self.rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32))])

    def norm_weight(self, d: int) -> str:
        return self.const((1 + 0.1 * self.rng.standard_normal(d)).astype(np.float32))


def rotary_caches(max_length: int, rotary_dim: int, base: float = 10000.0, stretch: float = 1.0,
                  magnitude: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [max_length, rotary_dim / 2] as the builder stores them; stretch and
    magnitude rescale the angles and the values (a long-context cache's)."""
    inv = 1.0 / base ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    angles = np.arange(max_length)[:, None] * inv[None] / stretch
    return (magnitude * np.cos(angles)).astype(np.float32), (magnitude * np.sin(angles)).astype(np.float32)


def llama_decoder(layers: int = 2, d: int = 64, heads: int = 4, kv_heads: int = 2, ffn: int = 128, vocab: int = 97,
                  max_length: int = 96, seed: int = 0, window: int = -1, int4: bool = True, tied: bool = False,
                  long_rope: int = 0) -> tuple:
    """(model, info): a genai-shaped decoder; info gives layers, kv_heads and head_size.
    tied (with int4): the embedding is the LM head's codes, read by GatherBlockQuantized, as
    the builder writes a model whose config ties them (Llama 3.2, Qwen2.5). long_rope: Phi-3's
    two rotary caches, `long_rope` positions (its original context) and max_length, picked
    by an If on whether the total length passes the first."""
    g, h = _Graph(seed), d // heads
    one, one_vec = g.const(np.int64(1)), g.const(np.array([1], np.int64))
    seqlens_k = g.op("Cast", [g.op("Sub", [g.op("ReduceSum", ["attention_mask", one_vec], keepdims=0), one])],
                     to=TensorProto.INT32)
    length = g.op("Gather", [g.op("Shape", ["attention_mask"]), one], axis=0)
    total = g.op("Cast", [length], to=TensorProto.INT32)
    if long_rope:
        cos, sin = _rope_caches_by_length(g, length, long_rope, max_length, h)
    else:
        cos, sin = (g.const(c, name) for c, name in zip(rotary_caches(max_length, h), ("cos_cache", "sin_cache")))
    embed = g.const((0.5 * g.rng.standard_normal((vocab, d))).astype(np.float32), "embed_tokens")
    hidden, residual = g.op("Gather", [embed, "input_ids"]), None
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64,
                                            ["batch_size", "total_sequence_length"])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", "sequence_length", vocab])]

    def skip_norm(x: str, res: str | None) -> tuple[str, str]:
        if res is None:
            return g.op("SimplifiedLayerNormalization", [x, g.norm_weight(d)], epsilon=1e-5), x
        g.n += 1
        normed, total_sum = f"/skip_norm_{g.n}", f"/residual_{g.n}"
        g.op("SkipSimplifiedLayerNormalization", [x, res, g.norm_weight(d)], [normed, "", "", total_sum],
             domain="com.microsoft", epsilon=1e-5)
        return normed, total_sum

    for i in range(layers):
        past_k, past_v = f"past_key_values.{i}.key", f"past_key_values.{i}.value"
        present_k, present_v = f"present.{i}.key", f"present.{i}.value"
        for name, dims in ((past_k, "past_sequence_length"), (past_v, "past_sequence_length")):
            inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch_size", kv_heads, dims, h]))
        for name in (present_k, present_v):
            outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT,
                                                         ["batch_size", kv_heads, "total_sequence_length", h]))
        normed, residual = skip_norm(hidden, residual)
        qkv = g.linear(normed, d, (heads + 2 * kv_heads) * h)
        attn = g.op("GroupQueryAttention", [qkv, "", "", past_k, past_v, seqlens_k, total, cos, sin],
                    [f"/attn_{i}", present_k, present_v], domain="com.microsoft", num_heads=heads,
                    kv_num_heads=kv_heads, do_rotary=1, local_window_size=window, scale=float(1 / np.sqrt(h)))[0]
        attn = g.linear(attn, heads * h, d)
        normed, residual = skip_norm(attn, residual)
        gate, up = g.linear(normed, d, ffn), g.linear(normed, d, ffn)
        hidden = g.linear(g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up]), ffn, d)
    normed, _ = skip_norm(hidden, residual)
    g.op("MatMul", [normed, g.const((g.rng.standard_normal((d, vocab)) / np.sqrt(d)).astype(np.float32))], ["logits"])
    graph = helper.make_graph(g.nodes, "genai_llama", inputs, outputs, g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("com.microsoft", 1)])
    if int4:
        model = _int4(model)
        if tied:
            _tie_embedding(model, vocab)
    return model, {"layers": layers, "kv_heads": kv_heads, "head_size": h, "vocab": vocab}


def _rope_caches_by_length(g: _Graph, length: str, original: int, max_length: int, h: int) -> tuple[str, str]:
    """Phi-3's LongRoPE as genai writes it: If(total length > original) then the long caches
    (max_length rows, angles stretched) else the short ones (original rows)."""
    def branch(name: str, caches: tuple) -> onnx.GraphProto:
        outs = [f"{name}_{kind}" for kind in ("cos", "sin")]
        nodes = [helper.make_node("Constant", [], [o], value=numpy_helper.from_array(c)) for o, c in zip(outs, caches)]
        return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(o, TensorProto.FLOAT, caches[0].shape)
                                                   for o in outs])
    longer = g.op("Greater", [length, g.const(np.int64(original))])
    return g.op("If", [longer], ["cos_cache", "sin_cache"],
                then_branch=branch("long", rotary_caches(max_length, h, stretch=2.0, magnitude=1.1)),
                else_branch=branch("short", rotary_caches(original, h)))


def _int4(model: onnx.ModelProto) -> onnx.ModelProto:
    from onnxruntime.quantization import QuantFormat
    from onnxruntime.quantization import matmul_nbits_quantizer as mq
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    config = mq.DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=False, quant_format=QuantFormat.QOperator)
    quantizer = mq.MatMulNBitsQuantizer(model, algo_config=config)
    quantizer.process()
    return quantizer.model.model


def _tie_embedding(model: onnx.ModelProto, vocab: int) -> None:
    """The embedding Gather replaced by GatherBlockQuantized over the LM head's MatMulNBits
    codes, scales and zero points, reshaped to rows of the vocabulary (the builder's wiring)."""
    nodes = model.graph.node
    head = [n for n in nodes if n.op_type == "MatMulNBits" and n.output[0] == "logits"][0]
    gather = [n for n in nodes if n.op_type == "Gather" and n.input[0] == "embed_tokens"][0]
    block = [a.i for a in head.attribute if a.name == "block_size"][0]
    added, shaped = [], []
    for name in head.input[1:4]:
        shape = numpy_helper.from_array(np.array([vocab, -1], np.int64), f"{name}/rows_shape")
        model.graph.initializer.append(shape)
        added.append(helper.make_node("Reshape", [name, shape.name], [f"{name}/rows"], name=f"/{name}/Reshape"))
        shaped.append(f"{name}/rows")
    added.append(helper.make_node("GatherBlockQuantized", [shaped[0], "input_ids", shaped[1], shaped[2]],
                                  list(gather.output), name="/embed_tokens/GatherBlockQuantized",
                                  domain="com.microsoft", bits=4, block_size=block, gather_axis=0, quantize_axis=1))
    at = list(nodes).index(gather)
    nodes.remove(gather)
    for i, node in enumerate(added):
        nodes.insert(at + i, node)
    model.graph.initializer.remove([i for i in model.graph.initializer if i.name == "embed_tokens"][0])


def greedy_tokens(run, info: dict, prompts: list, steps: int, feed_past: bool = True) -> tuple[list, list]:
    """Greedy generation for a batch of prompts of one length: the prompts in one call, then
    one token a call, the attention mask all ones (total = past + seq). run(feeds) -> outputs.
    Returns each call's tokens [batch] and last logits [batch, vocab]. Without feed_past the
    feeds hold no past: `run` keeps the cache (Kiln's `cache=`)."""
    batch, kv, h = len(prompts), info["kv_heads"], info["head_size"]
    past = {f"past_key_values.{i}.{kind}": np.zeros((batch, kv, 0, h), np.float32)
            for i in range(info["layers"]) for kind in ("key", "value")}
    ids, length, tokens, logits = np.array(prompts, np.int64), 0, [], []
    for _ in range(steps + 1):
        length += ids.shape[1]
        feeds = {"input_ids": ids, "attention_mask": np.ones((batch, length), np.int64), **(past if feed_past else {})}
        out = run(feeds)
        last = out["logits"][:, -1]
        logits.append(last)
        tokens.append(np.argmax(last, axis=-1).tolist())
        past = {f"past_key_values.{i}.{kind}": out[f"present.{i}.{kind}"]
                for i in range(info["layers"]) for kind in ("key", "value")}
        ids = np.array(tokens[-1], np.int64)[:, None]
    return tokens, logits
