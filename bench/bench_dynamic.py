"""Symbolic dims: one Kiln build for every shape, against a build per shape and the peers.

    python bench/bench_dynamic.py [--repeat 20] [--rounds 2] [--parts bert,gpt2,big,cnn,batch,batch_zoo,loops]
                                  [--layers 2] [--big-dir D]

BERT: an encoder at BERT-base widths (d=768, 12 heads, ffn 3072; `--layers` of them) exported
with dynamic axes (tests/dynamic_zoo.py), built once by Kiln with batch=1..8, seq=1..512 and
run at sequence 1, 16, 64, 128, 384, 512 and batch 1 and 4; beside it Kiln built statically
for each shape, onnxruntime and OpenVINO (float32, INFERENCE_PRECISION_HINT=f32) on the same
dynamic-axes model. GPT-2: a decoder at GPT-2 124M widths (d=768, 12 heads, vocab 50257;
`--layers` of them) built once with past=0..1024, one token per call at past lengths 16, 128,
512 and 1024, beside onnxruntime and OpenVINO: Kiln fed the past as arrays (and returning the
presents, as the peers do) and Kiln appending to its cache in place (`Module.new_cache`).
Each at 1 thread and at every usable core, in
interleaved rounds (the runners take turns: this machine is noisy), the better median of each.
Big: a 1B-parameter GPT-2-style decoder from a config (d=2048, 16 heads, 16 layers, vocab
50257, random weights: 4 GB in external data, written once into --big-dir and kept there),
built by `kiln build` in a process of its own: its build time and the driver's peak memory
beside the model's bytes, then ms per token at past 16, 128 and 512 beside the peers.
CNN: ResNet-18 and MobileNetV2 (tests/model_zoo.py) with the image's height and width made
symbols, built once with height, width = 32..640 and run at 224 x 224, 320 x 480 and
512 x 512, beside Kiln built for each size and the peers on the dynamic-axes model.
Batch: the same CNNs at 224 x 224 with their batch made a symbol, built once with n = 1..8
and run at batch 1 and 4, beside Kiln built for each batch and the peers. Batch_zoo: every
CNN of the bench and the ViT built with a run-time batch, at a batch of one beside a build for
one (Kiln only). Loops: a decoding loop as torch.jit.script exports it, appending to a list
(`bench_loops`), run to 8, 64 and 256 steps beside the peers.
Prints Markdown tables (the ones in docs/performance.md) and each build's time.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.bench_models import THREADS, interleaved, openvino_runner, ort_session  # noqa: E402
from modelkiln.orchestrator.api import build  # noqa: E402
from tests import dynamic_zoo  # noqa: E402

BERT_SHAPES = [(b, s) for b in (1, 4) for s in (1, 16, 64, 128, 384, 512)]
PAST_LENGTHS = (16, 128, 512, 1024)


def _timed_build(model, **kwargs):
    t0 = time.perf_counter()
    result = build(model, cache=None, progress=False, **kwargs)
    return result, time.perf_counter() - t0


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if np.isfinite(a) and np.isfinite(b) and b > 0 else "n/a"


def _dynamic_static_and_peers(model, dynamic, static, feeds: dict, threads: int, repeat: int, args) -> dict:
    """Median ms of Kiln's dynamic and static builds and the peers on `feeds`, interleaved."""
    kd, ks = dynamic.load(threads=threads), static.load(threads=threads)
    sess, ov = ort_session(model, threads), openvino_runner(model, threads)
    runs = {"dyn": lambda: kd.run(feeds), "static": lambda: ks.run(feeds), "ort": lambda: sess.run(None, feeds)}
    if ov is not None:
        runs["ov"] = lambda: ov(feeds)
    return interleaved(runs, args.warmup, repeat, args.rounds)


