"""Kiln against Kiln: one model's module built by two commits, timed in one process.

    python bench/compare_commits.py MODEL [REV_A] [REV_B] [--rounds 7] [--repeat 100] [--threads 1]
                                   [--target x86-64-v3] [--precision bf16]
                                   [--dim height=32..640 --at height=224 ...]

MODEL is one of bench_models.py's models, one of bench_convs.py's single conv layers, or an
.onnx file (run on random inputs).

This machine's speed drifts by 10-30% within an hour, so two runs of bench_models.py an
hour apart cannot tell a 5% kernel change from noise. Here each revision (default: HEAD~1
and the working tree) is checked out into a temporary git worktree, the same ONNX file
(written once, by this checkout's bench models) is built by each in a subprocess that
imports that worktree's Kiln, and both modules are loaded here and timed in interleaved
rounds (`--target` builds for another target than the host's, e.g. AVX2 code on an
AVX-512 host; `--dim NAME=LO..HI` builds with that dim symbolic, as `kiln build --dim` does,
and `--at NAME=V` runs it at that size, else at its greatest; for an integer input bounded
by `--dim` and read as a value, such as a loop's max_len, `--at` gives its value, else its
least). Prints each revision's median over rounds, its best round, its kernel sum
(`Module.profile`, best of rounds per kernel), and the kernels that moved by more than 8%.
Small memory-bound kernels move with the load order alone: ResNet-18's last Gemm (a 1x512 by
512x1000 product, 2 MB of weights) took 0.07 ms in the first module and 0.10 in the second
with both built by the same commit.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import onnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_convs import LAYERS, conv_layer  # noqa: E402
from bench.bench_models import MODELS, median_ms  # noqa: E402
from modelkiln.artifacts import load  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKING_TREE = "worktree"


def _checkout(rev: str, where: str) -> str:
    """A folder holding `rev`'s sources: the working tree itself, or a detached worktree."""
    if rev == WORKING_TREE:
        return ROOT
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", "-q", where, rev], check=True)
    return where


