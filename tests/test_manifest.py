"""One manifest type writes and reads a bundle's manifest; loading checks its format, the
library's entry ABI and the file names before anything is mapped."""
import pytest

from modelkiln.artifacts import load
from modelkiln.artifacts.manifest import FORMAT_VERSION, KILN_VERSION, Manifest
from modelkiln.ir.errors import KilnError
from tests.conftest import bundle_copy


def test_manifest_round_trips_and_names_this_kiln(cnn_bundle):
    m = Manifest.read(cnn_bundle)
    assert Manifest.from_bytes(m.to_bytes(), "x") == m
    assert m.kiln_version == KILN_VERSION and m.format_version == FORMAT_VERSION
    assert load(cnn_bundle).manifest == m


@pytest.mark.parametrize("edit,message", [
    (lambda m: m.update(format_version=FORMAT_VERSION + 1), "bundle format"),
    (lambda m: m.update(abi_version=99), "entry ABI"),
    (lambda m: m.pop("arena_bytes"), "missing arena_bytes"),
    (lambda m: m.update(library="../../etc/passwd"), "not a plain name"),
    (lambda m: "{ not json", "not valid JSON"),
    (lambda m: "[1, 2]", "not a Kiln manifest"),
])
def test_a_bad_manifest_is_a_clear_error(cnn_bundle, tmp_path, edit, message):
    with pytest.raises(KilnError, match=message):
        load(bundle_copy(cnn_bundle, tmp_path, edit))
