"""The `kiln` command line.

    kiln build MODEL -o OUT [--target T] [--opt-level N] [--shape NAME=DIMS ...] [--workers N]
    kiln build-many MODEL... -o OUTDIR [--manifest batch.yaml] [--fail-fast]
    kiln run OUT [--inputs in.npz] [--outputs out.npz]
    kiln bench OUT [--warmup N] [--repeat N]
    kiln tune MODEL... [--budget 10m | --trials N] [--threads N] [--executor ray]
    kiln explain MODEL [--target T]
    kiln cache stats|gc|verify
    kiln workers up|status|down [--ray-address A] [-n N]
    kiln targets

Errors the user can act on print one line (`kiln: error: ...`) and exit 2; no traceback.
build-many keeps going past a model that fails and exits 1, naming each failed model.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from ..ir.errors import KilnError


def _parse_shapes(items) -> dict:
    shapes = {}
    for item in items or []:
        name, sep, dims = item.rpartition("=")
        try:
            if not sep or not name:
                raise ValueError
            # A number fixes a dim; a name makes it a symbol (bounded with --dim).
            shapes[name] = [int(d) if d.strip().isdigit() else _symbol_name(d, item)
                            for d in dims.replace(",", "x").split("x")]
        except ValueError:
            raise KilnError(f"--shape {item!r}: expected NAME=DIMS, for example x=1x3x224x224 "
                            "(or x=batchx3x224x224, batch bounded with --dim)") from None
    return shapes


def _symbol_name(text: str, item: str) -> str:
    if not text.strip().isidentifier():
        raise ValueError(item)
    return text.strip()


def _parse_dims(items) -> dict | None:
    """--dim NAME=LEAST..GREATEST (or NAME=GREATEST, least 1): a symbol's bounds, or those of
    the values of an integer input NAME (or its element NAME[k]) read at run time."""
    dims = {}
    for item in items or []:
        name, sep, bounds = item.partition("=")
        least, dots, greatest = bounds.partition("..")
        try:
            if not sep or not name.strip() or any(c.isspace() for c in name.strip()):
                raise ValueError
            dims[name.strip()] = (int(least), int(greatest)) if dots else (1, int(least))
        except ValueError:
            raise KilnError(f"--dim {item!r}: expected NAME=LEAST..GREATEST, for example seq=1..512") from None
    return dims or None


def _parse_sizes(items) -> dict:
    """--dim NAME=N of `kiln run`: a symbol's value for the random inputs."""
    sizes = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep or not value.strip().isdigit():
            raise KilnError(f"--dim {item!r}: expected NAME=N, for example seq=128")
        sizes[name.strip()] = int(value)
    return sizes


def _parse_size(text: str) -> int:
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().rstrip("B").rstrip("I")
    unit = t[-1] if t and t[-1] in units else ""
    try:
        return int(float(t[:-1] if unit else t) * units[unit])
    except ValueError:
        raise KilnError(f"--max-size {text!r}: expected a size such as 500M or 2G") from None


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return n


def _cache_arg(args):
    from .options import DEFAULT_CACHE
    if getattr(args, "no_cache", False):
        return None
    return args.cache or DEFAULT_CACHE