def _row_cells(ms: dict) -> str:
    """The dynamic, static, onnxruntime and OpenVINO cells and the two ratios of a table row."""
    best_peer = min(ms["ort"], ms.get("ov", float("inf")))
    return (f"{ms['dyn']:.2f} | {ms['static']:.2f} | {ms['ort']:.2f} | {ms.get('ov', float('nan')):.2f} | "
            f"{_ratio(ms['dyn'], ms['static'])} | {_ratio(ms['dyn'], best_peer)} |")


def bench_bert(args) -> list[str]:
    model, feeds = dynamic_zoo.bert_encoder_dynamic(d=768, heads=12, layers=args.layers, vocab=8000, ffn=3072,
                                                    max_positions=512)
    dynamic, seconds = _timed_build(model, dims={"batch": (1, 8), "seq": (1, 512)})
    print(f"bert: Kiln dynamic build {seconds:.1f} s", flush=True)
    lines = [f"BERT encoder, d=768, 12 heads, {args.layers} layers: median ms ({THREADS} = every usable core)", "",
             "| batch x seq | threads | Kiln dynamic | Kiln static | onnxruntime | OpenVINO | dynamic / static "
             "| dynamic / best peer |", "|---|---|---|---|---|---|---|---|"]
    for batch, seq in BERT_SHAPES:
        f = feeds(batch, seq)
        static, static_s = _timed_build(model, shapes={"input_ids": [batch, seq], "attention_mask": [batch, seq]})
        print(f"bert {batch}x{seq}: static build {static_s:.1f} s", flush=True)
        for threads in sorted({1, THREADS}):
            ms = _dynamic_static_and_peers(model, dynamic, static, f, threads, args.repeat, args)
            lines.append(f"| {batch} x {seq} | {threads} | {_row_cells(ms)}")
            print(lines[-1], flush=True)
    return lines


def _decode_runs(kiln, f: dict, info: dict, past: int) -> dict:
    """Kiln's two ways of decoding one token: the past fed as arrays (presents returned as
    new arrays, as the peers do), and the cache kept in place (filled to `past` entries, each
    run appending one after them)."""
    cache = kiln.new_cache()
    for i in range(info["layers"]):
        for kind in ("key", "value"):
            cache.buffers[f"present_{kind}_{i}"][:, :, :past] = f[f"past_{kind}_{i}"]
    fed = {k: v for k, v in f.items() if not k.startswith("past_")}

    def in_place():
        cache.length = past
        return kiln.run(fed, cache=cache)
    return {"kiln": lambda: kiln.run(f), "in_place": in_place}


GPT2_TABLE = ["| past | threads | Kiln, past as arrays | Kiln, cache in place | onnxruntime | OpenVINO | "
              "in place / best peer |", "|---|---|---|---|---|---|---|"]


def _decode_row(past: int, threads: int, ms: dict, digits: int) -> str:
    best_peer = min(ms["ort"], ms.get("ov", float("inf")))
    return (f"| {past} | {threads} | {ms['kiln']:.{digits}f} | {ms['in_place']:.{digits}f} | {ms['ort']:.{digits}f} | "
            f"{ms.get('ov', float('nan')):.{digits}f} | {_ratio(ms['in_place'], best_peer)} |")


def bench_gpt2(args) -> list[str]:
    model, info = dynamic_zoo.gpt2_decoder_dynamic(d=768, heads=12, layers=args.layers, vocab=50257,
                                                   max_positions=1040)
    result, seconds = _timed_build(model, dims={"batch": (1, 1), "seq": (1, 16), "past": (0, 1024)})
    print(f"gpt2: Kiln build {seconds:.1f} s", flush=True)
    lines = [f"GPT-2 decoding, d=768, 12 heads, vocab 50257, {args.layers} layers: ms per token", "", *GPT2_TABLE]
    for past in PAST_LENGTHS:
        f = _decode_feeds(info, past)
        for threads in sorted({1, THREADS}):
            kiln, sess, ov = result.load(threads=threads), ort_session(model, threads), openvino_runner(model, threads)
            runs = {**_decode_runs(kiln, f, info, past), "ort": lambda: sess.run(None, f)}
            if ov is not None:
                runs["ov"] = lambda: ov(f)
            ms = interleaved(runs, args.warmup, args.repeat, args.rounds)
            lines.append(_decode_row(past, threads, ms, 2))
            print(lines[-1], flush=True)
    return lines


