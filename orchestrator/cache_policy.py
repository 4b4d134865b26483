"""What a build looks up in the store and what it writes back: policy, apart from the store
(artifacts.store, the mechanism).

- A build uses the user's default store, a given folder or Store, or none.
- A model is looked up whole (model_cache) unless its settings cannot be hashed faithfully
  or it must compile (custom passes, a pass context, fault injection, --verify-cache).
- Objects are stored as they compile, except those built with the fallback schedule: a
  slow object must never answer a normal lookup. A module or bundle built from one is not
  stored either.
- A read-only store reads and writes nothing back (pull-request CI); with a shared HTTP cache
  (artifacts.remote_store), read-only means the server is never written.
"""
from __future__ import annotations

import os
import warnings

from ..artifacts.leases import Leases
from ..artifacts.remote_store import RemoteStore, is_url
from ..artifacts.store import Store

from . import build_log, model_cache
from .options import DEFAULT_CACHE, BuildOptions, default_cache_dir


def open_store(cache, readonly: bool = False) -> Store | None:
    """The build's store: None, a Store given, or a folder (default: the user's cache folder);
    an http(s) URL (`cache` itself, or KILN_CACHE_URL) puts a shared HTTP cache behind the
    folder. Read-only with a URL: the server is never written; the local folder still keeps
    what was fetched and verified."""
    if cache is None or cache is False:
        return None
    if isinstance(cache, Store):
        return cache
    url = os.environ.get("KILN_CACHE_URL") or None
    if is_url(cache):
        url, cache = cache, DEFAULT_CACHE
    if cache == DEFAULT_CACHE:
        cache = default_cache_dir()
    try:
        if url:
            try:
                return RemoteStore(os.fspath(cache), url, remote_readonly=readonly)
            except ValueError as e:
                warnings.warn(f"kiln cache: {e}; using the local store only")
        return Store(os.fspath(cache), readonly=readonly)
    except OSError as e:  # a read-only place, a file where the folder should be: build without
        warnings.warn(f"kiln cache: cannot use '{cache}' as a store ({e.strerror or e}); building without a cache")
        return None


class CachePolicy:
    def __init__(self, options: BuildOptions):
        self.options = options
        self.store = open_store(options.cache, readonly=options.cache_readonly)
        self.writable = self.store is not None and not self.store.readonly

    def model_key(self, model, target, options: BuildOptions | None = None) -> str | None:
        """The whole-model key, or None where the model is not looked up whole. options: the
        model's own, where a batch entry has settings of its own."""
        o = options or self.options
        if self.store is None or o.bypasses_model_cache:
            return None
        key = self.untuned_model_key(model, target, o)
        if key is None:
            return None
        if not o.tuning:
            return model_cache.with_tuning(key, "off")
        summary = self.records(target).summary_digest(key)
        return key if summary is None else model_cache.with_tuning(key, summary)

    def untuned_model_key(self, model, target, options: BuildOptions | None = None) -> str | None:
        """The whole-model key before tuning enters it: what a tune's summary is filed under."""
        o = options or self.options
        memo = self.store.digests if self.writable else None
        return model_cache.model_key(model, target, o.opt_level, o.shapes, o.salt, memo, o.dims, o.precision,
                                     o.fp32_nodes, o.accuracy)

    def records(self, target):
        """The tuning records that apply to builds for `target` (orchestrator/tuning_records.py)."""
        from .tuning_records import Records
        return Records(self.store, target, self.options.tuning_threads)

    def find_bundle(self, key: str | None):
        """(files, report) of a bundle found whole, or None (a damaged entry is a miss)."""
        payload = self.store.get(key) if key else None
        if payload is None:
            return None
        try:
            return model_cache.unpack(payload, self.store)
        except (ValueError, KeyError):
            return None

    def prefetch(self, keys) -> None:
        """Ask a shared server for a batch's keys at once, before they are looked up one by one."""
        if self.store is not None:
            self.store.prefetch([k for k in keys if k])

    def leases(self) -> Leases | None:
        """The store's compile leases (artifacts/leases.py), where builders can share it."""
        if not self.writable:
            return None
        try:
            return Leases(self.store.root)
        except OSError:
            return None

    def find_object(self, key: str) -> bytes | None:
        return self.store.get(key) if self.store is not None else None

    def keep_object(self, result) -> None:
        if result.ok and self.writable and not result.fallback:
            self.store.put(result.key, result.object)

    def link_store(self, degraded: bool) -> Store | None:
        """The store the linked module may be cached in (none for one built from fallbacks)."""
        return None if degraded else self.store

    def keep_bundle(self, key: str | None, files: dict, report: dict, degraded: bool) -> None:
        if key and self.writable and not degraded:
            self.store.put(key, model_cache.pack(files, report, self.store))

    def log(self, model: str, kernels: list, hits: int, lookups: int) -> None:
        if self.writable:
            build_log.append(self.store.root, model, kernels, hits=hits, lookups=lookups)
