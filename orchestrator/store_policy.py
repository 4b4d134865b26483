"""Which store a build uses: the default per-user folder, a given folder, or none."""
from __future__ import annotations

import os

from artifacts.store import Store

DEFAULT_CACHE = "__kiln_default_cache__"


def default_cache_dir() -> str:
    if os.environ.get("KILN_CACHE_DIR"):
        return os.environ["KILN_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kiln")


def open_store(cache, readonly: bool = False) -> Store | None:
    if cache is None or cache is False:
        return None
    if isinstance(cache, Store):
        return cache
    if cache == DEFAULT_CACHE:
        cache = default_cache_dir()
    return Store(os.fspath(cache), readonly=readonly)
