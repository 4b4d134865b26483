"""A bundle compiled for CPU features this machine lacks is refused at load, naming them,
instead of running until it meets an illegal instruction."""
import json
import shutil

import pytest

from modelkiln.artifacts import load
from modelkiln.artifacts.cpu_features import host_flags
from modelkiln.ir.errors import KilnError
from modelkiln.orchestrator.api import build
from tests import model_zoo
from tests.conftest import assert_matches_oracle
from tests.test_bad_input import kiln


def test_bundle_for_another_cpu_is_refused_naming_the_missing_features(tmp_path, executor):
    result = build(model_zoo.cnn(), target="llvm -mcpu=sapphirerapids", executor=executor, cache=None,
                   progress=False)
    required = set(json.loads(result.files["manifest.json"])["cpu_features"])
    assert {"avx512f", "avx512_fp16", "amx_tile"} <= required  # what -march=sapphirerapids implies
    out = result.export(str(tmp_path / "spr"))
    missing = sorted(required - host_flags())
    if missing:  # this machine (a Zen 5) has no AVX512-FP16 and no AMX
        with pytest.raises(KilnError) as e:
            load(out)
        assert all(flag in str(e.value) for flag in missing)
        r = kiln("run", out)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and missing[0] in r.stderr
    else:  # a Sapphire Rapids host runs it
        assert_matches_oracle(result, model_zoo.cnn())


def test_manifest_naming_an_unknown_flag_is_refused(tmp_path, executor):
    out = build(model_zoo.cnn(), executor=executor, cache=None, progress=False).export(str(tmp_path / "b"))
    load(out)  # built for this machine: loads
    manifest = json.loads(open(f"{out}/manifest.json").read())
    manifest["cpu_features"].append("kiln_future_isa")
    shutil.copytree(out, tmp_path / "c")
    (tmp_path / "c" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(KilnError, match="kiln_future_isa"):
        load(str(tmp_path / "c"))
