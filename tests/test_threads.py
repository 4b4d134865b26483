"""The module's thread pool: every thread count gives the same bytes, and onnxruntime's answer.

Each model here is built once and run at 1, 2, 3 and 5 threads (more than this machine's
cores: parts then share a core). The models are chosen so that every kind of divided phase
occurs, which each test asserts from the build's thread plans before it compares outputs:
a loop over rows, channels or elements (on multiples of the vector grain), a GEMM divided by
row blocks and one divided by column panels, both with partial last blocks and panels.
"""
import os
import subprocess
import sys

import numpy as np
import pytest
from onnx import TensorProto, numpy_helper

from tests import model_zoo
from tests.conftest import assert_matches_oracle
from tests.test_bad_input import kiln

THREAD_COUNTS = (1, 2, 3, 5)


def _odd_shapes_model():
    """A GEMM per split kind with partial blocks and panels, a batched MatMul of two
    activations (attention's QK^T: packed B per head), a Gemm packing its B at run time, a
    conv transpose, a long elementwise chain, Softmax, ReduceMean, Concat, CumSum and ArgMax."""
    g = model_zoo.GraphMaker(3)
    x = "x"  # [45, 256]
    rows = g.op("MatMul", [x, g.weight((256, 70))])  # 4 row blocks (the last of 3 rows), 3 panels
    rows = g.op("Relu", [rows])
    v = "v"  # [5, 2048]
    cols = g.op("MatMul", [v, g.weight((2048, 200))])  # one row block: divided by panels (the last partial)
    q = g.op("Reshape", [g.op("MatMul", [x, g.weight((256, 256))]), g.const(np.array([45, 4, 64]))])
    q = g.op("Transpose", [q], perm=[1, 0, 2])  # [4, 45, 64]
    k = g.op("Transpose", [q], perm=[0, 2, 1])
    scores = g.op("Softmax", [g.op("MatMul", [q, k])], axis=-1)  # [4, 45, 45]
    runtime_b = g.op("Gemm", [x, g.op("Tanh", [g.op("MatMul", [x, g.weight((256, 256))])])], transB=1)
    img = g.op("Reshape", [x, g.const(np.array([1, 16, 24, 30]))])
    up = g.op("ConvTranspose", [img, g.weight((16, 8, 3, 3))], strides=[2, 2], pads=[1, 1, 1, 1])
    flat = g.op("Reshape", [x, g.const(np.array([-1]))])  # 11520 elements: not a multiple of the grain
    chain = g.op("Mul", [g.op("Sigmoid", [g.op("Add", [flat, g.const(np.float32(0.5))])]), flat])
    mean = g.op("ReduceMean", [x], axes=[1], keepdims=1)
    joined = g.op("Concat", [x, x], axis=0)
    summed = g.op("CumSum", [x, g.const(np.array(1))])
    best = g.op("Cast", [g.op("ArgMax", [x], axis=1, keepdims=0)], to=TensorProto.FLOAT)
    outs = {"rows": rows, "cols": cols, "scores": scores, "runtime_b": runtime_b, "up": up, "chain": chain,
            "mean": mean, "joined": joined, "summed": summed, "best": best}
    for name, t in outs.items():
        model_zoo._rename_output(g, t, name)
    return g.model({"x": [45, 256], "v": [5, 2048]}, list(outs), opset=17, name="odd_shapes")


MODELS = {
    "odd_shapes": _odd_shapes_model,
    "resnet18_112": lambda: model_zoo.resnet18(size=112),  # implicit-GEMM convs, by rows and by panels
    "mobilenet_v2": lambda: model_zoo.mobilenet_v2(size=64),  # depthwise (strided too), pointwise
    "transformer": lambda: model_zoo.transformer_encoder(seq=64, d=128, heads=4, ffn=512),
    # the two directions' time loops run at once
    "bidirectional_lstm": lambda: model_zoo.recurrent_model("LSTM", seq=20, batch=2, width=64, hidden=128, dirs=2,
                                                            lens=False, init=False)[0],
    # a batch's images on threads of their own: convs, the strided max pool, depthwise, pointwise
    "resnet18_batch3": lambda: model_zoo.resnet18(batch=3, size=64),
    "mobilenet_v2_batch3": lambda: _batch_of(model_zoo.mobilenet_v2(size=48), 3),
    "wide_depthwise_batch3": lambda: _wide_depthwise_and_pool(3),
}


