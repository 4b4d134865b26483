"""Schedules as data, tuning records in the store, builds that follow them, and `kiln tune`.

Every schedule a kernel can take must compute what its rules' schedule computes: the sampled
schedules here are checked against onnxruntime. Records are data: keyed by everything their
result depends on, verified on read, never applied across toolchains or search spaces.
"""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest

from modelkiln.ir.lower import lower
from modelkiln.ir.lower.group import relower
from modelkiln.ir.loop import Const, For, Kernel, Store, Var, mul, rem
from modelkiln.ir.schedule import ScheduleError, canonical, check
from modelkiln.orchestrator.api import build
from modelkiln.orchestrator.cache_key import key_of
from modelkiln.orchestrator.pipeline import optimize, schedule_for
from modelkiln.orchestrator.target import parse_target
from modelkiln.orchestrator.tuning_records import Records, decode, encode, make_record, record_parts

from tests import model_zoo
from tests.conftest import assert_matches_oracle
from tests.isa import run_or_inspect
from tests.model_zoo import GraphMaker


def one_conv(cin: int = 16, cout: int = 32, size: int = 28) -> "onnx.ModelProto":  # noqa: F821
    g = GraphMaker(7)
    y = g.op("Relu", [g.conv("x", cin, cout, 3)])
    return g.model({"x": [1, cin, size, size]}, [y], name="one_conv")


def depthwise_and_linear() -> "onnx.ModelProto":  # noqa: F821
    """A 7x7 depthwise conv (window passes), a narrow conv (8 output channels: weights as rows
    where the vectors are 16 wide), a 1x1 conv, and a MatMul with a bias."""
    g = GraphMaker(8)
    h = g.op("Relu", [g.conv("x", 8, 8, 7, group=8)])
    h = g.conv(h, 8, 8, 3)
    h = g.op("Relu", [g.conv(h, 8, 48, 1, pad=0)])
    h = g.op("Reshape", [h, g.const(np.array([1, 48, 40 * 40], np.int64))])
    y = g.op("Add", [g.op("MatMul", [h, g.weight((1600, 40))]), g.weight((40,))])
    return g.model({"x": [1, 8, 40, 40]}, [y], name="depthwise_and_linear")


def _spaces(model, target):
    g, _ = optimize(model)
    config = schedule_for(target)
    lowered = lower(g, config)
    return g, config, [c for c in lowered.calls if c.space]


def _sampled_points(g, config, call, rounds: int, offset: int) -> list[dict]:
    """`rounds` points of the call's space: round r takes each knob's (r + offset)-th choice
    (cycling; kernels of one model have different offsets, so together they take every
    choice in a few builds); a knob that does not fit the others is left at its rule."""
    work = g.copy()
    points = []
    for r in range(rounds):
        point = {}
        for knob, (choices, _) in call.space.items():
            trial = {**point, knob: choices[(r + offset) % len(choices)]}
            try:
                relower(work, call, config, trial)
                point = trial
            except ScheduleError:
                pass
        points.append(point)
    return points


def _keep(records: Records, call, schedule: dict, ratio: float = 0.8) -> None:
    parts = record_parts(call.default_digest, records.target, records.threads)
    records.keep(make_record(parts, schedule, ratio, [ratio], 1.0, 1, 0, call.name, True))


def quantized_cnn():
    return model_zoo.quantized(model_zoo.cnn(), "qdq")


@pytest.mark.parametrize("make_model", [model_zoo.cnn, depthwise_and_linear, model_zoo.transformer_encoder,
                                        quantized_cnn], ids=["cnn", "depthwise_and_linear", "transformer", "int8"])
