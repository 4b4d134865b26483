"""The suite against the newest releases: the check a maintainer runs before raising the pins
in tests/constraints.txt.

    python -m tests.newest_releases [--venv DIR] [--write-constraints] [PYTEST ARGS...]

Makes (or refreshes) a venv, default `.newest-venv` beside the checkout, installs Kiln with
its test extras at the newest versions pyproject.toml allows (no constraints), prints each
pinned package's pinned and installed version (what moved), then runs the README's test
command there. With --write-constraints, a green run rewrites the pins to what it ran with
(comments kept, the date line renewed). Exits with pytest's status.
"""
from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONSTRAINTS = os.path.join(ROOT, "tests", "constraints.txt")
_PIN = re.compile(r"^([A-Za-z0-9_.\-]+)==(\S+)\s*$")
_DATE_LINE = re.compile(r"^# Last raised \d{4}-\d{2}-\d{2}")


def canonical(name: str) -> str:
    """A package name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(text: str) -> dict[str, str]:
    """name -> pinned version, in the file's order."""
    return {canonical(m.group(1)): m.group(2) for line in text.splitlines() if (m := _PIN.match(line))}


def moved(pins: dict[str, str], installed: dict[str, str]) -> list[tuple[str, str, str]]:
    """(name, pinned, installed) for every pin whose installed version differs ('absent'
    where the package is no longer installed at all)."""
    return [(name, version, installed.get(name, "absent")) for name, version in pins.items()
            if installed.get(name) != version]


def rewritten(text: str, installed: dict[str, str], today: datetime.date) -> str:
    """The constraints file with each pin set to the installed version and the date renewed;
    every other line as it was."""
    out = []
    for line in text.splitlines():
        m = _PIN.match(line)
        if m and canonical(m.group(1)) in installed:
            line = f"{m.group(1)}=={installed[canonical(m.group(1))]}"
        elif _DATE_LINE.match(line):
            line = _DATE_LINE.sub(f"# Last raised {today.isoformat()}", line)
        out.append(line)
    return "\n".join(out) + "\n"


def _installed(python: str) -> dict[str, str]:
    listing = subprocess.run([python, "-m", "pip", "list", "--format", "json"], capture_output=True, text=True,
                             check=True).stdout
    return {canonical(p["name"]): p["version"] for p in json.loads(listing)}


def main(argv: list[str]) -> int:
    venv, write = os.path.join(ROOT, ".newest-venv"), False
    pytest_args = []
    args = iter(argv)
    for a in args:
        if a == "--venv":
            venv = os.path.abspath(next(args))
        elif a == "--write-constraints":
            write = True
        else:
            pytest_args.append(a)
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    subprocess.run([python, "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True)
    subprocess.run([python, "-m", "pip", "install", "-q", "--upgrade", "--upgrade-strategy", "eager",
                    f"{ROOT}[test]"], check=True)
    with open(CONSTRAINTS) as f:
        text = f.read()
    installed = _installed(python)
    changes = moved(read_pins(text), installed)
    print(f"{len(changes)} of {len(read_pins(text))} pinned packages moved" + (":" if changes else ""))
    for name, pinned, now in changes:
        print(f"  {name:24s} {pinned:>12s} -> {now}")
    subprocess.run(["sh", os.path.join(ROOT, "tests", "install_test_deps.sh")], check=True)
    status = subprocess.run([python, "-m", "pytest", "-q", "tests/", *pytest_args], cwd=ROOT).returncode
    if write and status == 0:
        with open(CONSTRAINTS, "w") as f:
            f.write(rewritten(text, installed, datetime.date.today()))
        print(f"raised the pins in {CONSTRAINTS}")
    elif write:
        print("the suite failed against the newest releases: the pins are unchanged")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
