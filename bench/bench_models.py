"""Inference latency: Kiln against onnxruntime and OpenVINO, side by side in one run.

    python bench/bench_models.py [--repeat 50] [--rounds 2] [--models resnet18,mlp_b1] [--no-gemm] [--isa avx2]

For every model: Kiln's cold build time (no cache, local executor), then the median latency
on the same inputs (after warm-up) of Kiln, onnxruntime and OpenVINO, each at 1 thread and
at every usable core (OpenVINO in float32, forced with INFERENCE_PRECISION_HINT=f32: it
defaults to bfloat16 on CPUs with AVX512-BF16; `pip install openvino`, or its columns read
n/a), measured in interleaved rounds (each runner in turn: this machine is noisy), the better
median of each; Kiln's time over the best peer's at each thread count, and its own speedup.
The int8 models are quantized by onnxruntime's own tool and every runner runs the same
quantized file (on an x86 host without VNNI, where onnxruntime's int8 saturates, Kiln's
outputs are checked against onnx's reference evaluator instead: tests/int8_reference.py; the
peers' int8 times there are of those saturating kernels). Then the GEMM table: Kiln's int8
GEMM (MatMulInteger, VNNI where the CPU has it) against its own float32 GEMM on the same shapes, onnxruntime's beside
both. Prints Markdown tables (the ones in docs/performance.md).

The header names the host's vector ISA and the code each runner ran. `--isa avx2` on an
AVX-512 host measures the AVX2 code instead: Kiln builds for x86-64-v3, OpenVINO's oneDNN
kernels are held to AVX2 (ONEDNN_MAX_CPU_ISA; its own eltwise nodes and MLAS GEMMs still use
AVX-512), onnxruntime cannot be held back (its columns are AVX-512) and the ratio columns are
then against OpenVINO alone. On an AVX2 host, run it without the flag.

OpenVINO first runs each model once in a child process: where that child dies (held to AVX2,
OpenVINO 2026.4.1 crashes on wav2vec2's feature encoder), its columns read n/a and the bench
goes on.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from modelkiln.orchestrator.api import build  # noqa: E402
from tests import model_zoo, transformer_zoo, vision_zoo  # noqa: E402
from tests.int8_reference import onnxruntime_int8_is_exact  # noqa: E402

# name -> () -> (model, inputs): the test zoo's models on random inputs, a BERT-style encoder
# (4 layers, d=256, 128 tokens, a padded attention mask) as torch's dynamo exports it, their
# int8 versions from onnxruntime's quantization tool, and recurrent nets of speech models.
MODELS = {name: (lambda make=make: (lambda m: (m, model_zoo.random_inputs(m)))(make()))
          for name, make in model_zoo.ALL.items()}


def _bert():
    return transformer_zoo.bert_encoder("dynamo", seq=128, d=256, heads=4, layers=4, vocab=8000, ffn=1024)


def _quantized(make, fmt):
    model, inputs = make()
    return model_zoo.quantized(model, fmt), inputs


MODELS["bert_encoder"] = _bert
# One block of each at its real width: GPT-2 small's (768 wide, 12 heads), T5-small's (512,
# 8 heads, FFN 2048), Swin-T's first stage (56x56, 7x7 windows, 96 wide) and wav2vec2's
# feature encoder (a second of 16 kHz audio, 512 channels).
MODELS["gpt2_block"] = lambda: transformer_zoo.gpt2_block(seq=128, d=768, heads=12)
MODELS["t5_block"] = lambda: transformer_zoo.t5_block(seq=128, d=512, heads=8, ffn=2048)
MODELS["swin_block"] = lambda: transformer_zoo.swin_block(size=56, window=7, d=96, heads=3)
MODELS["wav2vec2_features"] = lambda: transformer_zoo.wav2vec2_features(samples=16000, channels=512)
MODELS.update({name: (lambda make=make: (lambda m: (m, model_zoo.random_inputs(m)))(make()))
               for name, make in vision_zoo.ALL.items()})
MODELS["resnet18_int8_qdq"] = lambda: _quantized(MODELS["resnet18"], "qdq")
MODELS["resnet18_int8_qoperator"] = lambda: _quantized(MODELS["resnet18"], "qoperator")
MODELS["mobilenet_v2_int8_qdq"] = lambda: _quantized(MODELS["mobilenet_v2"], "qdq")
MODELS["regnety_400mf_int8_qdq"] = lambda: _quantized(MODELS["regnety_400mf"], "qdq")
MODELS["bert_encoder_int8_dynamic"] = lambda: _quantized(_bert, "dynamic")
# A voice-activity-detector-sized LSTM (one layer, 64 -> 128, 100 frames) and an OCR-sized
# bidirectional two-layer LSTM (128 -> 256 per direction, 40 steps), batch 1.
MODELS["lstm_speech"] = lambda: model_zoo.recurrent_model("LSTM", seq=100, batch=1, width=64, hidden=128, dirs=1,
                                                          lens=False, init=False)
MODELS["lstm_bidir_2x"] = lambda: model_zoo.recurrent_model("LSTM", seq=40, batch=1, width=128, hidden=256, dirs=2,
                                                            layers=2, lens=False, init=False)
# Absolute tolerance as a fraction of the output's range, where onnxruntime computes otherwise:
# it runs a QDQ model's convolutions in float32 where Kiln sums in int32, so a level may round
# the other way and carry through the layers (about one level of the int8 output, 1/127 of its
# range; tests/test_quantized.py states it); quantize_dynamic quantizes activations at run time
# from their min and max, so a one-ulp difference in a LayerNorm moves a scale, and levels
# move with it (onnxruntime differs from itself by as much with its graph optimizations off).
# (onnx's reference evaluator, where it judges instead, computes the QOperator format's QLinear
# ops in float too: tests/int8_reference.py.)
LOOSE = {"resnet18_int8_qdq": 0.01, "resnet18_int8_qoperator": 0.01, "mobilenet_v2_int8_qdq": 0.01,
         "regnety_400mf_int8_qdq": 0.01,
         "bert_encoder_int8_dynamic": 0.05}


THREADS = len(os.sched_getaffinity(0))


def ort_session(model, threads: int = 1):
    """model: a ModelProto, or a path (a model with external data)."""
    import onnxruntime as ort
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    source = model if isinstance(model, str) else model.SerializeToString()
    return ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])


def _openvino_config(threads: int, f32: bool = True) -> dict:
    """f32 False: OpenVINO's own precision (bf16 on CPUs with AVX512-BF16 or AMX)."""
    return {**({"INFERENCE_PRECISION_HINT": "f32"} if f32 else {}), "INFERENCE_NUM_THREADS": threads,
            "PERFORMANCE_HINT": "LATENCY"}


