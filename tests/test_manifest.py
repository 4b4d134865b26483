"""One manifest type writes and reads a bundle's manifest; loading checks its format, the
library's entry ABI and the file names before anything is mapped."""
import json
import shutil

import pytest

from modelkiln.artifacts import load
from modelkiln.artifacts.manifest import FORMAT_VERSION, KILN_VERSION, Manifest
from modelkiln.ir.errors import KilnError
from modelkiln.orchestrator.api import build
from tests import model_zoo


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    from modelkiln.orchestrator.executor_local import LocalExecutor
    with LocalExecutor(workers=2) as ex:
        result = build(model_zoo.cnn(), executor=ex, cache=None, progress=False)
    return result.export(str(tmp_path_factory.mktemp("manifest") / "cnn"))


def _edited(bundle, tmp_path, edit) -> str:
    out = tmp_path / "edited"
    shutil.copytree(bundle, out)
    raw = json.loads((out / "manifest.json").read_text())
    text = edit(raw)
    (out / "manifest.json").write_text(text if isinstance(text, str) else json.dumps(raw))
    return str(out)


def test_manifest_round_trips_and_names_this_kiln(bundle):
    m = Manifest.read(bundle)
    assert Manifest.from_bytes(m.to_bytes(), "x") == m
    assert m.kiln_version == KILN_VERSION and m.format_version == FORMAT_VERSION
    assert load(bundle).manifest == m


@pytest.mark.parametrize("edit,message", [
    (lambda m: m.update(format_version=FORMAT_VERSION + 1), "bundle format"),
    (lambda m: m.update(abi_version=99), "entry ABI"),
    (lambda m: m.pop("arena_bytes"), "missing arena_bytes"),
    (lambda m: m.update(library="../../etc/passwd"), "not a plain name"),
    (lambda m: "{ not json", "not valid JSON"),
    (lambda m: "[1, 2]", "not a Kiln manifest"),
])
def test_a_bad_manifest_is_a_clear_error(bundle, tmp_path, edit, message):
    with pytest.raises(KilnError, match=message):
        load(_edited(bundle, tmp_path, edit))