def _add_build_flags(p):
    p.add_argument("--target", default="llvm", help="'llvm', a preset (host, x86-64-v3, cascadelake, aarch64) "
                                                   "or 'llvm -mcpu=.. -mattr=.. -cl-opt=..'")
    p.add_argument("--opt-level", type=int, default=3, choices=range(0, 4))
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"),
                   help="bf16: MatMul and Gemm operands rounded to bfloat16, summed in float32 (on AMX's tile unit "
                        "where the CPU has it, convs too)")
    p.add_argument("--shape", action="append", metavar="NAME=DIMS", help="static input shape, e.g. x=1x3x224x224")
    p.add_argument("--dim", action="append", metavar="NAME=LEAST..GREATEST",
                   help="keep a symbolic dim (the model's dim_param, or a name in --shape) with these bounds, "
                        "e.g. seq=1..512: one build runs every size in them")
    p.add_argument("--workers", type=int, default=None, help="codegen processes (default: usable cores)")
    p.add_argument("--executor", default="local", choices=("local", "ray", "inprocess"))
    p.add_argument("--ray-address", default=None, help="join this Ray cluster (default: RAY_ADDRESS, the cluster of "
                                                       "a pool `kiln workers up` started here, else a new local Ray)")
    _add_ray_flags(p)
    p.add_argument("--ray-fallback-local", action="store_true",
                   help="when no Ray actor with this toolchain is left, compile locally instead of failing")
    p.add_argument("--cache", default=None, help="store folder (default: KILN_CACHE_DIR or ~/.cache/kiln)")
    p.add_argument("--no-cache", action="store_true", help="neither read nor write the store")
    p.add_argument("--cache-readonly", action="store_true", help="read hits, write nothing (pull-request CI)")
    p.add_argument("--kernel-timeout", type=float, default=300.0, help="seconds per codegen job before it is killed")
    p.add_argument("--verify-cache", action="store_true", help="recompile cache hits and compare bytes")
    p.add_argument("--no-tuning", action="store_true", help="build the hand-written schedules, ignoring `kiln tune`'s "
                                                           "records")
    p.add_argument("--tuning-threads", type=_positive_int, default=None,
                   help="apply the records tuned at this thread count (default: the usable cores)")
    p.add_argument("--report", default=None, help="write the build report (JSON) here")
    p.add_argument("--trace", default=None, help="write a Chrome trace (chrome://tracing, Perfetto) of the compile")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--verbose", action="store_true", help="print what LLVM said in each codegen job (otherwise "
                                                          "it is only in the --report's attempt logs)")


def _add_budget_flags(p):
    p.add_argument("--max-error", type=_positive_float, default=None, metavar="E",
                   help="with --precision bf16: keep in float32 the fewest kernels that bring the largest output "
                        "difference from the float32 build, relative to the output's largest magnitude, within E")
    p.add_argument("--calibration", action="append", metavar="INPUTS.npz",
                   help="inputs --max-error is measured on (repeat for more; default: random inputs)")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number such as 0.01, got {text!r}")
    return value


def _add_ray_flags(p):
    p.add_argument("--ship-kiln", default="auto", choices=("auto", "always", "never"),
                   help="send this Kiln to Ray nodes: where a node has none (auto), to every node, or never")
    p.add_argument("--ray-resource", default=None, metavar="NAME",
                   help="compile only on Ray nodes that offer this custom resource (one unit per actor)")


def _build_options(args):
    """The build's settings from the flags. The executor goes by name: the build creates it
    only if a job needs compiling (a build served whole from the store must not start Ray)."""
    from .options import BuildOptions
    return BuildOptions(target=args.target, opt_level=args.opt_level, shapes=_parse_shapes(args.shape),
                        dims=_parse_dims(args.dim), precision=args.precision,
                        executor=args.executor, workers=args.workers, ray_address=args.ray_address,
                        ray_ship=args.ship_kiln, ray_resource=args.ray_resource,
                        ray_local_fallback=args.ray_fallback_local,
                        cache=_cache_arg(args), cache_readonly=args.cache_readonly,
                        kernel_timeout=args.kernel_timeout, progress=False if args.quiet else None,
                        verify_cache=args.verify_cache, trace=args.trace, tuning=not args.no_tuning,
                        tuning_threads=args.tuning_threads, fail_fast=getattr(args, "fail_fast", False),
                        max_error=getattr(args, "max_error", None), calibration=getattr(args, "calibration", None))


def _write_report(path, report) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)


def _summary(report) -> str:
    t = report["totals"]
    return (f"{t['kernels']} kernels: {t['compiled']} compiled, {t['cached']} cached, {t['failed']} failed, "
            f"{t['retried']} retried, {t['fallback']} fallback; {report['timing']['total_s']:.2f}s "
            f"({report['executor']}, {report['workers']} workers)"
            + (f"; peak memory {peak:.0f} MiB" if (peak := report["timing"].get("driver_peak_rss_mb")) else "")
            + _tuning_note(report.get("tuning")) + _accuracy_note(report.get("accuracy")))


def _accuracy_note(accuracy: dict | None) -> str:
    if not accuracy:
        return ""
    kept = len(accuracy["fp32_kernels"])
    return (f"; {accuracy['bf16_kernels'] - kept} of {accuracy['bf16_kernels']} kernels in {accuracy['precision']}, "
            f"{kept} kept in float32: error {accuracy['error']:.3g} within {accuracy['max_error']:g}")