def peer_table_args(doc: str) -> argparse.Namespace:
    """--threads and --rounds of a bench that prints one table beside the peers, the host
    named first (its CPU and vector ISA)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(f"{cpu_name()} ({host_isa()}), {args.threads} thread(s)\n")
    return args


def beside_onnxruntime(model, feeds: dict, threads: int) -> tuple:
    """A model (ModelProto) built by Kiln and loaded beside an onnxruntime session: (Kiln's
    outputs, onnxruntime's, {"kiln", "onnxruntime": runners}, OpenVINO's request or None).
    The caller checks the outputs agree and adds OpenVINO's runner where it should."""
    from modelkiln.orchestrator.api import build
    module = build(model, cache=None, progress=False).load(threads=threads)
    session = ort_session(model, threads)
    got, want = module.run(feeds), session.run(None, feeds)
    runs = {"kiln": lambda: module.run(feeds), "onnxruntime": lambda: session.run(None, feeds)}
    return got, want, runs, openvino_request(model, threads, feeds)


def openvino_request(model, threads: int, feeds: dict):
    """OpenVINO's infer request for a model (a ModelProto), tried once on `feeds`, or None
    (the reason printed) where it cannot run it: a peer left out of a table, said why."""
    try:
        import openvino as ov
        core = ov.Core()
        request = core.compile_model(core.read_model(model.SerializeToString()), "CPU",
                                     _openvino_config(threads)).create_infer_request()
        request.infer(feeds)
        return request
    except Exception as e:  # noqa: BLE001 - whatever OpenVINO raises
        print(f"OpenVINO left out: {e}", file=sys.stderr)
        return None