def _wide_depthwise_and_pool(images: int):
    """A depthwise conv and a strided max pool whose bordered copies for 3 images pass 8 MiB
    (PARALLEL_SLICES_FLOATS), within twice the input: their images still run in parallel."""
    g = model_zoo.GraphMaker(5)
    h = g.op("Relu", [g.conv("x", 64, 64, 3, stride=2, group=64)])
    h = g.op("MaxPool", [g.conv(h, 64, 64, 3, group=64)], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    return g.model({"x": [images, 64, 120, 120]}, [h])


def _batch_of(model, images: int):
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = images
    return model


def _divided_phases(result) -> set:
    """What kinds of divided phases the build's thread plans hold: "loop", "gemm-m", "gemm-n"."""
    from modelkiln.ir.loop import Gemm, phases
    from modelkiln.ir.parallel import thread_plan
    kinds = set()
    for call in result.lowered.calls:
        for part, (_, pieces, _) in zip(phases(call.kernel.body)[1], thread_plan(call.kernel)):
            if pieces > 1:
                kinds.add(f"gemm-{part.split}" if isinstance(part, Gemm) else "loop")
    return kinds


def _image_loop_divides(kernel) -> bool:
    """Whether one of the kernel's phases is a parallel loop over the batch's 3 images (its
    thread plan then divides it where its work is worth a thread)."""
    from modelkiln.ir.loop import For, phases
    return any(isinstance(part, For) and part.parallel and part.extent == 3 for part in phases(kernel.body)[1])


@pytest.fixture(scope="module", params=sorted(MODELS))
def built(request, executor):
    from modelkiln.orchestrator.api import build
    model = MODELS[request.param]()
    return request.param, model, build(model, executor=executor, cache=None, progress=False)


def test_every_thread_count_gives_the_same_bytes_and_onnxruntimes_answer(built):
    name, model, result = built
    kinds = _divided_phases(result)
    # (a batch's convs run their GEMMs inside the loop over images, which divides)
    assert "loop" in kinds and (kinds & {"gemm-m", "gemm-n"} or name.endswith("_batch3")), \
        f"{name}: nothing divides across threads ({kinds})"
    if name == "odd_shapes":
        assert kinds == {"loop", "gemm-m", "gemm-n"}
    if name.endswith("_batch3"):  # (every conv's loop over images divides)
        for call in result.lowered.calls:
            if {"Conv", "MaxPool"} & set(call.ops):
                assert _image_loop_divides(call.kernel), f"{name}: {call.name}'s images run on one thread"
    inputs = model_zoo.random_inputs(model, 1)
    runs = {}
    for threads in THREAD_COUNTS:
        module = result.load(threads=threads)
        assert module.threads == threads
        runs[threads] = [module.run(inputs) for _ in range(3)]
    first = runs[1][0]
    for threads, outs in runs.items():
        for out in outs:
            for key in first:
                assert np.array_equal(out[key], first[key]), f"{name}: {key} differs at {threads} threads"
    assert_matches_oracle(result, model, 1)


def test_a_batch_1_layer_streaming_its_weights_divides_across_threads(executor):
    """A layer of one row reads each of its 784 x 256 weights for one multiply-add: the load is
    the cost (ir/parallel.py, STREAMED_LOAD_WORK), so its GEMM's panels divide across threads;
    the next layer's 256 x 128 still runs whole. Every thread count gives the same bytes and
    onnxruntime's answer."""
    from modelkiln.ir.parallel import thread_plan
    from modelkiln.orchestrator.api import build
    model = model_zoo.mlp(1)
    result = build(model, executor=executor, cache=None, progress=False)
    pieces = [thread_plan(c.kernel)[0][1] for c in result.lowered.calls]
    assert pieces[0] > 1 and pieces[1:] == [1, 1], pieces
    inputs = model_zoo.random_inputs(model, 1)
    first = result.load(threads=1).run(inputs)
    for threads in THREAD_COUNTS:
        out = result.load(threads=threads).run(inputs)
        assert all(np.array_equal(out[k], first[k]) for k in first), threads
    assert_matches_oracle(result, model, 1)


# Built over a run-time batch (its first dim made the symbol n): ResNet's convs and pool, and
# MobileNetV2's depthwise and pointwise convs.
RUN_TIME_BATCH = {"resnet18": lambda: model_zoo.resnet18(size=64),
                  "mobilenet_v2": lambda: model_zoo.mobilenet_v2(size=48),
                  "grouped": lambda: _grouped_convs()}


def _grouped_convs():
    """RegNet's grouped 3x3 convs (groups of 8 channels), stride 1 and 2: one group's GEMM is
    too small to split, so a batch of one divides its groups among threads."""
    g = model_zoo.GraphMaker(6)
    h = g.op("Relu", [g.conv("x", 64, 64, 3, group=8)])
    h = g.op("Relu", [g.conv(h, 64, 64, 3, stride=2, group=8)])
    return g.model({"x": [1, 64, 28, 28]}, [h])


def _batch_one_phases(kernel, bound: int) -> tuple[list, list]:
    """(plans of the phases guarded by a batch other than one, plans of those guarded by a
    batch of one) of a kernel, at the batch's bound."""
    from modelkiln.ir.loop import If, phases
    from modelkiln.ir.parallel import thread_plan
    guarded = [(part.cond.op, plan) for part, plan in zip(phases(kernel.body)[1], thread_plan(kernel, (bound,)))
               if isinstance(part, If)]
    return [p for op, p in guarded if op == "ne"], [p for op, p in guarded if op == "eq"]


@pytest.mark.parametrize("name", sorted(RUN_TIME_BATCH))
def test_a_run_time_batch_of_one_divides_its_convs_among_threads(name, executor):
    """Over a run-time batch, each conv's and pool's kernel holds two sets of phases guarded
    by the batch: the loop over images, and for a batch of one the copies and GEMMs as phases
    of their own, which threads divide as a static batch of one's (before, a call of one
    image ran every conv on one thread). The kernel tests each guard as the entry does, so a
    wrong choice would leave an output unwritten: every batch and thread count gives the same
    bytes and onnxruntime's answer."""
    from modelkiln.orchestrator.api import build
    model = RUN_TIME_BATCH[name]()
    x = model.graph.input[0]
    x.type.tensor_type.shape.dim[0].dim_param = "n"
    result = build(model, dims={"n": (1, 3)}, executor=executor, cache=None, progress=False)
    convs = [call for call in result.lowered.calls if {"Conv", "MaxPool"} & set(call.ops)]
    divided = 0
    for call in convs:
        images, one = _batch_one_phases(call.kernel, 3)
        assert len(images) == 1 and one, f"{name}: {call.name} has no phases for a batch of one"
        divided += any(plan[1] > 1 for plan in one)
        if name == "grouped":  # (the loop over groups is the divided phase)
            assert [plan[0] for plan in one if plan[1] > 1] == [8], (call.name, one)
    # (MobileNetV2's last, 3x3 maps keep some kernels whole, as a static batch of one does)
    assert divided == len(convs) if name == "resnet18" else divided >= len(convs) // 2, (divided, len(convs))
    image = [d.dim_value for d in x.type.tensor_type.shape.dim][1:]
    modules = {threads: result.load(threads=threads) for threads in THREAD_COUNTS}
    for n in (1, 2, 3):
        feeds = {x.name: np.random.default_rng(n).standard_normal([n] + image).astype(np.float32)}
        runs = {threads: module.run(feeds) for threads, module in modules.items()}
        want = model_zoo.onnxruntime_outputs(model, feeds)
        for key in want:
            for threads, got in runs.items():
                assert np.array_equal(got[key], runs[1][key]), f"{name}: {key} differs at {threads} threads, n={n}"
            np.testing.assert_allclose(runs[1][key], want[key], rtol=1e-4, atol=1e-5 * float(np.abs(want[key]).max()),
                                       err_msg=f"{key}, n={n}")


def test_rows_known_at_run_time_divide_by_row_blocks_or_by_panels(executor):
    """A MatMul over batch x seq rows known at run time against 96 weight columns (3 panels
    of 32 on AVX-512, 6 of 16 on AVX2): two guarded Gemm phases, divided by row blocks where
    the call has many rows and by panels where it has few (a decoding step's one row). Both
    run, at every thread count, giving the same bytes and numpy's product."""
    from modelkiln.ir.loop import Gemm, If, phases
    from modelkiln.orchestrator.api import build
    g = model_zoo.GraphMaker(2)
    w = g.weight((256, 96))
    y = g.op("MatMul", ["x", w])
    model = g.model({"x": ["batch", "seq", 256]}, [y])
    result = build(model, dims={"batch": (1, 2), "seq": (1, 100)}, executor=executor, cache=None, progress=False)
    [call] = result.lowered.calls
    guarded = [p for p in phases(call.kernel.body)[1] if isinstance(p, If) and isinstance(p.then[0], Gemm)]
    assert sorted(p.then[0].split for p in guarded) == ["m", "n"], call.kernel.body
    weights = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == w))
    modules = {threads: result.load(threads=threads) for threads in THREAD_COUNTS}
    for batch, seq in ((1, 1), (2, 3), (2, 100), (1, 57)):
        x = np.random.default_rng(seq).standard_normal((batch, seq, 256)).astype(np.float32)
        runs = {threads: module.run({"x": x})[y] for threads, module in modules.items()}
        for threads, got in runs.items():
            assert np.array_equal(got, runs[1]), f"{batch} x {seq} rows differ at {threads} threads"
        np.testing.assert_allclose(runs[1], x @ weights, rtol=1e-4, atol=1e-4)