def _tuning_note(tuning: dict | None) -> str:
    if not tuning or not tuning.get("enabled"):
        return ""
    note = (f"; {tuning['tuned_kernels']} of {tuning['tunable_kernels']} kernels tuned at {tuning['threads']} threads"
            if tuning["tuned_kernels"] else "")
    if tuning["stale_records"]:
        note += (f"; {len(tuning['stale_records'])} kernels' tuning records are from another Kiln or LLVM "
                 "and not applied (`kiln tune` again starts from them)")
    return note


def _print_job_logs(report) -> None:
    """--verbose: each codegen attempt's own output (LLVM remarks, warnings), on stderr."""
    rows = report.get("kernels") or [k for m in report.get("models", []) for k in m.get("kernels", [])]
    for row in rows:
        for attempt in row.get("attempt_log", []):
            if attempt.get("log", "").strip():
                print(f"--- {row['name']} ({row['symbol']}), attempt {attempt['attempt']}:\n{attempt['log'].rstrip()}",
                      file=sys.stderr)


def _run_build(args, fn, models):
    """Run build/build_many with the CLI's flags; a failed build still writes its report."""
    from .api import BuildError
    try:
        result = fn(models, options=_build_options(args))
    except BuildError as e:
        _write_report(args.report, e.report)
        if args.verbose:
            _print_job_logs(e.report)
        raise
    if args.verbose:
        for r in getattr(result, "results", [result]):
            _print_job_logs(r.report)
    return result


def cmd_build(args) -> int:
    from .api import build
    result = _run_build(args, build, args.model)
    path = result.export(args.output)
    _write_report(args.report, result.report)
    if not args.quiet:
        print(f"built {path}: {_summary(result.report)}")
    return 0


def cmd_build_many(args) -> int:
    """Exit 0 when every model was built, 1 when some failed (each is listed with its stage and
    error; the others are built and exported, as `make -k` keeps going), 2 on --fail-fast's
    first error."""
    from .api import build_many
    from .batch_manifest import read_manifest
    models = list(args.models) + (read_manifest(args.manifest) if args.manifest else [])
    if not models:
        raise KilnError("build-many: no models given (name them, or give --manifest FILE)")
    batch = _run_build(args, build_many, models)
    os.makedirs(args.output, exist_ok=True)
    names = _output_names(args.models) + [m.output for m in models[len(args.models):]]
    for name, result in zip(names, batch.results):
        if result is not None:
            result.export(os.path.join(args.output, name))
    _write_report(args.report, batch.report)
    t = batch.report["totals"]
    if not args.quiet:
        print(_batch_table(batch.report["models"], names))
        print(f"built {t['models'] - t['models_failed']} of {t['models']} models into {args.output}: "
              f"{t['kernel_calls']} kernel calls, {t['kernels']} unique kernels: {t['compiled']} compiled, "
              f"{t['cached']} cached, {t['failed']} failed; {batch.report['timing']['total_s']:.2f}s")
    for failure in batch.failures:
        first, *rest = failure.message.splitlines() or [""]
        print(f"kiln: {failure.model}: failed to {failure.stage}: {first}", file=sys.stderr)
        for line in rest:
            print(f"  {line}", file=sys.stderr)
    return 1 if batch.failures else 0


def _output_names(paths: list) -> list[str]:
    """Each model file's bundle folder: its stem, numbered where two stems are equal."""
    names = [os.path.splitext(os.path.basename(m))[0] for m in paths]
    return names if len(set(names)) == len(names) else [f"{i:02d}_{n}" for i, n in enumerate(names)]


def _batch_table(rows: list, names: list) -> str:
    """One line per model of a batch: its bundle folder, status, kernels compiled and cached."""
    lines = [f"{'output':24s} {'status':7s} {'kernels':>7s} {'compiled':>8s} {'cached':>6s}"]
    for name, row in zip(names, rows):
        if row["status"] == "built":
            t = row["totals"]
            lines.append(f"{name:24s} {'built':7s} {t['kernels']:7d} {t['compiled']:8d} {t['cached']:6d}")
        else:
            lines.append(f"{name:24s} {'failed':7s} {'-':>7s} {'-':>8s} {'-':>6s}  ({row['stage']})")
    return "\n".join(lines)


# An .npz holds bfloat16, the float8/float4 types and the 4- and 2-bit integers as raw bytes
# (numpy's void types, `|V1`, `|V2`): --outputs writes this entry beside the arrays, a JSON map
# of each array's element type (view one with `arr.view(getattr(ml_dtypes, dtypes[name]))`),
# and --inputs reads raw bytes of an input's width as its declared type.
DTYPE_MAP = "kiln_dtypes"


