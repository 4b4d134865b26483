"""An int4 decoder as onnxruntime-genai's builder writes it for the CPU (GroupQueryAttention
with the rotation inside, MatMulNBits, skip RMS norms, the embedding tied to the LM head's
codes; tests/genai_zoo.py), at Llama 3.2 1B's widths: Kiln against onnxruntime-genai (the
runtime such exports are made for) and plain onnxruntime running the same model.

    python bench/bench_genai.py [--threads 1] [--rounds 3] [--layers 4] [--past 256]

Times, each the better median of interleaved rounds: a prompt of --prompt tokens from an
empty cache, and one decoding step after a past of --past tokens. Kiln keeps its cache in
place (`Module.new_cache`); onnxruntime-genai shares past and present buffers (its
`past_present_share_buffer`) and is rewound to the same past after each step; plain
onnxruntime is fed the past as arrays, as its Python API runs a model. OpenVINO does not
run com.microsoft ops. Kiln's outputs are checked against onnxruntime's first. Prints a
Markdown table. onnxruntime-genai is in the `bench` extras; without it its column is left
out.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_models import cpu_name, host_isa, interleaved, ort_session  # noqa: E402
from modelkiln.orchestrator.api import build  # noqa: E402
from tests import genai_zoo  # noqa: E402

# Llama 3.2 1B: d 2048, 32 query heads and 8 key/value heads of 64, MLP 8192 (its vocabulary
# of 128256 cut to 32000: the lm_head is one MatMulNBits like the others, only longer).
WIDTHS = dict(d=2048, heads=32, kv_heads=8, ffn=8192, vocab=32000)


def _feeds(info: dict, ids: np.ndarray, past: int, rng) -> dict:
    kv, h = info["kv_heads"], info["head_size"]
    feeds = {"input_ids": ids, "attention_mask": np.ones((1, past + ids.shape[1]), np.int64)}
    for i in range(info["layers"]):
        for kind in ("key", "value"):
            feeds[f"past_key_values.{i}.{kind}"] = (0.5 * rng.standard_normal((1, kv, past, h))).astype(np.float32)
    return feeds


def genai_folder(model, info: dict, threads: int, context: int, folder: str) -> str:
    """The model and the genai_config.json onnxruntime-genai loads it by (its builder writes
    the same for a Llama)."""
    import json

    import onnx
    onnx.save(model, os.path.join(folder, "model.onnx"))
    heads = WIDTHS["heads"]
    decoder = {"session_options": {"log_id": "onnxruntime-genai", "provider_options": [],
                                   "intra_op_num_threads": threads, "inter_op_num_threads": 1},
               "filename": "model.onnx", "head_size": info["head_size"], "hidden_size": WIDTHS["d"],
               "num_attention_heads": heads, "num_hidden_layers": info["layers"],
               "num_key_value_heads": info["kv_heads"],
               "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                          "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"},
               "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                           "present_value_names": "present.%d.value"}}
    config = {"model": {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "context_length": context,
                        "vocab_size": WIDTHS["vocab"], "type": "llama", "decoder": decoder},
              "search": {"do_sample": False, "max_length": context, "min_length": 0, "num_beams": 1,
                         "num_return_sequences": 1, "past_present_share_buffer": True, "top_k": 1}}
    with open(os.path.join(folder, "genai_config.json"), "w") as f:
        json.dump(config, f)
    return folder


def genai_runs(folder: str, prompt: np.ndarray, past: int, rng) -> dict:
    """onnxruntime-genai's prompt and decoding step, or {} where it is not installed."""
    try:
        import onnxruntime_genai as og
    except ImportError:
        print("onnxruntime-genai is not installed (pip install onnxruntime-genai): its column is left out",
              file=sys.stderr)
        return {}
    model = og.Model(folder)

    def generator():
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=past + 64)
        return og.Generator(model, params)

    def prompt_run():
        generator().append_tokens(prompt.astype(np.int32))
    stepping = generator()
    stepping.append_tokens(rng.integers(0, 100, (1, past)).astype(np.int32))

    def step_run():  # (one token, then back to the same past)
        stepping.generate_next_token()
        stepping.rewind_to(past)
    return {("prompt", "onnxruntime-genai"): prompt_run, ("step", "onnxruntime-genai"): step_run}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--past", type=int, default=256)
    args = ap.parse_args()

    t0 = time.perf_counter()
    model, info = genai_zoo.llama_decoder(layers=args.layers, max_length=1024, tied=True, **WIDTHS)
    print(f"model: {args.layers} layers, quantized in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    t0 = time.perf_counter()
    dims = {"batch_size": (1, 1), "sequence_length": (1, args.prompt), "past_sequence_length": (0, 768),
            "total_sequence_length": (1, 768 + args.prompt)}
    module = build(model, dims=dims, cache=None, progress=False).load(threads=args.threads)
    print(f"Kiln build: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    session = ort_session(model, args.threads)
    rng = np.random.default_rng(0)

    prompt = _feeds(info, rng.integers(0, WIDTHS["vocab"], (1, args.prompt)).astype(np.int64), 0, rng)
    step = _feeds(info, np.array([[7]], np.int64), args.past, rng)
    names = [o.name for o in session.get_outputs()]
    for what, feeds in (("prompt", prompt), ("step", step)):
        want = dict(zip(names, session.run(names, feeds)))["logits"]
        np.testing.assert_allclose(module.run(feeds)["logits"], want, rtol=1e-3, atol=1e-3, err_msg=what)

    cache = module.new_cache()
    cache_feeds = {k: v for k, v in step.items() if not k.startswith("past_key_values")}

    def kiln_step():  # (the cache holds `past` entries; each call appends one, then it is cut back)
        module.run(cache_feeds, cache=cache)
        cache.length = args.past
    while cache.length < args.past:  # (the past, in chunks a call may take)
        ids = rng.integers(0, 100, (1, min(args.prompt, args.past - cache.length))).astype(np.int64)
        module.run({"input_ids": ids, "attention_mask": np.ones((1, cache.length + ids.shape[1]), np.int64)},
                   cache=cache)
    runs = {
        ("prompt", "Kiln"): lambda: module.run(prompt),
        ("prompt", "onnxruntime"): lambda: session.run(names, prompt),
        ("step", "Kiln"): kiln_step,
        ("step", "onnxruntime"): lambda: session.run(names, step),
    }
    with tempfile.TemporaryDirectory() as folder:
        genai_folder(model, info, args.threads, args.past + 128, folder)
        runs.update(genai_runs(folder, prompt["input_ids"], args.past, rng))
        best = interleaved(runs, warmup=2, repeat=5 if args.prompt > 32 else 20, rounds=args.rounds)
    peers = [p for p in ("onnxruntime-genai", "onnxruntime") if ("step", p) in runs]
    print(f"\n{cpu_name()} ({host_isa()}), {args.threads} thread(s), {args.layers} layers at Llama 3.2 1B widths, "
          f"int4 blocks of 32; ms, better median of {args.rounds} interleaved rounds\n")
    print("| call | Kiln | " + " | ".join(peers) + " | Kiln / best peer |")
    print("|---|---:|" + "---:|" * len(peers) + "---:|")
    for what, label in (("prompt", f"prompt of {args.prompt}"), ("step", f"decoding step after {args.past}")):
        times = [best[(what, p)] for p in peers]
        print(f"| {label} | {best[(what, 'Kiln')]:.2f} | " + " | ".join(f"{t:.2f}" for t in times) +
              f" | {best[(what, 'Kiln')] / min(times):.2f}x |")


if __name__ == "__main__":
    main()