@pytest.mark.parametrize("spec", ["llvm", "x86-64-v3", "cascadelake"])  # (the host; AVX2; AVX-512, run or inspected)
def test_every_sampled_schedule_computes_what_the_rules_do(make_model, spec, executor, tmp_path):
    """Each build sets every tunable kernel to a sampled point; together the builds take every
    choice of every knob. Each is checked against onnxruntime; the int8 model against the
    rules' build, bit for bit (onnxruntime's int8 is not exact on every CPU: tests/test_quantized.py
    checks the rules' build against onnx's reference evaluator)."""
    from modelkiln.orchestrator.api import build
    from modelkiln.artifacts.store import Store
    model, target = make_model(), parse_target(spec)
    g, config, calls = _spaces(model, target)
    assert calls, "nothing to tune in this model"
    most = max(len(choices) for c in calls for choices, _ in c.space.values())
    rounds = max(3, -(-most // min(3, len(calls))))
    points = {c.default_digest: _sampled_points(g, config, c, rounds, 3 * i) for i, c in enumerate(calls)}
    seen = {(k, json.dumps(v)) for ps in points.values() for p in ps for k, v in p.items()}
    every = {(k, json.dumps(list(v) if isinstance(v, tuple) else v)) for c in calls
             for k, (choices, default) in c.space.items() for v in choices if v != default}
    assert len(seen) >= 0.8 * len(every), "the sampling misses choices"
    for r in range(rounds):
        store = Store(str(tmp_path / f"store{r}"))
        records = Records(store, target, 1)
        for c in calls:
            _keep(records, c, points[c.default_digest][r])
        result = build(model, target=spec, executor=executor, cache=store, progress=False, tuning_threads=1)
        changed = sum(1 for c in calls if points[c.default_digest][r])
        assert result.report["tuning"]["changed_kernels"] == changed
        if make_model is quantized_cnn:
            rules = build(model, target=spec, executor=executor, cache=None, progress=False)
            run_or_inspect(result, lambda: _same_outputs(result, rules, model))
        else:
            run_or_inspect(result, lambda: assert_matches_oracle(result, model))


def _same_outputs(result, rules, model) -> None:
    inputs = model_zoo.random_inputs(model, 0)
    got, want = result.load().run(inputs), rules.load().run(inputs)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_a_build_without_records_is_todays(executor, tmp_path):
    """No records, or --no-tuning with records: the bundle is byte for byte the rules' one."""
    from modelkiln.artifacts.store import Store
    model = one_conv()
    plain = build(model, executor=executor, cache=None, progress=False).files
    empty = build(model, executor=executor, cache=str(tmp_path / "empty"), progress=False).files
    store = Store(str(tmp_path / "tuned"))
    target = parse_target("llvm")
    g, config, calls = _spaces(model, target)
    records = Records(store, target)
    for c in calls:
        _keep(records, c, {"tile": list(next(t for t in c.space["tile"][0] if t != c.space["tile"][1]))})
    off = build(model, executor=executor, cache=store, progress=False, tuning=False)
    on = build(model, executor=executor, cache=store, progress=False)
    for name in ("model.so", "weights.bin", "manifest.json", "kiln_entry.c"):
        assert bytes(plain[name]) == bytes(empty[name]) == bytes(off.files[name]), name
    assert bytes(on.files["manifest.json"]) != bytes(plain["manifest.json"])  # (the tuned kernel's symbol)
    assert on.report["tuning"]["changed_kernels"] == len(calls)
    assert off.report["tuning"] == {"enabled": False}


def test_records_are_verified_and_never_code():
    target = parse_target("llvm")
    parts = record_parts("ab" * 32, target, 2)
    record = make_record(parts, {"tile": (8, 32), "split": "n"}, 0.9, [0.9, 0.91], 1.5, 12, 1, "k", True)
    assert decode(encode(record), parts)["schedule"] == {"split": "n", "tile": [8, 32]}
    assert canonical({"tile": (8, 32)}) == canonical({"tile": [8, 32]})
    bad = {
        "not JSON": b"\x80\x04pickle",
        "format": encode({**record, "format": 99}),
        "another kernel": encode({**record, "parts": {**parts, "kernel": "cd" * 32}}),
        "ratio": encode({**record, "ratio": -1}),
        "unknown knob": encode({**record, "schedule": {"__import__('os').system('x')": 1}}),
        "wrong kind": encode({**record, "schedule": {"tile": {"mr": 8}}}),
    }
    for why, payload in bad.items():
        with pytest.raises(ValueError):
            decode(payload, parts)
    with pytest.raises(ScheduleError):
        check({"tile": [1, 2, 3, 4, 5]})


def _conv_and_store(tmp_path):
    """(model, target, store, the model's tunable calls, the store's records at 1 thread)."""
    from modelkiln.artifacts.store import Store
    model, target = one_conv(), parse_target("llvm")
    store = Store(str(tmp_path / "store"))
    return model, target, store, _spaces(model, target)[2], Records(store, target, 1)


@pytest.mark.parametrize("part,value", [("kiln_codegen", "0" * 64), ("llvm", "0.0"), ("space_version", 0)],
                         ids=["kiln", "llvm", "search-space"])
def test_a_record_from_another_toolchain_is_not_applied_but_named(part, value, executor, tmp_path):
    """A record whose toolchain or search space differs is never applied: the build says the
    kernel's record is stale, and builds the rules' kernel."""
    from modelkiln.orchestrator import tuning_records
    model, target, store, calls, records = _conv_and_store(tmp_path)
    for c in calls:
        old = {**record_parts(c.default_digest, target, 1), part: value}
        record = make_record(old, {"split": "n"}, 0.8, [0.8], 1.0, 5, 0, c.name, True)
        store.put(key_of(old), encode(record), tuning_records.SECTION)  # (as that toolchain filed it)
        store.put(key_of(tuning_records.seed_parts(c.default_digest, target, 1)), encode(record),
                  tuning_records.INDEX)
    result = build(model, executor=executor, cache=store, progress=False, tuning_threads=1)
    assert result.report["tuning"]["tuned_kernels"] == 0
    assert result.report["tuning"]["stale_records"] == [c.name for c in calls]
    plain = build(model, executor=executor, cache=None, progress=False)
    assert bytes(result.files["manifest.json"]) == bytes(plain.files["manifest.json"])
    # and a record for another thread count is another key
    _keep(records, calls[0], {"split": "n"})
    assert Records(store, target, 2).find(calls[0].default_digest) is None
    assert Records(store, target, 1).find(calls[0].default_digest)["schedule"] == {"split": "n"}


def test_a_record_that_does_not_fit_its_kernel_is_warned_about(executor, tmp_path):
    model, _, store, calls, records = _conv_and_store(tmp_path)
    for c in calls:
        _keep(records, c, {"window_rows": 3})  # (a depthwise knob, on a dense conv)
    with pytest.warns(UserWarning, match="does not fit its kernel"):
        result = build(model, executor=executor, cache=store, progress=False, tuning_threads=1)
    assert_matches_oracle(result, model)


def test_kiln_tune_end_to_end_and_resume(executor, tmp_path, capsys):
    """Tune a conv on this machine, build with the records (measuring nothing), check against
    onnxruntime; a second tune keeps what the first found and measures nothing."""
    from modelkiln.orchestrator.tuner import tune
    from modelkiln.orchestrator.cli import main
    model = one_conv()
    cache = str(tmp_path / "store")
    first = tune([model], trials=200, threads=1, executor=executor, cache=cache, progress=False).report
    assert first["trials"] >= 5 and first["kernels_tuned"] == 1
    [row] = first["kernels"]
    assert row["trials"] == first["trials"]
    result = build(model, executor=executor, cache=cache, progress=False, tuning_threads=1)
    assert result.report["tuning"]["tuned_kernels"] == 1
    assert result.report["totals"]["compiled"] == 0  # (the tune compiled and stored every candidate)
    tuned = [k["tuned"] for k in result.report["kernels"] if "tuned" in k]
    assert tuned and tuned[0]["schedule"] == row.get("schedule", {})
    assert_matches_oracle(result, model)
    second = tune([model], trials=200, threads=1, executor=executor, cache=cache, progress=False).report
    assert second["trials"] == 0 and second["kernels_resumed"] == 1
    assert main(["cache", "stats", "--cache", cache]) == 0
    assert "1 tuning records" in capsys.readouterr().out
    import onnx
    path = str(tmp_path / "conv.onnx")
    onnx.save(model, path)
    assert main(["explain", path, "--cache", cache, "--tuning-threads", "1"]) == 0
    said = capsys.readouterr().out
    tuned_line = "schedule: tuned at 1 threads" if row.get("schedule") else "measured best by kiln tune at 1 threads"
    assert tuned_line in said
    assert main(["explain", path, "--cache", cache, "--no-tuning"]) == 0
    assert "schedule: the rules (no tuning record)" in capsys.readouterr().out


def test_an_interrupted_tune_goes_on_from_its_record(executor, tmp_path):
    from modelkiln.orchestrator.tuner import tune
    model = one_conv()
    cache = str(tmp_path / "store")
    first = tune([model], trials=3, threads=1, executor=executor, cache=cache, progress=False).report
    assert first["trials"] == 3 and first["kernels_resumed"] == 0
    again = tune([model], trials=3, threads=1, executor=executor, cache=cache, progress=False).report
    assert again["kernels_resumed"] == 0 and again["trials"] == 3  # (incomplete: searched on)


@pytest.mark.slow
def test_failing_candidates_are_never_chosen(executor, tmp_path, monkeypatch):
    """Candidates that compute wrong values, crash the measuring process, hang, or crash codegen
    are failed, named in the report, and never a record's schedule."""
    from modelkiln.orchestrator import tune_measure, tuner
    monkeypatch.setattr(tune_measure, "LOAD_DEADLINE_S", 3.0)
    model = one_conv()
    target = parse_target("llvm")
    _, _, [call] = _spaces(model, target)
    tiles = [t for t in call.space["tile"][0] if t != call.space["tile"][1]]
    wrong, crash, hang, no_code = (list(t) for t in tiles[:4])
    real_relower, real_make_job = tuner.relower, tuner.make_job

    def sabotaged(g, c, config, point):
        out = real_relower(g, c, config, point)
        far = (For("c", 2, (Store("o0", mul(Var("c"), Const(1 << 40)), Const(1.0, "f32")),)),)  # (past any mapping)
        extra = {json.dumps(wrong): (Store("o0", Const(5), Const(1e6, "f32")),),
                 json.dumps(crash): far}.get(json.dumps(point.get("tile")))
        if json.dumps(point.get("tile")) == json.dumps(hang):
            extra = (For("spin", 1 << 50, (Store("o0", rem(Var("spin"), Const(7)), Const(0.0, "f32")),)),)
        if extra:
            k = out.kernel
            out = dataclasses.replace(out, kernel=Kernel(k.buffers, k.body + extra, k.schedule))
        return out

    def failing_codegen(call_, target_, opt_level, salt="", inject=None):
        if list(call_.kernel.body) and json.dumps(no_code) in json.dumps(_tile_of(call_.kernel)):
            inject = {call_.kernel.symbol: "crash:always"}
        return real_make_job(call_, target_, opt_level, salt, inject)

    monkeypatch.setattr(tuner, "relower", sabotaged)
    monkeypatch.setattr(tuner, "make_job", failing_codegen)
    report = tuner.tune([model], trials=40, threads=1, executor=executor, cache=str(tmp_path / "s"),
                        progress=False).report
    [row] = report["kernels"]
    why = {json.dumps(f["schedule"].get("tile")): f["why"] for f in row["failed"]}
    assert "differs" in why[json.dumps(wrong)]
    assert "crashed" in why[json.dumps(crash)]
    assert "hung" in why[json.dumps(hang)]
    assert "codegen failed" in why[json.dumps(no_code)]
    assert row.get("schedule", {}).get("tile") not in (wrong, crash, hang, no_code)


def _tile_of(kernel):
    from modelkiln.ir.loop import Gemm
    stack = list(kernel.body)
    while stack:
        s = stack.pop()
        if isinstance(s, Gemm):
            return [s.mr, s.nr]
        stack.extend(getattr(s, "body", ()) or ())
    return None


@pytest.mark.slow
def test_records_travel_through_the_shared_cache(executor, tmp_path, monkeypatch):
    """One machine tunes with the HTTP cache behind its store; a fresh machine (empty store,
    the same cache) builds the tuned module, compiling and measuring nothing."""
    from tests.cache_servers import Nginx
    from modelkiln.orchestrator.tuner import tune
    server = Nginx(str(tmp_path / "nginx"))
    try:
        model = one_conv()
        monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "machine_a"))
        report = tune([model], trials=12, threads=1, executor=executor, cache=server.url, progress=False).report
        assert report["kernels_tuned"] == 1
        monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "machine_b"))
        result = build(model, executor=executor, cache=server.url, progress=False, tuning_threads=1)
        assert result.report["tuning"]["tuned_kernels"] == 1
        assert result.report["totals"]["compiled"] == 0
        assert_matches_oracle(result, model)
        assert os.listdir(tmp_path / "machine_b" / "records")
    finally:
        server.stop()