# Run in a child process: OpenVINO compiles the model and infers once on the given inputs.
_OPENVINO_PROBE = """
import sys, numpy as np, openvino as ov
path, feeds, threads, f32 = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[5] == "f32"
sys.path.insert(0, sys.argv[4])
from bench.bench_models import _openvino_config
core = ov.Core()
core.compile_model(core.read_model(path), "CPU", _openvino_config(threads, f32)).create_infer_request().infer(
    dict(np.load(feeds)))
"""


def _openvino_survives(path: str, threads: int, inputs: dict, tmp: str, f32: bool = True) -> bool:
    """Whether OpenVINO runs the model once in a child process. Held to AVX2 it dies of
    SIGSEGV on wav2vec2's feature encoder (2026.4.1), which took the whole bench with it."""
    import subprocess
    feeds = os.path.join(tmp, "feeds.npz")
    np.savez(feeds, **inputs)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    child = subprocess.run([sys.executable, "-c", _OPENVINO_PROBE, path, feeds, str(threads), root,
                            "f32" if f32 else "default"],
                           capture_output=True, text=True)
    if child.returncode:
        why = f"signal {-child.returncode}" if child.returncode < 0 else child.stderr.strip().splitlines()[-1:]
        print(f"(OpenVINO failed a trial run of this model at {threads} thread(s): {why}; its column reads n/a)",
              file=sys.stderr, flush=True)
    return child.returncode == 0


def openvino_runner(model, threads: int, inputs: dict | None = None, f32: bool = True):
    """OpenVINO's CPU plugin on the same model (a ModelProto or a path) in float32 (with f32
    False at its own default precision) at `threads` threads, or None where OpenVINO is not
    installed or cannot read the model (onnxruntime's QOperator format: its com.microsoft
    ops), or, given `inputs`, where a trial run on them in a child process fails (it crashed
    on some models)."""
    try:
        import openvino as ov
    except ImportError:
        return None
    import tempfile
    with tempfile.TemporaryDirectory(prefix="kiln-bench-ov-") as tmp:
        path = model if isinstance(model, str) else os.path.join(tmp, "model.onnx")
        if not isinstance(model, str):
            with open(path, "wb") as f:
                f.write(model.SerializeToString())
        if inputs is not None and not _openvino_survives(path, threads, inputs, tmp, f32):
            return None
        try:
            compiled = ov.Core().compile_model(ov.Core().read_model(path), "CPU", _openvino_config(threads, f32))
        except RuntimeError:
            return None
    request = compiled.create_infer_request()
    return lambda inputs: request.infer(inputs)


def median_ms(run, warmup: int, repeat: int) -> float:
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        run()
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def interleaved(runs: dict, warmup: int, repeat: int, rounds: int) -> dict:
    """{name: better median over `rounds` rounds}, the runs taking turns within each round."""
    best = {k: float("inf") for k in runs}
    for _ in range(rounds):
        for k, run in runs.items():
            # The runtimes' idle threads spin for a while after a run (onnxruntime's, OpenVINO's,
            # Kiln's): let them settle, or they take the next runner's second core.
            time.sleep(0.2)
            best[k] = min(best[k], median_ms(run, warmup, repeat))
    return best


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_isa() -> str:
    """The widest x86 vector ISA of this host (or its architecture elsewhere)."""
    from modelkiln.artifacts.cpu_features import host_arch, host_flags
    flags = host_flags()
    if flags is None:
        return host_arch()
    if "avx512f" in flags:
        extras = [name for flag, name in (("avx512_vnni", "VNNI"), ("avx512_bf16", "BF16"), ("avx512_fp16", "FP16"),
                                          ("amx_int8", "AMX-INT8"), ("amx_bf16", "AMX-BF16")) if flag in flags]
        return " ".join(["AVX-512"] + extras)
    return "AVX2" + (" AVX-VNNI" if "avx_vnni" in flags else "") if "avx2" in flags else "SSE"


