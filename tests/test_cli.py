"""The README's commands, run the way a user runs them."""
import json
import os

import numpy as np
import onnx

from tests import model_zoo
from tests.test_bad_input import kiln
from tests.conftest import shared_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_build_run_bench_on_the_bundled_example(tmp_path):
    example = os.path.join(ROOT, "configs", "examples", "cnn.onnx")
    out = tmp_path / "cnn"
    r = kiln("build", example, "-o", str(out), "--report", str(tmp_path / "report.json"),
             "--cache", str(tmp_path / "store"))
    assert r.returncode == 0, r.stderr
    assert {"model.so", "manifest.json", "weights.bin"} <= set(os.listdir(out))
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["totals"]["compiled"] == report["totals"]["kernels"] > 0
    assert {"name", "key", "ops", "cache_hit", "worker", "attempts", "compile_ms"} <= set(report["kernels"][0])

    x = np.random.default_rng(0).standard_normal((1, 3, 32, 32)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=x)
    r = kiln("run", str(out), "--inputs", str(tmp_path / "in.npz"), "--outputs", str(tmp_path / "out.npz"))
    assert r.returncode == 0, r.stderr
    want = model_zoo.onnxruntime_outputs(onnx.load(example), {"x": x})["logits"]
    with np.load(tmp_path / "out.npz") as got:
        np.testing.assert_allclose(got["logits"], want, rtol=1e-3, atol=1e-4)

    r = kiln("bench", str(out), "--warmup", "1", "--repeat", "5")
    assert r.returncode == 0 and "median" in r.stdout

    # a second build of the unchanged model compiles nothing
    r = kiln("build", example, "-o", str(out), "--report", str(tmp_path / "report2.json"),
             "--cache", str(tmp_path / "store"))
    again = json.loads((tmp_path / "report2.json").read_text())["totals"]
    assert again["compiled"] == 0 and again["cached"] == again["kernels"]


def test_explain_lists_passes_kernels_and_key_parts(tmp_path):
    example = os.path.join(ROOT, "configs", "examples", "cnn.onnx")
    r = kiln("explain", example, "--no-cache")
    assert r.returncode == 0, r.stderr
    for expected in ("fuse_ops", "fused_conv_relu", "llvm_options", "kiln_codegen", "opt_level"):
        assert expected in r.stdout


def test_targets_lists_presets():
    r = kiln("targets")
    assert r.returncode == 0 and all(p in r.stdout for p in ("host", "x86-64-v3", "cascadelake", "aarch64"))


def test_bench_profile_times_every_kernel(tmp_path):
    example = os.path.join(ROOT, "configs", "examples", "cnn.onnx")
    assert kiln("build", example, "-o", str(tmp_path / "b"), "--no-cache", "--quiet").returncode == 0
    r = kiln("bench", str(tmp_path / "b"), "--repeat", "5", "--warmup", "1", "--profile")
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if line.strip().endswith(")") and " ms " in line]
    assert len(lines) == 6 and any("fused_conv_relu" in line for line in lines)


def test_progress_line_counts_compiled_cached_failed():
    import io

    from modelkiln.orchestrator.progress import Progress
    out = io.StringIO()
    bar = Progress(5, 2, enabled=True, stream=out)
    bar.update(cached=2)
    bar.update(compiled=1)
    bar.update(failed=1)
    bar.close()
    last = out.getvalue().strip().split("\r")[-1]
    assert "4/5 kernels: 1 compiled, 2 cached, 1 failed | 2 workers" in last
    quiet = io.StringIO()  # not a terminal: nothing at all
    Progress(5, 2, stream=quiet).update(compiled=1)
    assert quiet.getvalue() == ""


