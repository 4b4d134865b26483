"""Greedy generation with a KV cache from one Kiln build, the module called once per token.

    python docs/example_generate.py [--layers 2] [--width 768] [--tokens 32] [--check]

Builds a GPT-2-shaped causal LM with `past_key_values` (random weights, tests/dynamic_zoo.py;
your own export goes the same way) once, with past = 0..PAST. Kiln keeps its KV cache in place:
`module.new_cache()` holds one buffer per layer and kind, sized to the bound; the prompt runs
with the cache empty (past 0), then each step feeds only the token it chose, and the module
reads the past where it lies and appends the new keys and values after it (a step copies
nothing that grows with the past). Prints the tokens and the time per token; with --check,
also onnxruntime's tokens on the same model (fed the presents back as arrays, as usual).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import modelkiln as kiln  # noqa: E402
from tests import dynamic_zoo  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=768, help="model width (heads of 64)")
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--past", type=int, default=1008, help="the longest cache one build serves")
    p.add_argument("--check", action="store_true", help="compare the tokens with onnxruntime's")
    args = p.parse_args()
    model, info = dynamic_zoo.gpt2_decoder_dynamic(d=args.width, heads=args.width // 64, layers=args.layers,
                                                   vocab=args.vocab, max_positions=args.past + 16)
    t0 = time.perf_counter()
    module = kiln.build(model, dims={"batch": (1, 1), "seq": (1, 16), "past": (0, args.past)},
                        progress=False).load()
    print(f"built once in {time.perf_counter() - t0:.1f} s: past 0..{args.past}, prompts of 1..16 tokens")
    prompt = [11, 22, 33, 44, 55]
    cache = module.new_cache()  # (zeros for past + seq up to the bound, each layer's keys and values)
    times = []

    def run(feeds):
        start = time.perf_counter()
        out = module.run(feeds, cache=cache)
        times.append(time.perf_counter() - start)
        return out
    tokens, _ = dynamic_zoo.greedy_tokens(run, info, prompt, args.tokens, feed_past=False)
    print("tokens:", " ".join(map(str, tokens)))
    steps = sorted(times[1:])
    print(f"prompt of {len(prompt)}: {times[0] * 1e3:.2f} ms; then {steps[len(steps) // 2] * 1e3:.2f} ms per token "
          f"(median of {len(steps)})")
    if args.check:
        from tests import model_zoo
        want, _ = dynamic_zoo.greedy_tokens(lambda f: model_zoo.onnxruntime_outputs(model, f), info, prompt,
                                            args.tokens)
        print("onnxruntime:", " ".join(map(str, want)), "(the same)" if want == tokens else "(DIFFERENT)")


if __name__ == "__main__":
    main()