def test_default_thread_count_is_the_usable_cores_or_the_environments(cnn_bundle):
    from modelkiln import load
    if "KILN_NUM_THREADS" not in os.environ:
        assert load(cnn_bundle).threads == len(os.sched_getaffinity(0))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = f"from modelkiln import load; print(load({cnn_bundle!r}).threads)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                          env={**os.environ, "KILN_NUM_THREADS": "3"}, timeout=60)
    assert proc.returncode == 0 and proc.stdout.split() == ["3"], proc.stderr


def test_the_library_default_can_be_set_and_reset(cnn_bundle):
    """kiln_set_num_threads (from C) replaces the default; 0 goes back to it."""
    code = ("import ctypes, os, sys; lib = ctypes.CDLL(os.path.join(sys.argv[1], 'model.so')); "
            "print(lib.kiln_num_threads(), lib.kiln_set_num_threads(3), lib.kiln_num_threads(), "
            "lib.kiln_set_num_threads(0))")
    env = {k: v for k, v in os.environ.items() if k != "KILN_NUM_THREADS"}
    proc = subprocess.run([sys.executable, "-c", code, cnn_bundle], capture_output=True, text=True, env=env,
                          timeout=60)
    cores = len(os.sched_getaffinity(0))
    assert proc.returncode == 0 and list(map(int, proc.stdout.split())) == [cores, 3, 3, cores], proc.stderr


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_a_bad_thread_count_is_refused(cnn_bundle, bad):
    from modelkiln import load
    from modelkiln.artifacts.errors import KilnError
    with pytest.raises(KilnError, match="threads must be a positive integer"):
        load(cnn_bundle, threads=bad)