@pytest.mark.slow
def test_concurrent_tuners_share_one_store(tmp_path):
    """Two `kiln tune` processes on one store at once: both finish, every entry verifies, and a
    build follows the records."""
    import subprocess
    import sys
    import onnx
    from modelkiln.artifacts.store import Store
    from tests.conftest import ROOT
    model = one_conv()
    path, cache = str(tmp_path / "conv.onnx"), str(tmp_path / "store")
    onnx.save(model, path)
    cmd = [sys.executable, "-m", "modelkiln.orchestrator.cli", "tune", path, "--trials", "6", "--threads", "1",
           "--cache", cache, "--quiet", "--workers", "1"]
    env = {**os.environ, "PYTHONPATH": ROOT}
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for _ in range(2)]
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out.decode()
    assert Store(cache).verify() == []
    assert Store(cache).stats()["records"] == 1
    result = build(model, cache=cache, progress=False, tuning_threads=1)
    assert result.report["tuning"]["tuned_kernels"] == 1
    assert_matches_oracle(result, model)


def test_a_new_kernel_starts_from_similar_records_and_their_predictions(tmp_path):
    """Records of one conv start and order the search of a similar one (same kind, near sizes):
    its first point is the schedule that won there, then the points predicted best."""
    from modelkiln.artifacts.store import Store
    from modelkiln.orchestrator.tune_knowledge import Knowledge, kernel_features
    from modelkiln.orchestrator.tune_search import KernelSearch
    target = parse_target("llvm")
    [a] = _spaces(one_conv(16, 32, 28), target)[2]
    [b] = _spaces(one_conv(16, 32, 32), target)[2]
    [far] = _spaces(depthwise_and_linear(), target)[2][:1]
    tiles = [list(t) for t in a.space["tile"][0] if t != a.space["tile"][1]]
    won, good, bad = {"tile": tiles[0], "split": "n"}, {"tile": tiles[1]}, {"tile": tiles[2]}
    store = Store(str(tmp_path / "store"))
    records = Records(store, target, 1)
    parts = record_parts(a.default_digest, target, 1)
    records.keep(make_record(parts, won, 0.8, [0.8], 1.0, 3, 1, a.name, True, features=kernel_features(a),
                             log=[(won, 0.8), (good, 0.9), (bad, 1.4), ({"split": "n"}, None)]))
    twin = record_parts("ef" * 32, target, 1)  # (another kernel at the same distance: ties sort)
    records.keep(make_record(twin, {}, 1.0, [1.0], 1.0, 3, 0, a.name, True, features=kernel_features(a)))
    knowledge = Knowledge(store, target, 1)
    features = kernel_features(b)
    assert knowledge.starts(features, b.default_digest) == [check(won)]
    assert knowledge.starts(kernel_features(far), far.default_digest) == []  # (another kind)
    predict = knowledge.predictor(features, b.default_digest)
    assert predict(good) == pytest.approx(0.9) and predict({"tile": tiles[3]}) is None
    search = KernelSearch(b.space, knowledge.starts(features, b.default_digest), predict)
    first, second = search.next(), search.next()
    assert first == check(won) and second == check(good)
    order = [search.next() for _ in range(20)]
    assert check(bad) not in order[:5]  # (predicted to lose: tried late)
    assert Knowledge(store, target, 2).records == []  # (another thread count learns nothing from it)


