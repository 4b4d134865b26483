"""A bundle runs from C without Python: docs/example_run.c, compiled with `cc` against the
bundle's kiln_model.h and model.so, reads raw inputs and writes raw outputs, checked here
against onnxruntime."""
import os
import subprocess

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from modelkiln.artifacts.link import find_cc
from modelkiln.orchestrator.api import build
from tests import model_zoo
from tests.conftest import ROOT

EXAMPLE = os.path.join(ROOT, "docs", "example_run.c")


def _compile(bundle: str, out: str, cc: str | None = None) -> str:
    cmd = [cc or find_cc(), "-O2", "-std=c11", "-Wall", "-Werror", EXAMPLE, "-I", bundle,
           os.path.join(bundle, "model.so"), f"-Wl,-rpath,{bundle}", "-o", out]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return out


def _run_from_c(bundle: str, tmp_path, feeds: dict, outputs: list, threads: int | None = None, cc: str | None = None,
                launcher: tuple = (), sizes: tuple = ()) -> dict:
    """docs/example_run.c compiled with `cc` (default: this machine's) against the bundle and
    run (through `launcher`, e.g. qemu-user for another architecture) on `feeds`, a symbolic
    bundle at `sizes` (NAME=N arguments): the raw outputs as arrays of the given (name, dtype)."""
    program = _compile(bundle, str(tmp_path / "run_model"), cc)
    ins = []
    for name, value in feeds.items():
        ins.append(str(tmp_path / f"{name}.in"))
        np.ascontiguousarray(value).tofile(ins[-1])
    outs = [str(tmp_path / f"{i}.out") for i in range(len(outputs))]
    env = {**os.environ, "KILN_NUM_THREADS": str(threads)} if threads else None
    proc = subprocess.run([*launcher, program, bundle, *sizes, *ins, *outs], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    if threads:
        assert f"running on {threads} thread(s)" in proc.stdout
    return {name: np.fromfile(path, dtype) for (name, dtype), path in zip(outputs, outs)}


def test_the_example_program_runs_a_cnn_bundle(cnn_bundle, tmp_path):
    model = model_zoo.cnn()
    feeds = model_zoo.random_inputs(model, 3)
    got = _run_from_c(cnn_bundle, tmp_path, feeds, [("logits", np.float32)])
    want = model_zoo.onnxruntime_outputs(model, feeds)["logits"]
    np.testing.assert_allclose(got["logits"].reshape(want.shape), want, rtol=1e-3, atol=1e-4)


def test_the_thread_count_from_the_environment_changes_no_byte(cnn_bundle, tmp_path):
    feeds = model_zoo.random_inputs(model_zoo.cnn(), 4)
    one = _run_from_c(cnn_bundle, tmp_path, feeds, [("logits", np.float32)], threads=1)
    three = _run_from_c(cnn_bundle, tmp_path, feeds, [("logits", np.float32)], threads=3)
    assert np.array_equal(one["logits"], three["logits"])


def test_header_describes_several_inputs_and_outputs_of_other_types(tmp_path):
    """int64 and float inputs, a bool and an int32 output: the header's names, sizes and
    order are the library's."""
    nodes = [helper.make_node("Cast", ["ids"], ["idf"], to=TensorProto.FLOAT),
             helper.make_node("Add", ["idf", "x"], ["s"]),
             helper.make_node("Greater", ["s", "zero"], ["positive"]),
             helper.make_node("Cast", ["s"], ["rounded"], to=TensorProto.INT32)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 3]),
                                           helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("positive", TensorProto.BOOL, None),
                               helper.make_tensor_value_info("rounded", TensorProto.INT32, None)],
                              [numpy_helper.from_array(np.float32(0), "zero")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    bundle = build(model, executor="inprocess", cache=None, progress=False).export(str(tmp_path / "bundle"))
    header = open(os.path.join(bundle, "kiln_model.h")).read()
    assert '#define KILN_NUM_INPUTS 2' in header and 'kiln_output_names[2] = {"positive", "rounded"}' in header
    feeds = {"ids": np.array([[1, -5, 3], [0, 2, -1]], np.int64),
             "x": np.random.default_rng(4).standard_normal((2, 3)).astype(np.float32) * 3}
    got = _run_from_c(bundle, tmp_path, feeds, [("positive", np.bool_), ("rounded", np.int32)])
    want = model_zoo.onnxruntime_outputs(model, feeds)
    np.testing.assert_array_equal(got["positive"].reshape(2, 3), want["positive"])
    np.testing.assert_array_equal(got["rounded"].reshape(2, 3), want["rounded"])


def test_the_example_refuses_a_short_input_file(cnn_bundle, tmp_path):
    program = _compile(cnn_bundle, str(tmp_path / "run_model"))
    short = tmp_path / "x.in"
    np.zeros(10, np.float32).tofile(short)
    proc = subprocess.run([program, cnn_bundle, str(short), str(tmp_path / "y.out")], capture_output=True, text=True)
    assert proc.returncode == 1 and "input 'x'" in proc.stderr and "does not hold exactly" in proc.stderr


@pytest.mark.parametrize("damage", ["truncate", "extend"])
def test_the_header_loader_refuses_weights_of_another_size(cnn_bundle, tmp_path, damage):
    from tests.conftest import bundle_copy
    bundle = bundle_copy(cnn_bundle, tmp_path)
    weights = os.path.join(bundle, "weights.bin")
    data = open(weights, "rb").read()
    with open(weights, "wb") as f:
        f.write(data[:-4] if damage == "truncate" else data + b"\0")
    program = _compile(bundle, str(tmp_path / "run_model"))
    x = tmp_path / "x.in"
    model_zoo.random_inputs(model_zoo.cnn())["x"].tofile(x)
    proc = subprocess.run([program, bundle, str(x), str(tmp_path / "y.out")], capture_output=True, text=True)
    assert proc.returncode == 1 and "cannot load" in proc.stderr


def test_the_example_runs_a_symbolic_bundle_at_the_sizes_given(tmp_path, executor):
    """One bundle built with --dim batch=1..4 --dim seq=0..80, run from C at two sizes given
    as NAME=N: kiln_*_bytes_at sizes the buffers, kiln_run_dims runs them; a size out of
    bounds is refused before anything runs."""
    from tests.test_symbolic_dims import BOUNDS, feed_forward_block
    model = feed_forward_block(mask=True)
    bundle = str(tmp_path / "bundle")
    build(model, dims=BOUNDS, executor=executor, cache=None, progress=False).export(bundle)
    for batch, seq in ((1, 5), (3, 80)):
        rng = np.random.default_rng(seq)
        feeds = {"x": rng.standard_normal((batch, seq, 64)).astype(np.float32),
                 "m": np.ones((batch, seq, 1), np.float32)}
        got = _run_from_c(bundle, tmp_path, feeds, [("y", np.float32)], sizes=(f"batch={batch}", f"seq={seq}"))
        want = model_zoo.onnxruntime_outputs(model, feeds)["y"]
        np.testing.assert_allclose(got["y"].reshape(want.shape), want, rtol=1e-5, atol=1e-6)
    proc = subprocess.run([str(tmp_path / "run_model"), bundle, "batch=9", "seq=5", "a", "b", "c"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "batch=9: the bundle runs batch = 1..4" in proc.stderr


def test_a_c_caller_passes_only_the_sizes_it_knows(tmp_path, executor):
    """A CNN over any image size: the output's height is a symbol derived from the input's
    (ceil(h / 2) after a stride-2 conv). The caller passes batch, height and width alone;
    kiln_output_bytes_at and kiln_run_dims compute the rest."""
    from tests import dynamic_zoo
    model = dynamic_zoo.cnn_dynamic_image()
    bundle = str(tmp_path / "bundle")
    build(model, dims={"batch": (1, 2), "height": (6, 40), "width": (6, 40)}, executor=executor, cache=None,
          progress=False).export(bundle)
    for shape in ((1, 3, 7, 19), (2, 3, 40, 33)):
        feeds = {"images": np.random.default_rng(shape[2]).standard_normal(shape).astype(np.float32)}
        got = _run_from_c(bundle, tmp_path, feeds, [("features", np.float32), ("logits", np.float32)],
                          sizes=(f"batch={shape[0]}", f"height={shape[2]}", f"width={shape[3]}"))
        want = model_zoo.onnxruntime_outputs(model, feeds)
        for name in ("features", "logits"):
            assert got[name].size == want[name].size, name
            np.testing.assert_allclose(got[name].reshape(want[name].shape), want[name], rtol=1e-4, atol=1e-5)


def test_a_symbolic_bundle_refuses_sizes_that_must_agree_from_c(tmp_path, executor):
    """kiln_run_dims checks the sizes the model needs equal (here x [n, m] + y [n, k]) and
    the bounds before running anything: 3 and 2, not a read past a buffer."""
    graph = helper.make_graph([helper.make_node("Add", ["x", "y"], ["z"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", "m"]),
                               helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", "k"])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    bundle = str(tmp_path / "bundle")
    build(model, dims={"n": (1, 4), "m": (1, 8), "k": (1, 8)}, executor=executor, cache=None,
          progress=False).export(bundle)
    program = _compile(bundle, str(tmp_path / "run_model"))
    x, y = (np.ones((2, m), np.float32) for m in (3, 5))
    x.tofile(tmp_path / "x.in")
    y.tofile(tmp_path / "y.in")
    proc = subprocess.run([program, bundle, "k=5", "m=3", "n=2", str(tmp_path / "x.in"), str(tmp_path / "y.in"),
                           str(tmp_path / "z.out")], capture_output=True, text=True)
    assert proc.returncode == 1 and "kiln_run returned 3" in proc.stderr


def test_a_c_caller_learns_the_sizes_a_model_counts(tmp_path, executor):
    """A model whose output length depends on the data (NonMaxSuppression, then the boxes it
    keeps): outputs allocated at their greatest, the counts read back from dims[]."""
    from tests.test_counted_sizes import _boxes
    most = numpy_helper.from_array(np.array([3], np.int64), "most")
    iou = numpy_helper.from_array(np.array([0.3], np.float32), "iou")
    floor = numpy_helper.from_array(np.array([0.8], np.float32), "floor")
    nodes = [helper.make_node("NonMaxSuppression", ["boxes", "scores", "most", "iou", "floor"], ["selected"]),
             helper.make_node("Gather", ["selected", "two"], ["which"], axis=1),
             helper.make_node("Gather", ["boxes", "which"], ["kept"], axis=1)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("boxes", TensorProto.FLOAT, [1, 20, 4]),
                                           helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, 2, 20])],
                              [helper.make_tensor_value_info("selected", TensorProto.INT64, None),
                               helper.make_tensor_value_info("kept", TensorProto.FLOAT, None)],
                              [most, iou, floor, numpy_helper.from_array(np.array(2, np.int64), "two")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    bundle = str(tmp_path / "bundle")
    build(model, executor=executor, cache=None, progress=False).export(bundle)
    rng = np.random.default_rng(3)
    feeds = {"boxes": _boxes(rng, (1, 20), False), "scores": rng.random((1, 2, 20)).astype(np.float32)}
    got = _run_from_c(bundle, tmp_path, feeds, [("selected", np.int64), ("kept", np.float32)])
    want = model_zoo.onnxruntime_outputs(model, feeds)
    assert 0 < want["selected"].shape[0] < 6  # (fewer rows than the greatest)
    np.testing.assert_array_equal(got["selected"], want["selected"].reshape(-1))
    np.testing.assert_array_equal(got["kept"], want["kept"].reshape(-1))


def test_a_c_caller_allocates_sizes_computed_from_a_count_at_their_greatest(tmp_path, executor):
    """Outputs min(n, 5) and 5 - min(n, 5) long (the first five of a selection, and the filler
    padding them to five): kiln_output_bytes_at allocates each at its greatest, 5 elements,
    though the second shrinks as the count grows; kiln_output_bytes_after gives what a call
    wrote."""
    from tests.test_counted_sizes import first_five_padded
    nodes, consts = first_five_padded(7.0)
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [12]),
                                           helper.make_tensor_value_info("keep", TensorProto.BOOL, [12])],
                              [helper.make_tensor_value_info("top", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("filler", TensorProto.FLOAT, None)], consts)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    bundle = str(tmp_path / "bundle")
    build(model, executor=executor, cache=None, progress=False).export(bundle)
    with open(os.path.join(bundle, "kiln_model.h")) as f:
        assert "kiln_output_bytes[2] = {20, 20}" in f.read()
    rng = np.random.default_rng(8)
    for keep in (0.0, 0.2, 1.0):
        feeds = {"x": rng.standard_normal(12).astype(np.float32), "keep": rng.random(12) < keep}
        got = _run_from_c(bundle, tmp_path, feeds, [("top", np.float32), ("filler", np.float32)])
        want = model_zoo.onnxruntime_outputs(model, feeds)
        for name in ("top", "filler"):
            np.testing.assert_array_equal(got[name], want[name])
