"""A peer compiler's build of an ONNX model, as a build script would run it: run by
bench/bench_scale.py with the peer's own Python, in a new process each time (its import
counts, as Kiln's does). Imports nothing of Kiln's.

    /path/to/tvm-venv/bin/python bench/peer_builds.py tvm MODEL.onnx OUT.so --mcpu CPU

TVM (apache-tvm, Relax): from_onnx, tvm.compile for the host's CPU, export_library.
"""
from __future__ import annotations

import argparse


def tvm_build(model: str, out: str, mcpu: str) -> None:
    import onnx
    import tvm
    from tvm.relax.frontend.onnx import from_onnx
    mod = from_onnx(onnx.load(model), keep_params_in_input=False)
    executable = tvm.compile(mod, target=tvm.target.Target({"kind": "llvm", "mcpu": mcpu}))
    executable.export_library(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("peer", choices=["tvm"])
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--mcpu", required=True)
    args = ap.parse_args()
    tvm_build(args.model, args.out, args.mcpu)


if __name__ == "__main__":
    main()