def _read_npz_inputs(path: str, module) -> dict:
    import numpy as np

    from ..artifacts.element_types import numpy_dtype
    with np.load(path) as data:
        arrays = {k: data[k] for k in data.files if k != DTYPE_MAP}
    declared = {spec["name"]: numpy_dtype(spec["dtype"]) for spec in module.inputs}
    for name, array in arrays.items():
        want = declared.get(name)
        if want is not None and array.dtype.kind == "V" and array.dtype.itemsize == np.dtype(want).itemsize:
            arrays[name] = array.view(want)
    return arrays


def cmd_run(args) -> int:
    import numpy as np

    from ..artifacts.module import Module
    module = Module(args.bundle, args.threads)
    if args.inputs:
        inputs = _read_npz_inputs(args.inputs, module)
    else:
        sizes = _parse_sizes(args.dim)
        inputs = module.random_inputs(args.seed, sizes)
        symbols = ", ".join(f"{s['name']}={sizes.get(s['name'], s['greatest'])}" for s in module.manifest.symbols)
        print(f"no --inputs: using random inputs (seed {args.seed}"
              + (f"; symbols {symbols}: --dim NAME=N sets one)" if symbols else ")"))
    outputs = module.run(inputs)
    if args.outputs:
        dtypes = np.array(json.dumps({name: value.dtype.name for name, value in outputs.items()}))
        np.savez(args.outputs, **outputs, **{DTYPE_MAP: dtypes})
    for name, value in outputs.items():
        flat = value.reshape(-1)
        print(f"{name}: {value.dtype}{list(value.shape)} first values {np.array2string(flat[:6], precision=5)}")
    return 0


def cmd_bench(args) -> int:
    from ..artifacts.module import Module
    module = Module(args.bundle, args.threads)
    stats = module.benchmark(warmup=args.warmup, repeat=args.repeat)
    print(f"{args.bundle}: median {stats['median_ms']:.3f} ms, min {stats['min_ms']:.3f} ms, "
          f"p90 {stats['p90_ms']:.3f} ms over {stats['repeat']} runs, {module.threads} "
          f"thread{'s' if module.threads > 1 else ''}")
    if args.profile:
        rows = module.profile(repeat=args.repeat)
        total = sum(r["ms"] for r in rows) or 1.0
        for r in sorted(rows, key=lambda r: -r["ms"]):
            print(f"  {r['ms']:9.3f} ms {100 * r['ms'] / total:5.1f}%  {r['name']}  ({' -> '.join(r['ops'])})")
    return 0


def cmd_explain(args) -> int:
    from .explain import explain
    print(explain(args.model, target=args.target, opt_level=args.opt_level, shapes=_parse_shapes(args.shape),
                  dims=_parse_dims(args.dim), cache=_cache_arg(args), tuning=not args.no_tuning,
                  tuning_threads=args.tuning_threads, precision=args.precision, max_error=args.max_error,
                  calibration=args.calibration))
    return 0


def _parse_tune_dims(items) -> dict | None:
    """--tune-dims seq=128,512: the values of a symbol a tune measures at."""
    dims = {}
    for item in items or []:
        name, sep, values = item.partition("=")
        try:
            if not sep or not name.strip():
                raise ValueError
            dims[name.strip()] = [int(v) for v in values.split(",")]
        except ValueError:
            raise KilnError(f"--tune-dims {item!r}: expected NAME=N[,N...], for example seq=128,512") from None
    return dims or None


def _parse_budget(text: str) -> float:
    """--budget: seconds, or with a unit: 90s, 10m, 1h."""
    units = {"s": 1, "m": 60, "h": 3600}
    t = text.strip().lower()
    try:
        value = float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t)
    except ValueError:
        value = -1
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a duration such as 600, 90s, 10m or 1h, got {text!r}")
    return value


