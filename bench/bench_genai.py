"""An int4 decoder as onnxruntime-genai's builder writes it for the CPU (GroupQueryAttention
with the rotation inside, MatMulNBits, skip RMS norms; tests/genai_zoo.py), at Llama 3.2
1B's widths: Kiln against onnxruntime running the same model.

    python bench/bench_genai.py [--threads 1] [--rounds 3] [--layers 4] [--past 256]

Times, each the better median of interleaved rounds: a prompt of --prompt tokens from an
empty cache, and one decoding step after a past of --past tokens. Kiln keeps its cache in
place (`Module.new_cache`); onnxruntime is fed the past as arrays, as its Python API runs a
model (onnxruntime-genai's own loop shares the past's and present's buffers instead: not
installed here). OpenVINO does not run com.microsoft ops. Outputs are checked against
onnxruntime first. Prints a Markdown table.
"""
from __future__ import annotations

import argparse
import os
import sys
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--past", type=int, default=256)
    args = ap.parse_args()

    t0 = time.perf_counter()
    model, info = genai_zoo.llama_decoder(layers=args.layers, max_length=1024, **WIDTHS)
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
    best = interleaved(runs, warmup=2, repeat=5 if args.prompt > 32 else 20, rounds=args.rounds)
    print(f"\n{cpu_name()} ({host_isa()}), {args.threads} thread(s), {args.layers} layers at Llama 3.2 1B widths, "
          f"int4 blocks of 32; ms, better median of {args.rounds} interleaved rounds\n")
    print("| call | Kiln | onnxruntime | Kiln / onnxruntime |")
    print("|---|---:|---:|---:|")
    for what, label in (("prompt", f"prompt of {args.prompt}"), ("step", f"decoding step after {args.past}")):
        k, o = best[(what, "Kiln")], best[(what, "onnxruntime")]
        print(f"| {label} | {k:.2f} | {o:.2f} | {k / o:.2f}x |")


if __name__ == "__main__":
    main()
