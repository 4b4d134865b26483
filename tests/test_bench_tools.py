"""bench/compare_commits.py: two revisions' builds of one model, timed in one process; what
bench/bench_models.py says it measured; bench/bench_convs.py's layers and paths; the cluster
replay of bench/bench_scale.py (bench/scale_sim.py) against schedules worked out by hand."""
import os
import subprocess
import sys

import numpy as np
import pytest

from bench.compare_commits import ROOT, WORKING_TREE, compare


def _worktrees() -> list:
    out = subprocess.run(["git", "-C", ROOT, "worktree", "list", "--porcelain"], capture_output=True, text=True,
                         check=True).stdout
    return [line for line in out.splitlines() if line.startswith("worktree ")]


# Tests that add git worktrees run in one test process, one after another: each compares the
# repository's worktree list before and after, which another's worktree would change.
WORKTREES = pytest.mark.xdist_group("git-worktrees")


@WORKTREES
@pytest.mark.parametrize("model", ["mlp_b1", "few_32_16_14"])  # (a bench model; a bench_convs layer)
def test_compare_commits_builds_each_revision_and_removes_its_worktree(model, monkeypatch):
    from bench import compare_commits
    added, checkout = [], compare_commits._checkout

    def recorded(rev, where):
        source = checkout(rev, where)
        added.append(source)
        return source
    monkeypatch.setattr(compare_commits, "_checkout", recorded)
    found = compare(model, ["HEAD", WORKING_TREE], rounds=2, repeat=5, threads=1)
    assert list(found) == ["HEAD", WORKING_TREE]
    for median, best, kernel_sum, kernels in found.values():
        assert 0 < best <= median and kernel_sum == sum(kernels) > 0
    # The same model and, in a clean checkout, the same code: the same kernels either way.
    assert len(found["HEAD"][3]) == len(found[WORKING_TREE][3])
    # (its own worktree, by path: a CI run from a fresh clone once listed another one here)
    assert len(added) == 2 and added[1] == ROOT and os.path.isdir(ROOT)
    assert f"worktree {added[0]}" not in _worktrees() and not os.path.exists(added[0])


@WORKTREES
@pytest.mark.slow
def test_compare_commits_builds_symbolic_dims_and_runs_at_the_sizes_asked(tmp_path):
    """--dim leaves a dim symbolic in both revisions' builds (each revision's own Kiln takes
    the bounds) and --at runs them at that size: here a batch of 3 of a MatMul built for 1..4."""
    from onnx import TensorProto, helper, numpy_helper
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])], [w])
    path = str(tmp_path / "batched.onnx")
    with open(path, "wb") as f:
        f.write(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString())
    found = compare(path, ["HEAD", WORKING_TREE], rounds=1, repeat=3, threads=1, dims={"n": (1, 4)}, at={"n": 3})
    for median, best, kernel_sum, kernels in found.values():
        assert 0 < best <= median and kernel_sum == sum(kernels) > 0
    from modelkiln.artifacts.errors import KilnError
    with pytest.raises(KilnError, match="outside the bounds"):  # (the size asked for is the size run)
        compare(path, ["HEAD", WORKING_TREE], rounds=1, repeat=3, threads=1, dims={"n": (1, 4)}, at={"n": 5})
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "compare_commits.py"), path, "HEAD", WORKING_TREE,
                        "--rounds", "1", "--repeat", "3", "--dim", "n=1..4", "--at", "n=3"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "1 thread(s), n=3 |" in r.stdout


@pytest.mark.parametrize("isa", ["host", "avx2"])
def test_bench_models_names_the_isa_each_runner_ran(isa):
    """The bench's header says which vector ISA the host has and which code Kiln, onnxruntime
    and OpenVINO ran; `--isa avx2` builds Kiln for x86-64-v3 and rates it against OpenVINO
    alone (held to AVX2; onnxruntime cannot be)."""
    from modelkiln.artifacts.cpu_features import host_flags
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_models.py"), "--models", "mlp_b1",
                        "--rounds", "1", "--repeat", "2", "--warmup", "1", "--no-gemm", "--isa", isa],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    host = "AVX-512" if "avx512f" in host_flags() else "AVX2"
    assert f"({host}" in r.stdout and "| mlp_b1 |" in r.stdout
    if isa == "avx2":
        assert "Kiln x86-64-v3 (8 float32 lanes)" in r.stdout and "Ratios: Kiln over OpenVINO" in r.stdout
    else:
        assert "Ratios: Kiln over the best of onnxruntime and OpenVINO" in r.stdout