def cmd_tune(args) -> int:
    from .tuner import tune
    result = tune(args.models, budget_s=args.budget, trials=args.trials, threads=args.threads, retune=args.retune,
                  learn=not args.no_learning, tune_dims=_parse_tune_dims(args.tune_dims),
                  options=_build_options(args))
    _write_report(args.report, result.report)
    if not args.quiet:
        r = result.report
        print(f"tuned {len(r['kernels'])} kernels of {', '.join(r['models'])} at {r['threads']} threads: "
              f"{r['trials']} trials ({r['failed']} failed) in {r['seconds']:.0f} s, {r['kernels_resumed']} kept "
              f"from earlier tunes; expected gain {100 * r['expected_gain']:.1f}% of "
              f"{r['model_ms']:.2f} ms")
        for row in r["kernels"]:
            if row.get("schedule"):
                print(f"  {row['name']:40s} {row['ms']:8.3f} ms  x{row['ratio']:.2f}  {json.dumps(row['schedule'])}")
    return 0


def cmd_cache(args) -> int:
    from .cache_policy import open_store
    store = open_store(_cache_arg(args))
    if store is None:
        raise KilnError("there is no usable store to inspect (see the warning above, or drop --no-cache)")
    if args.action == "stats":
        s = store.stats()
        print(f"{s['root']}: {s['entries']} entries, {s['bytes'] / 1e6:.1f} MB; "
              f"{s['records']} tuning records ({s['record_bytes'] / 1e3:.1f} kB)")
        if s["orphaned_temp_files"]:
            print(f"{s['orphaned_temp_files']} orphaned temp files ({s['orphaned_bytes'] / 1e6:.1f} MB) from "
                  "interrupted writes: `kiln cache gc` removes them")
        from .build_log import recent_hit_rate
        rate = recent_hit_rate(store.root)
        if rate:
            print(f"last {rate['builds']} builds: {rate['hits']} hits / {rate['lookups']} lookups "
                  f"({100 * rate['hit_rate']:.0f}% hit rate)")
    elif args.action == "gc":
        r = store.gc(_parse_size(args.max_size))
        print(f"removed {r['removed']} entries ({r['freed_bytes'] / 1e6:.1f} MB); store now {r['bytes'] / 1e6:.1f} MB")
    else:
        bad = store.verify()
        for path, why in bad:
            print(f"bad entry {path}: {why} (removed)")
        print(f"verified {store.stats()['entries']} entries; {len(bad)} bad")
        return 1 if bad else 0
    return 0


def cmd_workers(args) -> int:
    from . import worker_pool
    from .executor_ray import node_label
    if args.action == "up":
        r = worker_pool.up(args.ray_address, args.workers, args.ship_kiln, args.ray_resource, args.start_timeout)
        print(f"pool {r['pool']} on {r['address']}: {r['actors']} actors ({r['started']} started now)")
        for node, row in r["nodes"].items():
            print(f"  node {node[:8]} ({row['host']}): {row['actors']} actors"
                  f"{', Kiln shipped' if row['shipped'] else ''}")
        for node, why in r["rejected"].items():
            print(f"  {node_label(node)} not used: {why}")
        if r["unstarted"]:
            print(f"  {r['unstarted']} actors did not start within {args.start_timeout:.0f} s (no free CPU?)")
    elif args.action == "status":
        rows = worker_pool.status(args.ray_address)
        if not rows:
            print("no Kiln worker pool on this cluster")
        for row in rows:
            where = f"node {row['node'][:8]} ({row['host']})" if row.get("node") else "does not answer"
            print(f"{row['name']}: {where}{'' if row['ours'] else '  [another Kiln: `kiln workers down` removes it]'}")
    else:
        print(f"removed {worker_pool.down(args.ray_address)} pool actors")
    return 0


