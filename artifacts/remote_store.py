"""A shared HTTP cache behind the local store: one store for a whole cluster, or for CI.

The server speaks the protocol Bazel's remote caches use over plain HTTP: `GET`, `PUT` and
`HEAD` on `PREFIX/cas/<sha256>` (content, named by its hash: bundle weights) and
`PREFIX/ac/<key>` (results, named by a cache key: objects, linked libraries, whole bundles).
nginx with WebDAV `PUT`, bazel-remote, or any object store behind such a gateway serves it.

Nothing from the server is trusted more than a local file: an `ac/` entry holds exactly the
bytes of a local store entry (magic, format, key, payload sha256 and length) and is checked as
one; a `cas/` file must hash to its name. Whatever fails is a miss and a warning.

The server is a help, never a dependency: every request has a deadline; a server that is down
or stalls is dropped for the rest of the process after its first failure (so a build pays one
timeout, not one per kernel), a server that refuses writes is only read from, and the build
goes on with its local folder. Read-only use (`cache_readonly`, for untrusted builds) never
writes to the server; the local folder in front still keeps what was verified.
"""
from __future__ import annotations

import hashlib
import http.client
import os
import time
import urllib.parse
import warnings
from concurrent.futures import ThreadPoolExecutor

from .store import Store, TemporaryBlob, mapped

DEFAULT_TIMEOUT_S = 5.0  # per request; KILN_CACHE_TIMEOUT overrides
# Lookups in flight at once when a build asks for a batch's keys: a build of 300 kernels
# against a server 20 ms away waited 6 s for its misses one request after another.
PREFETCH_CONNECTIONS = 8
_READ_CHUNK = 1 << 20


def _timeout_from_env() -> float:
    text = os.environ.get("KILN_CACHE_TIMEOUT", "")
    try:
        value = float(text) if text else DEFAULT_TIMEOUT_S
        if value > 0:
            return value
    except ValueError:
        pass
    warnings.warn(f"kiln cache: KILN_CACHE_TIMEOUT={text!r} is not a positive number of seconds; "
                  f"using {DEFAULT_TIMEOUT_S:.0f}")
    return DEFAULT_TIMEOUT_S


def is_url(cache) -> bool:
    return isinstance(cache, str) and cache.startswith(("http://", "https://"))


class HttpCache:
    """The client: one keep-alive connection, requests with deadlines, and the memory of a
    failure (after which it answers every read with a miss and drops every write)."""

    def __init__(self, url: str, timeout: float | None = None):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) cache URL: {url!r}")
        self.url = url.rstrip("/")
        self._https = parts.scheme == "https"
        self._host, self._port = parts.hostname, parts.port
        self._prefix = parts.path.rstrip("/")
        self.timeout = timeout or _timeout_from_env()
        self._conn = None
        self.down = ""  # why the server is no longer asked
        self.read_only = ""  # why it is no longer written to
        self._quiet = False

    def sibling(self) -> "HttpCache":
        """A client of the same server on a connection of its own (one per thread), which
        leaves warning of a failure to this one."""
        twin = HttpCache(self.url, self.timeout)
        twin.down, twin.read_only, twin._quiet = self.down, self.read_only, True
        return twin

    def _connection(self):
        if self._conn is None:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            self._conn = cls(self._host, self._port, timeout=self.timeout)
        return self._conn

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        """(status, body). A kept-alive connection the server has since closed is retried once
        on a new one; anything else raises OSError or http.client.HTTPException."""
        for attempt in (0, 1):
            reused = self._conn is not None
            try:
                return self._exchange(method, path, body)
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self._close()
                if attempt or not reused:
                    raise
            except BaseException:
                self._close()
                raise
        raise AssertionError("unreachable")

    def _exchange(self, method: str, path: str, body: bytes | None) -> tuple[int, bytes]:
        deadline = time.monotonic() + 4 * self.timeout  # each socket wait has `timeout`; the whole, this
        conn = self._connection()
        conn.request(method, f"{self._prefix}/{path}", body=body,
                     headers={"Content-Type": "application/octet-stream"} if body is not None else {})
        resp = conn.getresponse()
        chunks = []
        while True:
            chunk = resp.read(_READ_CHUNK)
            if not chunk:
                break
            chunks.append(chunk)
            if time.monotonic() > deadline:
                raise TimeoutError(f"the answer took longer than {4 * self.timeout:.0f} s")
        if resp.will_close:
            self._close()
        return resp.status, b"".join(chunks)

    def _fail(self, what: str, error: BaseException) -> None:
        self._close()
        self.down = f"{what}: {type(error).__name__}: {error}"
        if not self._quiet:
            self.warn_down()

    def warn_down(self) -> None:
        warnings.warn(f"kiln cache: {self.url} does not answer ({self.down}); building with the local "
                      "store only for the rest of this build")

    def get(self, path: str) -> bytes | None:
        if self.down:
            return None
        try:
            status, data = self._request("GET", path)
        except (OSError, http.client.HTTPException) as e:
            self._fail(f"GET {path}", e)
            return None
        if status == 200:
            return data
        if status != 404:
            warnings.warn(f"kiln cache: GET {self.url}/{path} answered HTTP {status}; treated as a miss")
        return None

    def has(self, path: str) -> bool:
        if self.down:
            return False
        try:
            return self._request("HEAD", path)[0] == 200
        except (OSError, http.client.HTTPException) as e:
            self._fail(f"HEAD {path}", e)
            return False

    def put(self, path: str, data: bytes) -> None:
        if self.down or self.read_only:
            return
        try:
            status, _ = self._request("PUT", path, data)
        except (OSError, http.client.HTTPException) as e:
            self._fail(f"PUT {path}", e)
            return
        if status not in (200, 201, 204):
            self.read_only = f"PUT {path} answered HTTP {status}"
            warnings.warn(f"kiln cache: {self.url} refused a write ({self.read_only}); reading from it only "
                          "for the rest of this build")