_CHILD = r"""
import os, sys, time
import numpy as np
sys.path.insert(0, sys.argv[2])
from modelkiln import load
from tests import model_zoo

def live_threads():
    return len(os.listdir("/proc/self/task"))

module = load(sys.argv[1], threads=2)
x = model_zoo.random_inputs(model_zoo.resnet18(size=112), 0)
want = module.run(x)["logits"]
# After a fork the child has no pool workers; its runs start its own and still agree.
pid = os.fork()
if pid == 0:
    ok = np.array_equal(module.run(x)["logits"], want) and np.array_equal(module.run(x)["logits"], want)
    os._exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
# Past the spin, workers sleep: the next run wakes them.
time.sleep(0.1)
woken = np.array_equal(module.run(x)["logits"], want)
busy = live_threads()
# Idle workers exit after a second; the next run starts them again.
time.sleep(2.5)
idle = live_threads()
again = np.array_equal(module.run(x)["logits"], want)
print(busy, idle, live_threads(), woken and again)
"""


def test_workers_wake_survive_fork_and_exit_when_idle(tmp_path, executor):
    """A forked child runs the module on a pool of its own; sleeping workers wake for the next
    run; idle ones exit after a second and come back on the next run. Every run gives the
    same bytes."""
    from modelkiln.orchestrator.api import build
    bundle = str(tmp_path / "resnet")
    build(model_zoo.resnet18(size=112), executor=executor, cache=None, progress=False).export(bundle)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", _CHILD, bundle, root], capture_output=True, text=True,
                          timeout=120, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    busy, idle, after, same = map(int, proc.stdout.replace("True", "1").replace("False", "0").split())
    assert idle == busy - 1 and after == busy, (busy, idle, after)  # (threads=2: one worker)
    assert same == 1


def test_cli_runs_on_the_threads_asked_for(cnn_bundle):
    r = kiln("bench", cnn_bundle, "--threads", "3", "--repeat", "3", "--warmup", "1")
    assert r.returncode == 0, r.stderr
    assert "3 threads" in r.stdout
    bad = kiln("run", cnn_bundle, "--threads", "0")
    assert bad.returncode != 0 and "positive integer" in bad.stderr