def cmd_targets(args) -> int:
    from ..configs import load_preset, preset_names

    from .target import parse_target
    for name in preset_names():
        preset = load_preset(name)
        target = parse_target(name)
        print(f"{name:14s} {target.describe()}\n{'':14s} {preset.get('description', '')}\n{'':14s} "
              f"{target.feature_summary()}")
    return 0


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln", description="Build ONNX models into native modules.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("build", help="build one model into a bundle folder")
    p.add_argument("model")
    p.add_argument("-o", "--output", required=True, help="bundle folder to write")
    _add_build_flags(p)
    _add_budget_flags(p)
    p.set_defaults(fn=cmd_build)

    p = sub.add_parser("build-many", help="build several models in one batch (shared kernels compile once)")
    p.add_argument("models", nargs="*")
    p.add_argument("-o", "--output", required=True, help="folder for one bundle per model")
    p.add_argument("--manifest", metavar="FILE", help="a YAML file of models, each with its own shapes, dims, "
                                                      "target and output folder (docs/building.md)")
    p.add_argument("--fail-fast", action="store_true",
                   help="stop at the first model that fails (default: build every other model, then exit 1)")
    _add_build_flags(p)
    p.set_defaults(fn=cmd_build_many)

    p = sub.add_parser("tune", help="search the kernels' schedules on this machine; builds then follow the records")
    p.add_argument("models", nargs="+")
    p.add_argument("--budget", type=_parse_budget, default=None, help="time to spend (default 10m unless --trials)")
    p.add_argument("--trials", type=_positive_int, default=None, help="candidates to measure at most")
    p.add_argument("--threads", type=_positive_int, default=None, help="threads the module runs on (default: the "
                                                                     "usable cores)")
    p.add_argument("--retune", action="store_true", help="tune kernels that have records again, from their records")
    p.add_argument("--no-learning", action="store_true", help="search without the store's records of similar kernels")
    p.add_argument("--tune-dims", action="append", metavar="NAME=N,N..",
                   help="sizes of a symbolic dim to measure at (default: its bounds' midpoint and top)")
    _add_build_flags(p)
    p.set_defaults(fn=cmd_tune)

    p = sub.add_parser("run", help="run a bundle on inputs from an .npz file")
    p.add_argument("bundle")
    p.add_argument("--inputs", help=".npz with one array per model input (random if omitted)")
    p.add_argument("--outputs", help="write the outputs to this .npz")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dim", action="append", metavar="NAME=N",
                   help="a symbolic dim's size for the random inputs (default: its greatest)")
    p.add_argument("--threads", type=_positive_int, default=None, help="threads to run on (default: KILN_NUM_THREADS, else the usable cores)")
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("bench", help="measure a bundle's latency")
    p.add_argument("bundle")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeat", type=int, default=50)
    p.add_argument("--profile", action="store_true", help="also print each kernel's time")
    p.add_argument("--threads", type=_positive_int, default=None, help="threads to run on (default: KILN_NUM_THREADS, else the usable cores)")
    p.set_defaults(fn=cmd_bench)

    p = sub.add_parser("explain", help="passes, fused kernels and cache key parts of a model")
    p.add_argument("model")
    p.add_argument("--target", default="llvm")
    p.add_argument("--opt-level", type=int, default=3)
    p.add_argument("--shape", action="append", metavar="NAME=DIMS")
    p.add_argument("--dim", action="append", metavar="NAME=LEAST..GREATEST")
    p.add_argument("--cache", default=None)
    p.add_argument("--no-cache", action="store_true")
    p.add_argument("--no-tuning", action="store_true", help="explain the hand-written schedules")
    p.add_argument("--tuning-threads", type=_positive_int, default=None, help="the records of this thread count")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"), help="each kernel's precision in this build")
    _add_budget_flags(p)
    p.set_defaults(fn=cmd_explain)

    p = sub.add_parser("cache", help="inspect or clean the store")
    p.add_argument("action", choices=("stats", "gc", "verify"))
    p.add_argument("--cache", default=None)
    p.add_argument("--max-size", default="2G", help="gc: keep at most this much (e.g. 500M, 2G)")
    p.set_defaults(fn=cmd_cache)

    p = sub.add_parser("workers", help="a warm pool of codegen actors on a Ray cluster")
    p.add_argument("action", choices=("up", "status", "down"))
    p.add_argument("--ray-address", default=None, help="the cluster (default: RAY_ADDRESS, else `ray start --head`'s)")
    p.add_argument("-n", "--workers", type=_positive_int, default=None, help="up: actors in all (default: one per CPU)")
    p.add_argument("--start-timeout", type=float, default=120.0, help="up: seconds each actor may take to start")
    _add_ray_flags(p)
    p.set_defaults(fn=cmd_workers)

    p = sub.add_parser("targets", help="list the target presets")
    p.set_defaults(fn=cmd_targets)
    return parser


def _end_without_ray_teardown(code: int) -> None:
    """A command that joined a Ray cluster ends here, without Ray's half-second teardown: the
    cluster notices a driver's end by itself and stops the actors it owned."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main(argv=None) -> int:
    args = make_parser().parse_args(argv)
    if argv is None and getattr(args, "executor", None) == "ray":  # a build in a process of its own
        from . import executor_ray
        executor_ray.process_exits_next()
    try:
        code = args.fn(args)
        if argv is None:
            _end_without_ray_teardown(code)
        return code
    except KilnError as e:
        print(f"kiln: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kiln: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
