"""Single convolution layers of real architectures: Kiln against onnxruntime, one run.

    python bench/bench_convs.py [--threads 1] [--rounds 5] [--layers sq_48_192_13,r18_512_7] [--target llvm]

Each layer is a Conv with its bias and a Relu, at batch 1, with random weights: the shapes
SqueezeNet, Inception-v3, ResNet, a few-channel decoder and FCN-ResNet50's dilated stages
use. Kiln builds it (no cache), the outputs are checked against onnxruntime's, then both
are timed in interleaved rounds (the better median of each) at the same thread count.
Prints a Markdown table with the path Kiln's lowering took: "winograd" (F(2x2, 3x3),
ir/lower/winograd.py) or "winograd4" (F(4x4, 3x3)), "implicit" (the input read in place;
"rows" where its tiles stay within an output row, Gemm.a_rows), "im2col", "weights as rows"
or "pointwise" (1x1: the weights as A; "packed input" where B is a packed copy of the input,
not read in place).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_models import cpu_name, host_isa, interleaved, median_ms, ort_session  # noqa: E402
from modelkiln.orchestrator.api import build  # noqa: E402
from tests import model_zoo  # noqa: E402
from tests.conftest import kernel_statements  # noqa: E402

# name: (input channels, output channels, input height and width, kernel, stride, pads (h, w)[, dilation])
LAYERS = {
    "inc_32_32_149": (32, 32, 149, (3, 3), 1, (0, 0)),
    "inc_32_64_147": (32, 64, 147, (3, 3), 1, (1, 1)),
    "inc_80_192_73": (80, 192, 73, (3, 3), 1, (0, 0)),
    "inc_64_96_35": (64, 96, 35, (3, 3), 1, (1, 1)),
    "inc_48_64_35_5x5": (48, 64, 35, (5, 5), 1, (2, 2)),
    "inc_128_128_17_1x7": (128, 128, 17, (1, 7), 1, (0, 3)),
    "inc_128_192_17_7x1": (128, 192, 17, (7, 1), 1, (3, 0)),
    "inc_384_384_8_1x3": (384, 384, 8, (1, 3), 1, (0, 1)),
    "sq_16_64_55": (16, 64, 55, (3, 3), 1, (1, 1)),
    "sq_32_128_27": (32, 128, 27, (3, 3), 1, (1, 1)),
    "sq_48_192_13": (48, 192, 13, (3, 3), 1, (1, 1)),
    "sq_64_256_13": (64, 256, 13, (3, 3), 1, (1, 1)),
    "r18_64_56": (64, 64, 56, (3, 3), 1, (1, 1)),
    "r18_256_512_14_s2": (256, 512, 14, (3, 3), 2, (1, 1)),
    "r50_128_128_56_s2": (128, 128, 56, (3, 3), 2, (1, 1)),
    "r50_256_256_28_s2": (256, 256, 28, (3, 3), 2, (1, 1)),
    "r50_256_14": (256, 256, 14, (3, 3), 1, (1, 1)),
    "r50_128_28": (128, 128, 28, (3, 3), 1, (1, 1)),
    "r18_512_7": (512, 512, 7, (3, 3), 1, (1, 1)),
    "r50_256_512_56_1x1_s2": (256, 512, 56, (1, 1), 2, (0, 0)),
    "r50_512_1024_28_1x1_s2": (512, 1024, 28, (1, 1), 2, (0, 0)),
    "r50_1024_2048_14_1x1_s2": (1024, 2048, 14, (1, 1), 2, (0, 0)),
    "stem_3_32_224_s2": (3, 32, 224, (3, 3), 2, (1, 1)),
    "stem_3_64_224_7x7_s2": (3, 64, 224, (7, 7), 2, (3, 3)),
    "few_32_16_14": (32, 16, 14, (3, 3), 1, (1, 1)),
    "few_64_8_28": (64, 8, 28, (3, 3), 1, (1, 1)),
    "fcn_256_256_28_d2": (256, 256, 28, (3, 3), 1, (2, 2), 2),
    "fcn_512_512_28_d4": (512, 512, 28, (3, 3), 1, (4, 4), 4),
    "dlv3_2048_256_28_d12": (2048, 256, 28, (3, 3), 1, (12, 12), 12),
    "dlv3_2048_256_65_d24": (2048, 256, 65, (3, 3), 1, (24, 24), 24),
    "convmixer_768_768_32_1x1": (768, 768, 32, (1, 1), 1, (0, 0)),
    "fcos_256_256_100": (256, 256, 100, (3, 3), 1, (1, 1)),
}


def conv_layer(cin: int, cout: int, size: int, kernel: tuple, stride: int, pads: tuple, dilation: int = 1):
    g = model_zoo.GraphMaker(0)
    y = g.op("Conv", ["x", g.weight((cout, cin, *kernel)), g.weight((cout,))], kernel_shape=list(kernel),
             strides=[stride, stride], pads=[*pads, *pads], dilations=[dilation, dilation])
    model = g.model({"x": [1, cin, size, size]}, [g.op("Relu", [y])], name="conv")
    return model, model_zoo.random_inputs(model)


def kiln_path(result) -> str:
    from modelkiln.ir.loop import Gemm
    for call in result.lowered.calls:
        if call.space.get("conv_path", ((), ""))[1].startswith("winograd"):
            return call.space["conv_path"][1]
    gemms = [s for call in result.lowered.calls for s in kernel_statements(call.kernel.body) if isinstance(s, Gemm)]
    if not gemms:
        return "direct"
    g = gemms[0]
    if g.a_ktab:
        return "implicit, rows" if g.a_rows else "implicit"
    if g.b_ktab:
        return "weights as rows"
    if g.stores_along == "n":  # (weights as A: C is [channel][pixel])
        return "pointwise" if g.b_sk else "pointwise, packed input"
    return "im2col"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", default=",".join(LAYERS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--target", default="llvm")
    args = ap.parse_args()
    print(f"# {time.strftime('%Y-%m-%d')}, {cpu_name()} ({host_isa()}); Kiln built for {args.target}; "
          f"{args.threads} thread(s), better median of {args.rounds} interleaved rounds")
    print("| layer | kiln path | kiln ms | onnxruntime ms | kiln / onnxruntime |")
    print("|---|---|---:|---:|---:|")
    ratios = []
    for name in args.layers.split(","):
        model, inputs = conv_layer(*LAYERS[name])
        result = build(model, target=args.target, cache=None, progress=False)
        module, session = result.load(threads=args.threads), ort_session(model, args.threads)
        want = session.run(None, inputs)[0]
        got = next(iter(module.run(inputs).values()))
        if not np.allclose(got, want, rtol=1e-3, atol=1e-3 * float(np.abs(want).max())):
            raise SystemExit(f"{name}: Kiln's output differs from onnxruntime's by {np.abs(got - want).max():.3g}")
        probe_ms = median_ms(lambda: session.run(None, inputs), 1, 3)
        repeat = max(5, int(200 / max(probe_ms, 0.01)))  # (about 0.2 s a runner and round)
        best = interleaved({"kiln": lambda: module.run(inputs), "ort": lambda: session.run(None, inputs)},
                           3, repeat, args.rounds)
        ratios.append(best["kiln"] / best["ort"])
        print(f"| {name} | {kiln_path(result)} | {best['kiln']:.3f} | {best['ort']:.3f} | {ratios[-1]:.2f} |",
              flush=True)
    print(f"\nGeometric mean of kiln / onnxruntime over {len(ratios)} layers: "
          f"{float(np.exp(np.mean(np.log(ratios)))):.2f}")


if __name__ == "__main__":
    main()