@pytest.mark.slow
def test_a_model_with_symbolic_dims_is_tuned_at_named_sizes(executor, tmp_path):
    """A BERT with dynamic batch and sequence is measured at the sizes named (batch at its
    bounds' midpoint and top, the default; seq at 16 and 64); its records say so; one build
    follows them and runs every size within the bounds."""
    from modelkiln.artifacts.store import Store
    from modelkiln.orchestrator.tuner import tune
    from modelkiln.orchestrator.tuning_records import SECTION
    from tests import dynamic_zoo
    model, feeds = dynamic_zoo.bert_encoder_dynamic()
    dims, cache = {"batch": (1, 4), "seq": (1, 64)}, str(tmp_path / "store")
    report = tune([model], trials=10, threads=1, tune_dims={"seq": [16, 64]}, executor=executor, cache=cache,
                  dims=dims, progress=False).report
    assert report["trials"] == 10 and report["kernels_tuned"] >= 1
    store = Store(cache)
    measured = [decode(store.get_view(k, SECTION), None)["sizes"] for k in store.record_keys()]
    assert measured and all(m == {"measured_at": [{"batch": 2, "seq": 16}, {"batch": 4, "seq": 64}]}
                            for m in measured)
    result = build(model, dims=dims, executor=executor, cache=cache, progress=False, tuning_threads=1)
    assert result.report["tuning"]["tuned_kernels"] >= 1
    module = result.load()
    for batch, seq in ((1, 7), (2, 16), (4, 64)):
        f = feeds(batch, seq, seed=seq)
        want = model_zoo.onnxruntime_outputs(model, f)
        for name, value in module.run(f).items():
            np.testing.assert_allclose(value, want[name], rtol=1e-4, atol=2e-5, err_msg=name)
    with pytest.raises(Exception, match="outside its bounds"):
        tune([model], trials=1, threads=1, tune_dims={"seq": [100]}, executor=executor, cache=cache, dims=dims,
             progress=False)