def test_loading_needs_numpy_and_ctypes_only(tmp_path):
    """A bundle loads and runs without llvmlite or onnx in the process: no JIT at load time."""
    import subprocess
    import sys
    example = os.path.join(ROOT, "configs", "examples", "cnn.onnx")
    assert kiln("build", example, "-o", str(tmp_path / "b"), "--no-cache", "--quiet").returncode == 0
    code = ("import sys, numpy as np\nfrom modelkiln import artifacts\n"
            f"m = artifacts.load({str(tmp_path / 'b')!r})\n"
            "out = m.run({'x': np.zeros((1, 3, 32, 32), np.float32)})\n"
            "assert out['logits'].shape == (1, 10)\n"
            "bad = [k for k in ('llvmlite', 'onnx', 'modelkiln.orchestrator', 'modelkiln.codegen_worker', 'modelkiln.ir') if k in sys.modules]\n"
            "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr


def test_declared_output_shape_is_not_trusted(executor):
    """A model that declares a wrong output shape gets the inferred one, with onnxruntime's
    values (the oracle runs the same model without the wrong declaration, which it rejects)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    from modelkiln.orchestrator.api import build
    from tests import model_zoo
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [7, 7, 7])  # wrong on purpose
    wrong = helper.make_model(helper.make_graph([helper.make_node("Transpose", ["x"], ["y"], perm=[1, 0])], "g",
                                                [x], [y]), opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    clean = onnx.ModelProto()
    clean.CopyFrom(wrong)
    clean.graph.output[0].type.tensor_type.shape.Clear()
    module = build(wrong, executor=executor, cache=shared_cache()).load()
    assert module.outputs[0]["shape"] == [3, 2]
    inputs = model_zoo.random_inputs(clean)
    np.testing.assert_array_equal(module.run(inputs)["y"], model_zoo.onnxruntime_outputs(clean, inputs)["y"])


def test_a_build_served_whole_from_the_store_starts_no_executor(tmp_path, monkeypatch):
    """`--executor ray` on an unchanged model: nothing to compile, so Ray is never started."""
    from modelkiln.orchestrator import cli, executor_ray
    example = os.path.join(ROOT, "configs", "examples", "cnn.onnx")
    store = str(tmp_path / "store")
    assert cli.main(["build", example, "-o", str(tmp_path / "a"), "--cache", store, "--quiet"]) == 0

    def no_ray(*args, **kwargs):
        raise AssertionError("an executor was started for a build that compiles nothing")
    monkeypatch.setattr(executor_ray.RayExecutor, "__init__", no_ray)
    for command in (["build", example, "-o", str(tmp_path / "b")], ["build-many", example, "-o", str(tmp_path / "c")]):
        report = tmp_path / "report.json"
        assert cli.main([*command, "--cache", store, "--executor", "ray", "--report", str(report), "--quiet"]) == 0
        assert json.loads(report.read_text())["totals"]["compiled"] == 0


def test_output_over_the_store_or_a_users_folder_is_refused(tmp_path):
    """-o replaces a previous bundle, never something else: pointing it at the cache store
    (or any non-empty folder that is not a bundle, or a file) is an error, and nothing there
    is touched."""
    example = os.path.join(ROOT, "configs", "examples", "cnn.onnx")
    store = tmp_path / "store"
    assert kiln("build", example, "-o", str(tmp_path / "cnn"), "--cache", str(store)).returncode == 0
    before = sorted(str(p.relative_to(store)) for p in store.rglob("*"))
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine")
    for target in (store, notes, notes / "todo.txt"):
        r = kiln("build", example, "-o", str(target), "--cache", str(store))
        assert r.returncode != 0 and str(target) in r.stderr and "Traceback" not in r.stderr
    assert sorted(str(p.relative_to(store)) for p in store.rglob("*")) == before
    assert (notes / "todo.txt").read_text() == "mine"
    # a previous bundle and an empty folder are replaced as before
    (tmp_path / "empty").mkdir()
    for target in (tmp_path / "cnn", tmp_path / "empty"):
        assert kiln("build", example, "-o", str(target), "--cache", str(store)).returncode == 0
        assert (target / "manifest.json").is_file()


def test_run_takes_and_gives_the_types_npz_keeps_as_raw_bytes(tmp_path):
    """bfloat16 and int4 have no npz dtype: numpy.load gives them back as raw bytes (|V2, |V1).
    `kiln run` reads such an input as its declared type, and its --outputs file maps each
    array to its type (kiln_dtypes), so a numpy user can view them with ml_dtypes; the values
    are onnx's reference evaluator's."""
    import ml_dtypes
    from onnx import TensorProto, helper
    from onnx.reference import ReferenceEvaluator
    nodes = [helper.make_node("Cast", ["x"], ["f"], to=TensorProto.FLOAT),
             helper.make_node("Cast", ["f"], ["q"], to=TensorProto.INT4),
             helper.make_node("Cast", ["f"], ["b"], to=TensorProto.BFLOAT16)]
    graph = helper.make_graph(nodes, "narrow", [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [2, 5])],
                              [helper.make_tensor_value_info("q", TensorProto.INT4, [2, 5]),
                               helper.make_tensor_value_info("b", TensorProto.BFLOAT16, [2, 5])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 25)], ir_version=11)
    onnx.save(model, tmp_path / "narrow.onnx")
    assert kiln("build", str(tmp_path / "narrow.onnx"), "-o", str(tmp_path / "b"), "--no-cache").returncode == 0
    x = np.array([[-8, -3.5, 0, 1.25, 7], [2, -1, 3.75, -6.5, 5]], dtype=ml_dtypes.bfloat16)
    np.savez(tmp_path / "in.npz", x=x)
    with np.load(tmp_path / "in.npz") as saved:
        assert saved["x"].dtype.kind == "V"  # what the CLI is handed
    r = kiln("run", str(tmp_path / "b"), "--inputs", str(tmp_path / "in.npz"), "--outputs", str(tmp_path / "out.npz"))
    assert r.returncode == 0, r.stderr
    want = dict(zip(["q", "b"], ReferenceEvaluator(model).run(None, {"x": x})))
    with np.load(tmp_path / "out.npz") as got:
        dtypes = json.loads(str(got["kiln_dtypes"]))
        assert dtypes == {"q": "int4", "b": "bfloat16"}
        for name in ("q", "b"):
            value = got[name].view(getattr(ml_dtypes, dtypes[name]))
            np.testing.assert_array_equal(value.astype(np.float32), want[name].astype(np.float32))