BIG = {"d": 2048, "heads": 16, "layers": 16, "vocab": 50257, "max_positions": 1040}
BIG_PAST = (16, 128, 512)


def write_big(path: str) -> None:
    """The 1B decoder with its weights in `decoder.data` beside `path` (run in a process of its
    own: generating holds the weights twice, and that memory must not count for the runs)."""
    import onnx
    model, _ = dynamic_zoo.gpt2_decoder_dynamic(**BIG)
    onnx.save_model(model, path, save_as_external_data=True, location="decoder.data")


def _decode_feeds(info: dict, past: int) -> dict:
    rng = np.random.default_rng(0)
    f = {"input_ids": np.array([[7]], np.int64), "position_ids": np.array([[past]], np.int64)}
    for i in range(info["layers"]):
        for kind in ("key", "value"):
            f[f"past_{kind}_{i}"] = rng.standard_normal((1, info["heads"], past, info["dh"])).astype(np.float32)
    return f


def bench_big(args) -> list[str]:
    folder = args.big_dir or tempfile.mkdtemp(prefix="kiln-bench-big-")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "decoder.onnx")
    try:
        if not os.path.exists(path):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, os.path.abspath(__file__), "--write-big", path], check=True)
            print(f"big: wrote the model in {time.perf_counter() - t0:.0f} s", flush=True)
        model_bytes = sum(os.path.getsize(os.path.join(folder, n)) for n in ("decoder.onnx", "decoder.data"))
        bundle, report = os.path.join(folder, "bundle"), os.path.join(folder, "report.json")
        shutil.rmtree(bundle, ignore_errors=True)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "modelkiln.orchestrator.cli", "build", path, "-o", bundle,
                        "--dim", "batch=1..1", "--dim", "seq=1..16", "--dim", "past=0..1024", "--no-cache", "--quiet",
                        "--report", report], check=True, env={**os.environ, "PYTHONPATH": ROOT})
        seconds = time.perf_counter() - t0
        with open(report) as f:
            peak = json.load(f)["timing"]["driver_peak_rss_mb"] * 2**20
        params = (model_bytes - os.path.getsize(path)) / 4
        lines = [f"A {params / 1e9:.2f}B-parameter decoder (GPT-2 style, d={BIG['d']}, {BIG['heads']} heads, "
                 f"{BIG['layers']} layers, vocab {BIG['vocab']}; {model_bytes / 2**30:.2f} GiB of float32 weights): "
                 f"`kiln build` {seconds:.0f} s (a process of its own, cold, {THREADS} workers), the driver's peak "
                 f"memory {peak / 2**30:.2f} GiB = {peak / model_bytes:.2f}x the model's bytes; ms per token", "",
                 *GPT2_TABLE]
        print(lines[0], flush=True)
        from modelkiln.artifacts.module import Module
        info = {"layers": BIG["layers"], "heads": BIG["heads"], "dh": BIG["d"] // BIG["heads"]}
        for threads in sorted({1, THREADS}):
            kiln, sess, ov = Module(bundle, threads), ort_session(path, threads), openvino_runner(path, threads)
            for past in BIG_PAST:
                f = _decode_feeds(info, past)
                runs = {**_decode_runs(kiln, f, info, past), "ort": lambda: sess.run(None, f)}
                if ov is not None:
                    runs["ov"] = lambda: ov(f)
                ms = interleaved(runs, 2, max(3, args.repeat // 4), args.rounds)
                lines.append(_decode_row(past, threads, ms, 1))
                print(lines[-1], flush=True)
            del kiln, sess, ov
        return lines
    finally:
        if not args.big_dir:
            shutil.rmtree(folder, ignore_errors=True)


IMAGE_SIZES = ((224, 224), (320, 480), (512, 512))


def _image_sizes_dynamic(model):
    """The model with its image input's height and width made the symbols `height`, `width`."""
    model = type(model).FromString(model.SerializeToString())
    dims = model.graph.input[0].type.tensor_type.shape.dim
    dims[2].dim_param, dims[3].dim_param = "height", "width"
    return model


def _cnn_rows(name: str, model, dims: dict, cases: list, args) -> list[str]:
    """Table rows of a CNN built once with `dims`, at each case (label, input shape), beside
    Kiln built for that shape and the peers, at one thread and at every usable core."""
    x_name = model.graph.input[0].name
    dynamic, seconds = _timed_build(model, dims=dims)
    print(f"{name}: Kiln dynamic build {seconds:.1f} s", flush=True)
    lines = []
    for label, shape in cases:
        f = {x_name: np.random.default_rng(shape[0] * shape[2]).standard_normal(shape).astype(np.float32)}
        static, _ = _timed_build(model, shapes={x_name: list(shape)})
        for threads in sorted({1, THREADS}):
            ms = _dynamic_static_and_peers(model, dynamic, static, f, threads, max(5, args.repeat // 2), args)
            lines.append(f"| {name} | {label} | {threads} | {_row_cells(ms)}")
            print(lines[-1], flush=True)
    return lines


def _cnn_table(title: str, column: str, make, dims: dict, cases: list, args) -> list[str]:
    """The table of ResNet-18 and MobileNetV2 (make(name): the model with its symbols) built
    once with `dims`, a row per case and thread count (`_cnn_rows`)."""
    lines = [title, "", f"| model | {column} | threads | Kiln dynamic | Kiln static | onnxruntime | OpenVINO "
             "| dynamic / static | dynamic / best peer |", "|---|---|---|---|---|---|---|---|---|"]
    for name in ("resnet18", "mobilenet_v2"):
        lines += _cnn_rows(name, make(name), dims, cases, args)
    return lines


def bench_cnn(args) -> list[str]:
    from tests import model_zoo
    return _cnn_table("CNNs over run-time image sizes (height, width = 32..640): median ms", "image",
                      lambda name: _image_sizes_dynamic(getattr(model_zoo, name)()),
                      {"height": (32, 640), "width": (32, 640)},
                      [(f"{h} x {w}", (1, 3, h, w)) for h, w in IMAGE_SIZES], args)


BATCHES = (1, 4)


def _batch_dynamic(model):
    """The model with its batch (its input's first dim) made the symbol `n`."""
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "n"
    return model


def bench_batch(args) -> list[str]:
    from tests import model_zoo
    return _cnn_table("CNNs over a run-time batch (n = 1..8), 224 x 224: median ms", "batch",
                      lambda name: _batch_dynamic(getattr(model_zoo, name)(size=224)), {"n": (1, 8)},
                      [(str(n), (n, 3, 224, 224)) for n in BATCHES], args)


def bench_batch_zoo(args) -> list[str]:
    """Every CNN of the bench (and the ViT) built with a run-time batch, at a batch of one,
    beside a build for a batch of one: what a model exported with a dynamic batch costs a
    caller serving single images."""
    from tests import model_zoo, vision_zoo
    names = ["resnet18", "mobilenet_v2", "unet", *vision_zoo.ALL]
    lines = ["Built with a run-time batch (n = 1..8), run at a batch of one: median ms", "",
             "| model | threads | Kiln dynamic | Kiln static | dynamic / static |", "|---|---|---|---|---|"]
    for name in names:
        model = {**model_zoo.ALL, **vision_zoo.ALL}[name]()
        x = model.graph.input[0]
        f = {x.name: np.random.default_rng(0).standard_normal(
            [d.dim_value for d in x.type.tensor_type.shape.dim]).astype(np.float32)}
        static, _ = _timed_build(model)
        dynamic, _ = _timed_build(_batch_dynamic(model), dims={"n": (1, 8)})
        for threads in sorted({1, THREADS}):
            kd, ks = dynamic.load(threads=threads), static.load(threads=threads)
            ms = interleaved({"dyn": lambda: kd.run(f), "static": lambda: ks.run(f)}, args.warmup,
                             max(5, args.repeat // 2), args.rounds)
            lines.append(f"| {name} | {threads} | {ms['dyn']:.2f} | {ms['static']:.2f} | "
                         f"{_ratio(ms['dyn'], ms['static'])} |")
            print(lines[-1], flush=True)
    return lines


LOOP_LENGTHS = (8, 64, 256)


def bench_loops(args) -> list[str]:
    """A decoding loop as torch.jit.script exports it (tests/test_sequences.py's list decoder:
    `for i in range(max_len)`, a tanh cell and an output layer of width 512 on one row, each
    output appended to a list, `torch.stack` after), built once with max_len = 0..256 and run
    to 8, 64 and 256 steps, beside onnxruntime and OpenVINO running the same Loop: the cost
    of an iteration where the loop runs in the module's entry function."""
    from tests.test_sequences import scripted_list_decoder
    model = scripted_list_decoder(width=512, batch=1, stop_above=1e30)
    result, seconds = _timed_build(model, dims={"max_len": (0, max(LOOP_LENGTHS))})
    print(f"loop decoder: built in {seconds:.1f} s", flush=True)
    rng = np.random.default_rng(0)
    lines = ["A scripted decoding loop (width 512, one row, a list appended each step), built once with max_len "
             "= 0..256: median ms", "", "| steps | threads | Kiln | onnxruntime | OpenVINO | Kiln / best peer "
             "| Kiln us per step |", "|---|---|---|---|---|---|---|"]
    for threads in sorted({1, THREADS}):
        kiln, ort = result.load(threads=threads), ort_session(model, threads)
        for steps in LOOP_LENGTHS:
            f = {"h": rng.standard_normal((1, 512)).astype(np.float32),
                 "x": rng.standard_normal((1, 512)).astype(np.float32), "max_len": np.array(steps, np.int64)}
            want = ort.run(None, f)[0]
            np.testing.assert_allclose(kiln.run(f)["ys"], want, rtol=1e-4, atol=1e-4)
            runs = {"kiln": lambda: kiln.run(f), "ort": lambda: ort.run(None, f)}
            ov = openvino_runner(model, threads, f)
            if ov is not None:
                runs["ov"] = lambda: ov(f)
            ms = interleaved(runs, args.warmup, max(5, args.repeat // 2), args.rounds)
            best = min(ms["ort"], ms.get("ov", float("inf")))
            ov_ms = f"{ms['ov']:.3f}" if "ov" in ms else "n/a"
            lines.append(f"| {steps} | {threads} | {ms['kiln']:.3f} | {ms['ort']:.3f} | {ov_ms} | "
                         f"{_ratio(ms['kiln'], best)} | {1000 * ms['kiln'] / steps:.1f} |")
            print(lines[-1], flush=True)
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--parts", default="bert,gpt2,big")
    p.add_argument("--big-dir", help="keep the 1B model here (written once, reused by later runs)")
    p.add_argument("--write-big", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.write_big:
        return write_big(args.write_big)
    tables = []
    for part in args.parts.split(","):
        parts = {"bert": bench_bert, "gpt2": bench_gpt2, "big": bench_big, "cnn": bench_cnn, "batch": bench_batch,
                 "batch_zoo": bench_batch_zoo, "loops": bench_loops}
        tables += parts[part](args) + [""]
    print("\n".join(tables))


if __name__ == "__main__":
    main()