def bench_model(name: str, args) -> None:
    model, inputs = MODELS[name]()
    t0 = time.perf_counter()
    result = build(model, target=args.target, cache=None, progress=False)
    build_s = time.perf_counter() - t0
    module, module_all = result.load(threads=1), result.load(threads=THREADS)
    sess = ort_session(model)
    got, want = module_all.run(inputs), dict(zip([o.name for o in sess.get_outputs()], sess.run(None, inputs)))
    if "int8" in name and not onnxruntime_int8_is_exact():
        # (onnxruntime's int8 saturates on x86 without VNNI: the exact reference judges instead)
        from tests.int8_reference import reference_outputs
        want = reference_outputs(model, inputs)
    for k in want:
        # (float32 accumulates in another order: an absolute floor relative to the output's range)
        tol = float(np.abs(want[k]).max()) * LOOSE.get(name, 1e-5) + 1e-4
        assert np.allclose(got[k], want[k], rtol=1e-3, atol=tol), f"{name}: outputs differ"
    runs = {"kiln 1t": lambda: module.run(inputs), f"kiln {THREADS}t": lambda: module_all.run(inputs),
            "ort 1t": lambda: sess.run(None, inputs)}
    sess_all = ort_session(model, THREADS)
    runs[f"ort {THREADS}t"] = lambda: sess_all.run(None, inputs)
    for threads in (1, THREADS):
        ov_run = openvino_runner(model, threads, inputs)
        if ov_run is not None:
            runs[f"ov {threads}t"] = lambda ov_run=ov_run: ov_run(inputs)
    ms = interleaved(runs, args.warmup, args.repeat, args.rounds)
    cell = lambda k: f"{ms[k]:.3f}" if k in ms else "n/a"  # noqa: E731
    peers = ("ov",) if args.isa == "avx2" else ("ort", "ov")  # (held to AVX2, only OpenVINO is comparable)
    best = min([ms[k] for k in (f"{p} 1t" for p in peers) if k in ms] or [float("nan")])
    best_all = min([ms[k] for k in (f"{p} {THREADS}t" for p in peers) if k in ms] or [float("nan")])
    kiln_1t, kiln_all = ms["kiln 1t"], ms[f"kiln {THREADS}t"]
    ratio = lambda kiln, peer: f"{kiln / peer:.2f}" if peer == peer else "n/a"  # noqa: E731 (NaN: no peer ran)
    print(f"| {name} | {build_s:.2f} | {result.report['totals']['kernels']} | {kiln_1t:.3f} | {kiln_all:.3f} | "
          f"{cell('ort 1t')} | {cell(f'ort {THREADS}t')} | {cell('ov 1t')} | {cell(f'ov {THREADS}t')} | "
          f"{ratio(kiln_1t, best)} | {ratio(kiln_all, best_all)} | {kiln_1t / kiln_all:.2f}x |", flush=True)


GEMM_SHAPES = [(128, 768, 768), (128, 768, 3072), (512, 1024, 1024)]