@pytest.mark.slow
def test_bench_convs_checks_each_layer_and_names_the_path_it_took():
    """A 13-wide SqueezeNet layer takes Winograd's 4x4 tiles, FCN's dilated 3x3 reads its input in place
    (AVX-512: tiles within its rows), ResNet-50's 2048-channel downsample at 7 wide keeps
    im2col; all checked against onnxruntime before they are timed; for each x86 width this
    host runs."""
    from tests.isa import AVX512, X86_TARGETS, host_runs
    layers = ("sq_48_192_13", "r50_1024_2048_14_1x1_s2", "fcn_256_256_28_d2")
    for target in [t for t in X86_TARGETS if host_runs(t)]:
        r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_convs.py"), "--rounds", "1",
                            "--layers", ",".join(layers), "--target", target], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        rows = (line.split("|") for line in r.stdout.splitlines())
        paths = {cells[1].strip(): cells[2].strip() for cells in rows if len(cells) > 2 and cells[1].strip() in layers}
        in_place = "implicit, rows" if target == AVX512 else "implicit"
        assert paths == {"sq_48_192_13": "winograd4", "r50_1024_2048_14_1x1_s2": "im2col",
                         "fcn_256_256_28_d2": in_place}, r.stdout
        assert "Geometric mean of kiln / onnxruntime over 3 layers" in r.stdout


def test_a_peer_that_crashes_on_a_model_reads_na_instead_of_ending_the_bench(monkeypatch, tmp_path, capsys):
    """OpenVINO held to AVX2 dies of SIGSEGV on wav2vec2's feature encoder: the bench runs
    each model once through it in a child process first, and a child that dies (here: one
    that kills itself the same way) leaves that peer's column n/a, with the reason said."""
    from bench import bench_models
    inputs = {"x": np.zeros((2, 3), np.float32)}
    monkeypatch.setattr(bench_models, "_OPENVINO_PROBE", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    assert not bench_models._openvino_survives("model.onnx", 2, inputs, str(tmp_path))
    assert "signal 11" in capsys.readouterr().err
    monkeypatch.setattr(bench_models, "_OPENVINO_PROBE", "import sys, numpy as np; "
                                                         "assert np.load(sys.argv[2])['x'].shape == (2, 3)")
    assert bench_models._openvino_survives("model.onnx", 2, inputs, str(tmp_path))


def test_bench_exported_matches_a_detectors_rows_by_their_boxes():
    """Two detections whose scores differ in the 6th digit may come out in either order:
    matched by their boxes they agree; a box that moved, or a label that differs, still fails,
    and where some boxes disagree the note counts those that agree."""
    from bench.bench_exported import worst_difference
    boxes = np.array([[0, 0, 4, 4], [1, 2, 3, 5], [2, 2, 9, 9]], np.float32)
    labels = np.array([3, 7, 7], np.int64)
    swapped = {"boxes": boxes[[0, 2, 1]], "labels": labels[[0, 2, 1]]}
    assert worst_difference(swapped, [boxes, labels], ["boxes", "labels"]) == (6 / 9, "")  # (row by row)
    assert worst_difference(swapped, [boxes, labels], ["boxes", "labels"], detections=True) == (0.0, "")
    moved = {"boxes": swapped["boxes"] + np.float32(0.5), "labels": swapped["labels"]}
    assert worst_difference(moved, [boxes, labels], ["boxes", "labels"], detections=True)[0] == 0.5 / 9
    one_moved = {"boxes": boxes + np.array([[0], [0], [0.5]], np.float32), "labels": labels}
    assert worst_difference(one_moved, [boxes, labels], ["boxes", "labels"], detections=True) == \
        (0.5 / 9, "2 of 3 detections agree, within 0.0e+00 there")
    relabeled = {"boxes": swapped["boxes"], "labels": np.array([3, 7, 8], np.int64)}
    assert worst_difference(relabeled, [boxes, labels], ["boxes", "labels"], detections=True)[0] == np.inf


def test_the_batch_replay_matches_schedules_worked_out_by_hand():
    from bench.scale_sim import Batch, simulate
    one = Batch([0], {0: 1.0}, {0: 1.0}, {0: [("a", 1.0), ("b", 1.0), ("c", 1.0), ("d", 1.0)]})
    # plan 1 s, four 1 s jobs two at a time, link 1 s
    assert simulate(one, 2, hosts=1) == pytest.approx(4, abs=0.01)
    assert simulate(one, 2, hosts="workers") == pytest.approx(4, abs=0.01)
    # one core shared by the two workers: the jobs take twice as long
    assert simulate(one, 2, hosts=1, cores=1) == pytest.approx(6, abs=0.01)
    # one worker, 0.1 s of the driver's before each task: the jobs start 1.2, 2.2, 3.2, 4.2 s
    # (each waits for the worker, not the driver); the link 5.2 + 0.1 + 1
    assert simulate(one, 1, hosts="driver", dispatch_s=0.1) == pytest.approx(6.3, abs=0.01)
    # model 1 calls "c" twice (a repeated block): one job, one link
    two = Batch([0, 1], {0: 1.0, 1: 2.0}, {0: 0.5, 1: 0.5},
                {0: [("a", 1.0), ("b", 1.0)], 1: [("a", 1.0), ("c", 3.0), ("c", 3.0)]})
    # both plans at once; "a" compiles once, for model 0; model 1 waits only for "c" (2 -> 5)
    assert simulate(two, 2, hosts=2) == pytest.approx(5.5, abs=0.01)
    # the driver plans both, sending model 0's jobs before it plans model 1 (1 -> 3): "a"
    # 1 -> 2, "b" 2 -> 3, "c" 3 -> 6; link 0 at 3, link 1 at 6
    assert simulate(two, 1, hosts="driver") == pytest.approx(6.5, abs=0.01)