class RemoteStore(Store):
    """The local store at `root`, with the HTTP cache at `url` behind it: reads fall through
    to the server and what they fetch is kept locally; writes go to both (to the server only
    if not `remote_readonly`)."""

    def __init__(self, root: str, url: str, remote_readonly: bool = False, timeout: float | None = None):
        super().__init__(root)
        self.remote = HttpCache(url, timeout)
        self.remote_readonly = remote_readonly

    def get_view(self, key: str, section: str = "objects"):
        view = super().get_view(key, section)
        if view is not None:
            return view
        data = self.remote.get(f"ac/{key}")  # (records too: their keys are hashes of other parts)
        if data is None:
            return None
        payload, why = self.check(key, data)
        if payload is None:
            warnings.warn(f"kiln cache: {self.remote.url}/ac/{key} is invalid ({why}); compiling instead")
            return None
        super().put(key, payload, section)
        return payload

    def prefetch(self, keys, section: str = "objects") -> int:
        """Fetch the entries of `keys` missing from the local folder from the server, on
        PREFETCH_CONNECTIONS connections at once, verify them and keep them locally: the
        lookups that follow are local. A server that fails is dropped as on any request."""
        missing = [k for k in dict.fromkeys(keys) if not os.path.exists(self.path(k, section))]
        if not missing or self.remote.down:
            return 0
        lanes = min(PREFETCH_CONNECTIONS, len(missing))
        clients = [self.remote] + [self.remote.sibling() for _ in range(lanes - 1)]

        def fetch(lane: int) -> list:
            return [(k, clients[lane].get(f"ac/{k}")) for k in missing[lane::lanes]]
        with ThreadPoolExecutor(lanes, thread_name_prefix="kiln-cache") as pool:
            answers = [pair for lane in pool.map(fetch, range(lanes)) for pair in lane]
        if not self.remote.down and (why := next((c.down for c in clients if c.down), "")):
            self.remote.down = why  # one failed lane drops the server, with one warning
            self.remote.warn_down()
        for c in clients[1:]:
            c._close()
        fetched = 0
        for key, data in answers:
            payload, why = self.check(key, data) if data is not None else (None, "")
            if payload is not None:
                super().put(key, payload, section)
                fetched += 1
            elif data is not None:
                warnings.warn(f"kiln cache: {self.remote.url}/ac/{key} is invalid ({why}); compiling instead")
        return fetched

    def put(self, key: str, payload: bytes, section: str = "objects") -> None:
        super().put(key, payload, section)
        if not self.remote_readonly:
            self.remote.put(f"ac/{key}", self.encode(key, payload))

    def blob(self, digest: str) -> str | None:
        path = super().blob(digest)
        if path is not None:
            return path
        data = self.remote.get(f"cas/{digest}")
        if data is None:
            return None
        if hashlib.sha256(data).hexdigest() != digest:
            warnings.warn(f"kiln cache: {self.remote.url}/cas/{digest} does not match its name; ignored")
            return None
        super().put_blob(data)
        return super().blob(digest)

    def put_blob(self, data) -> str:
        digest = super().put_blob(data)
        if not self.remote_readonly and not self.remote.has(f"cas/{digest}"):
            local = self.blob_path(digest)
            if isinstance(data, TemporaryBlob) and os.path.isfile(local):  # (sent from the file, not memory)
                view = mapped(local)
                try:
                    with memoryview(view) as body:
                        self.remote.put(f"cas/{digest}", body)
                finally:
                    view.close()
            else:
                self.remote.put(f"cas/{digest}", bytes(data))
        return digest
