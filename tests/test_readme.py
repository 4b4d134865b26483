"""The README as a newcomer reads it: its examples run as written, its two commands are the
ones CI runs, it stays an entry point, and every page it or the docs link to exists, down to
the heading."""
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT

README = os.path.join(ROOT, "README.md")
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)
TWO_COMMANDS = "## The two commands"


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _examples(kind: str) -> list[str]:
    """The README's code blocks of one kind, outside "The two commands" (CI runs those)."""
    text = _read(README)
    start = text.index(TWO_COMMANDS)
    end = text.index("\n## ", start + len(TWO_COMMANDS))
    rest = text[:start] + text[end:]
    return [body for lang, body in BLOCK.findall(rest) if lang == kind]


@pytest.fixture
def example_dir(tmp_path):
    """A folder laid out as the checkout is, where the examples' relative paths resolve."""
    os.makedirs(tmp_path / "configs" / "examples")
    shutil.copy(os.path.join(ROOT, "configs", "examples", "cnn.onnx"), tmp_path / "configs" / "examples")
    return tmp_path


def test_the_readme_is_an_entry_point():
    lines = _read(README).splitlines()
    assert len(lines) < 300, f"README.md has {len(lines)} lines: the rest belongs in docs/"


def test_ci_runs_the_two_commands_verbatim():
    text = _read(README)
    block = BLOCK.search(text, text.index(TWO_COMMANDS)).group(2)
    commands = [line for line in block.splitlines() if line.strip() and not line.startswith("#")]
    assert len(commands) == 2
    ci = _read(os.path.join(ROOT, ".ci", "run"))
    for command in commands:
        assert command in ci, f".ci/run does not run the README's command: {command}"


def test_the_shell_examples_run_as_written(example_dir):
    blocks = _examples("sh")
    assert blocks, "the README shows the CLI"
    kiln = shutil.which("kiln", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    assert kiln, "`kiln` is not installed beside this Python: run `pip install .` first (README, command 1)"
    env = {**os.environ, "PATH": os.path.dirname(kiln) + os.pathsep + os.environ.get("PATH", "")}
    for block in blocks:
        r = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block], cwd=example_dir, env=env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"{block}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    assert os.path.exists(example_dir / "out" / "cnn" / "model.so")


def test_the_python_examples_run_as_written(example_dir):
    blocks = _examples("python")
    assert blocks, "the README shows the Python API"
    for i, block in enumerate(blocks):
        script = example_dir / f"example_{i}.py"
        script.write_text(block)
        r = subprocess.run([sys.executable, str(script)], cwd=example_dir, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, f"{block}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub renders it."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: str) -> set:
    text = BLOCK.sub("", _read(path))
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.*)$", text, re.M)}


def _pages() -> list[str]:
    docs = os.path.join(ROOT, "docs")
    return [README] + sorted(os.path.join(docs, n) for n in os.listdir(docs) if n.endswith(".md"))


@pytest.mark.parametrize("page", _pages(), ids=os.path.basename)
def test_every_link_names_a_file_and_heading_that_exist(page):
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", BLOCK.sub("", _read(page))):
        if re.match(r"\w+://", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        if not os.path.exists(resolved):
            missing.append(f"{target}: no such file")
        elif anchor and resolved.endswith(".md") and anchor not in _anchors(resolved):
            missing.append(f"{target}: no such heading")
    assert not missing, f"{os.path.relpath(page, ROOT)}: {missing}"
