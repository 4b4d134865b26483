"""The pins of tests/constraints.txt and the tool that checks them against the newest
releases (tests/newest_releases.py): what it reads, reports and rewrites."""
import datetime
import re

from tests import newest_releases as nr


def test_the_constraints_pin_every_oracle_and_only_exact_versions():
    with open(nr.CONSTRAINTS) as f:
        text = f.read()
    pins = nr.read_pins(text)
    assert {"onnx", "onnxruntime", "ml-dtypes", "numpy", "onnxconverter-common", "pytest", "pytest-xdist",
            "pytest-timeout"} <= set(pins)
    requirement_lines = [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
    assert len(requirement_lines) == len(pins), "every requirement line is an exact pin"


def test_the_readme_test_command_applies_the_constraints():
    with open(f"{nr.ROOT}/README.md") as f:
        readme = f.read()
    assert re.search(r'pip install -c tests/constraints\.txt "\.\[test\]"', readme)


def test_what_moved_names_changed_and_vanished_pins():
    pins = {"onnx": "1.23.2", "ml-dtypes": "0.5.1", "numpy": "2.4.6", "gone": "1.0"}
    installed = {"onnx": "1.23.2", "ml-dtypes": "0.7.0", "numpy": "2.4.6"}
    assert nr.moved(pins, installed) == [("ml-dtypes", "0.5.1", "0.7.0"), ("gone", "1.0", "absent")]


def test_rewriting_raises_the_pins_and_keeps_everything_else():
    text = "# why\n# Last raised 2026-01-01, on a box\nml_dtypes==0.5.1\n\n# tools\npytest==9.0.0\n"
    installed = {"ml-dtypes": "0.7.0", "pytest": "9.2.0"}
    out = nr.rewritten(text, installed, datetime.date(2026, 12, 2))
    assert out == "# why\n# Last raised 2026-12-02, on a box\nml_dtypes==0.7.0\n\n# tools\npytest==9.2.0\n"
    assert nr.read_pins(out) == {"ml-dtypes": "0.7.0", "pytest": "9.2.0"}