def _build(source: str, model_path: str, out: str, target: str, dims: dict | None = None,
           precision: str = "fp32") -> None:
    """Build with the Kiln in `source` (its folder first on the path, for the zygote too),
    refusing to go on if the subprocess imported another Kiln (an installed copy). `dims`:
    {name: (least, greatest)} of the dims left symbolic."""
    env = dict(os.environ, PYTHONPATH=source + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = ("import json, sys, modelkiln; from modelkiln.orchestrator.api import build; "
            "dims = {k: tuple(v) for k, v in json.loads(sys.argv[4]).items()} or None; "
            "extra = {'precision': sys.argv[5]} if sys.argv[5] != 'fp32' else {}; "
            "build(sys.argv[1], target=sys.argv[3], dims=dims, cache=None, progress=False, **extra)"
            ".export(sys.argv[2]); "
            "print(modelkiln.IMPORT_ROOT)")
    done = subprocess.run([sys.executable, "-c", code, model_path, out, target, json.dumps(dims or {}), precision],
                          check=True, env=env, cwd=source, capture_output=True, text=True)
    imported = done.stdout.strip().splitlines()[-1]
    if os.path.realpath(imported) != os.path.realpath(source):
        raise RuntimeError(f"the build for {source} imported Kiln from {imported}")


def _model_and_inputs(name: str) -> tuple:
    if name in MODELS:
        return MODELS[name]()
    if name in LAYERS:
        return conv_layer(*LAYERS[name])
    if name.endswith(".onnx") and os.path.isfile(name):
        model = onnx.load(name)
        return model, None  # (the first module's random inputs of its declared types: integer inputs too)
    raise SystemExit(f"{name}: neither a model of bench_models.py, a layer of bench_convs.py nor an .onnx file")


def _remove_worktree(where: str) -> None:
    """Unregister and delete a worktree compare() added; where git cannot, say why, delete the
    folder here and let `git worktree prune` drop the entry."""
    r = subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", where], capture_output=True, text=True)
    if r.returncode != 0:
        sys.stderr.write(f"compare_commits: git worktree remove {where}: {r.stderr.strip()}\n")
        shutil.rmtree(where, ignore_errors=True)
        subprocess.run(["git", "-C", ROOT, "worktree", "prune"], check=False)


def compare(model_name: str, revs: list, rounds: int, repeat: int, threads: int, target: str = "llvm",
            dims: dict | None = None, at: dict | None = None, precision: str = "fp32") -> dict:
    """{rev: (median over rounds, best round, kernel sum, per-kernel ms)} for each revision;
    with `dims` ({name: (least, greatest)}) built symbolic, run at the sizes `at` gives."""
    model, inputs = _model_and_inputs(model_name)
    with tempfile.TemporaryDirectory(prefix="kiln-compare-") as tmp:
        model_path = os.path.join(tmp, "model.onnx")
        with open(model_path, "wb") as f:
            f.write(model.SerializeToString())
        modules, worktrees = {}, []
        try:
            for i, rev in enumerate(revs):
                source = _checkout(rev, os.path.join(tmp, f"src{i}"))
                if source != ROOT:
                    worktrees.append(source)
                _build(source, model_path, os.path.join(tmp, f"bundle{i}"), target, dims, precision)
                modules[rev] = load(os.path.join(tmp, f"bundle{i}"), threads=threads)
                if dims or inputs is None:  # (the inputs at the sizes asked for, or of an .onnx file's types)
                    inputs = modules[rev].random_inputs(dims=at)
        finally:
            for w in worktrees:
                _remove_worktree(w)
        medians = {rev: [] for rev in revs}
        kernels = {rev: None for rev in revs}
        for _ in range(rounds):
            for rev, m in modules.items():
                medians[rev].append(median_ms(lambda m=m: m.run(inputs), 10, repeat))
                ms = [k["ms"] for k in m.profile(inputs, repeat=20)]
                kernels[rev] = ms if kernels[rev] is None else [min(a, b) for a, b in zip(kernels[rev], ms)]
        return {rev: (float(np.median(medians[rev])), min(medians[rev]), sum(kernels[rev]), kernels[rev])
                for rev in revs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a model of bench_models.py, a layer of bench_convs.py, or an .onnx file")
    ap.add_argument("rev_a", nargs="?", default="HEAD~1")
    ap.add_argument("rev_b", nargs="?", default=WORKING_TREE, help=f"a git revision, or '{WORKING_TREE}'")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--repeat", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--target", default="llvm", help="what to build for (default: this host)")
    ap.add_argument("--precision", default="fp32", help="the builds' precision (fp32, bf16)")
    ap.add_argument("--dim", action="append", default=[], metavar="NAME=LO..HI",
                    help="leave the input dim NAME symbolic over LO..HI (repeatable)")
    ap.add_argument("--at", action="append", default=[], metavar="NAME=V",
                    help="run a symbolic build with NAME = V (default: its greatest; repeatable)")
    args = ap.parse_args()
    dims = {name: tuple(int(v) for v in bounds.split("..")) for name, bounds in (d.split("=") for d in args.dim)}
    at = {name: int(v) for name, v in (a.split("=") for a in args.at)}
    found = compare(args.model, [args.rev_a, args.rev_b], args.rounds, args.repeat, args.threads, args.target,
                    dims, at, args.precision)
    sizes = "".join(f", {k}={v}" for k, v in at.items())
    print(f"| {args.model}, {args.target}, {args.precision}, {args.threads} thread(s){sizes} | median of rounds (ms) "
          "| best round (ms) | kernel sum (ms) |")
    print("|---|---:|---:|---:|")
    for rev, (median, best, kernel_sum, _) in found.items():
        print(f"| {rev} | {median:.4f} | {best:.4f} | {kernel_sum:.4f} |")
    (_, _, _, a), (_, _, _, b) = found.values()
    if len(a) != len(b):
        print(f"\nThe revisions lower to {len(a)} and {len(b)} kernels: per-kernel times are not paired.")
        return
    for i, (x, y) in enumerate(zip(a, b)):
        if abs(y - x) > 0.003 and abs(y - x) > 0.08 * x:
            print(f"kernel {i}: {x:.4f} -> {y:.4f} ms")


if __name__ == "__main__":
    main()