def _product_model(m: int, k: int, n: int, int8: bool):
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(0)
    if int8:
        w = numpy_helper.from_array(rng.integers(-127, 128, (k, n)).astype(np.int8), "w")
        node = helper.make_node("MatMulInteger", ["a", "w", "za"], ["y"])
        inits = [w, numpy_helper.from_array(np.array(128, np.uint8), "za")]
        a_type, y_type = TensorProto.UINT8, TensorProto.INT32
        a = rng.integers(0, 256, (m, k)).astype(np.uint8)
    else:
        inits = [numpy_helper.from_array(rng.standard_normal((k, n)).astype(np.float32), "w")]
        node = helper.make_node("MatMul", ["a", "w"], ["y"])
        a_type, y_type = TensorProto.FLOAT, TensorProto.FLOAT
        a = rng.standard_normal((m, k)).astype(np.float32)
    graph = helper.make_graph([node], "gemm", [helper.make_tensor_value_info("a", a_type, [m, k])],
                              [helper.make_tensor_value_info("y", y_type, [m, n])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), {"a": a}


def bench_gemm(args) -> None:
    from onnx import numpy_helper
    print("\n| GEMM m x k x n | kiln int8 ms | kiln fp32 ms | kiln int8 speedup | onnxruntime int8 ms | "
          "onnxruntime fp32 ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for m, k, n in GEMM_SHAPES:
        runs = {}
        for int8 in (True, False):
            model, inputs = _product_model(m, k, n, int8)
            module, sess = build(model, target=args.target, cache=None, progress=False).load(threads=1), ort_session(model)
            got = module.run(inputs)["y"]
            if int8:  # (exact, in numpy's int64: onnxruntime's own int8 saturates on x86 without VNNI)
                w = next(t for t in model.graph.initializer if t.name == "w")
                want = (inputs["a"].astype(np.int64) - 128) @ numpy_helper.to_array(w).astype(np.int64)
                assert np.array_equal(got, want), "int8 GEMM outputs differ from the exact product"
            else:
                assert np.allclose(got, sess.run(None, inputs)[0], rtol=1e-3, atol=1e-2), "GEMM outputs differ"
            tag = "int8" if int8 else "fp32"
            runs[f"kiln {tag}"] = lambda module=module, inputs=inputs: module.run(inputs)
            runs[f"ort {tag}"] = lambda sess=sess, inputs=inputs: sess.run(None, inputs)
        ms = interleaved(runs, args.warmup, args.repeat, args.rounds)
        print(f"| {m} x {k} x {n} | {ms['kiln int8']:.3f} | {ms['kiln fp32']:.3f} | "
              f"{ms['kiln fp32'] / ms['kiln int8']:.2f}x | {ms['ort int8']:.3f} | {ms['ort fp32']:.3f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-gemm", action="store_true", help="skip the int8/fp32 GEMM table")
    ap.add_argument("--isa", choices=["host", "avx2"], default="host",
                    help="avx2: measure AVX2 code on an AVX-512 host (see the module's docstring)")
    args = ap.parse_args()
    args.target = "x86-64-v3" if args.isa == "avx2" else "llvm"
    if args.isa == "avx2":
        os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX2"  # read when OpenVINO's CPU plugin loads
    from modelkiln.orchestrator.target import parse_target
    kiln_target = parse_target(args.target)
    import onnxruntime
    try:
        import openvino
        ov_version = f"OpenVINO {openvino.__version__.split('-')[0]} (f32)"
    except ImportError:
        ov_version = "OpenVINO not installed"
    held = args.isa == "avx2"
    print(f"# {time.strftime('%Y-%m-%d')}, {cpu_name()} ({host_isa()}), {THREADS} usable cores; onnxruntime "
          f"{onnxruntime.__version__}; {ov_version}; ms, better median of {args.rounds} interleaved rounds; "
          "the GEMM table at 1 thread\n")
    print(f"Code run: Kiln {kiln_target.cpu} ({kiln_target.vector_width} float32 lanes); onnxruntime "
          f"{host_isa()}; OpenVINO {'oneDNN held to AVX2' if held else host_isa()}. "
          f"Ratios: Kiln over {'OpenVINO' if held else 'the best of onnxruntime and OpenVINO'}.\n")
    print(f"| model | kiln build (cold, s) | kernels | kiln 1t | kiln {THREADS}t | onnxruntime 1t | "
          f"onnxruntime {THREADS}t | OpenVINO 1t | OpenVINO {THREADS}t | kiln / best 1t | kiln / best {THREADS}t | "
          f"kiln {THREADS}t speedup |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.models.split(","):
        bench_model(name, args)
    if not args.no_gemm:
        bench_gemm(args)


if __name__ == "__main__":
    main()
