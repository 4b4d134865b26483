"""Which LLVM command-line options exist, so a misspelled one is an error, not a no-op.

llvmlite's set_option ignores unknown options silently. LLVM's own `-help-list-hidden`
prints every registered option and exits the process, so we ask a throwaway interpreter
(never a process that compiles) once per driver process, only when a target sets options.
"""
from __future__ import annotations

import functools
import re
import subprocess
import sys

from ..ir.errors import KilnError

_LIST = ("import llvmlite.binding as l; l.initialize_all_targets(); l.initialize_all_asmprinters(); "
         "l.set_option('kiln', '-help-list-hidden')")
_NAME = re.compile(r"^  -{1,2}([A-Za-z0-9][\w.-]*)")


@functools.lru_cache(maxsize=1)
def registered_options() -> frozenset:
    proc = subprocess.run([sys.executable, "-c", _LIST], capture_output=True, text=True, timeout=120)
    names = {m.group(1) for line in proc.stdout.splitlines() if (m := _NAME.match(line))}
    if len(names) < 100:  # the listing failed; refuse to guess
        raise KilnError(f"could not list LLVM's options to check them: {proc.stderr.strip()[-300:]}")
    return frozenset(names)


def check_options(options, where: str) -> None:
    """Raise KilnError naming the first option LLVM does not know."""
    for opt in options:
        name = opt.lstrip("-").split("=", 1)[0]
        if not opt.startswith("-") or not name:
            raise KilnError(f"{where}: LLVM option {opt!r} must look like -name or -name=value")
        if name not in registered_options():
            raise KilnError(f"{where}: unknown LLVM option {opt!r} (LLVM would ignore it silently)")
