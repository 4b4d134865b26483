"""HTTP cache servers for the remote-store tests, on 127.0.0.1.

- Nginx: a real nginx with WebDAV PUT, as many teams serve Bazel caches (CI installs the
  Debian package; see tests/install_test_deps.sh).
- FaultyServer: a small standard-library server for the faults a real one rarely shows on
  demand: corrupt bytes, a stall, refused writes.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_port(port: int, proc: subprocess.Popen, log: str) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"nginx exited ({proc.returncode}): {open(log).read()[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nginx did not listen on {port}")


class Nginx:
    """nginx serving `folder/data` with GET, HEAD and PUT (WebDAV) at http://127.0.0.1:PORT."""

    CONFIG = """
daemon off;
master_process off;
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 64; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    client_max_body_size 1g;
    server {{
        listen 127.0.0.1:{port};
        root {dir}/data;
        location / {{
            dav_methods PUT;
            create_full_put_path on;
        }}
    }}
}}
"""

    def __init__(self, folder: str):
        binary = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
        if binary is None:
            raise RuntimeError("the remote-cache tests need nginx: run tests/install_test_deps.sh "
                               "(apt-get install nginx-light)")
        self.dir, self.port = folder, _free_port()
        self.data = os.path.join(folder, "data")
        os.makedirs(self.data)
        conf = os.path.join(folder, "nginx.conf")
        with open(conf, "w") as f:
            f.write(self.CONFIG.format(dir=folder, port=self.port))
        log = os.path.join(folder, "error.log")
        open(log, "w").close()
        self.proc = subprocess.Popen([binary, "-p", folder, "-e", log, "-c", conf], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.STDOUT)
        _wait_for_port(self.port, self.proc, log)
        self.url = f"http://127.0.0.1:{self.port}/kiln"

    def files(self, kind: str) -> list[str]:
        """The names stored under /kiln/<kind> ('cas' or 'ac')."""
        folder = os.path.join(self.data, "kiln", kind)
        return sorted(os.listdir(folder)) if os.path.isdir(folder) else []

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


class FaultyServer:
    """An in-memory cache server with one fault at a time: `corrupt` (every GET answers the
    stored bytes with one flipped), `stall` (no request is ever answered), `refuse_writes`
    (PUT answers 403). `fault = None` serves correctly."""

    def __init__(self):
        self.entries: dict[str, bytes] = {}
        self.fault: str | None = None
        self.requests: list[str] = []
        self.get_delay_s = 0.0  # each GET's answer waits this long: lookups in flight overlap
        self.most_in_flight = 0  # the most GETs the server was answering at once
        self._in_flight = 0
        self._lock = threading.Lock()
        self._release = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _stall(self) -> bool:
                if server.fault == "stall":
                    server._release.wait(60)
                    self.close_connection = True
                    return True
                return False

            def _answer(self, status: int, body: bytes = b"", head: bool = False) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def do_GET(self):
                server.requests.append(f"GET {self.path}")
                if self._stall():
                    return
                with server._lock:
                    server._in_flight += 1
                    server.most_in_flight = max(server.most_in_flight, server._in_flight)
                time.sleep(server.get_delay_s)
                with server._lock:
                    server._in_flight -= 1
                data = server.entries.get(self.path)
                if data is None:
                    return self._answer(404)
                if server.fault == "corrupt":
                    data = data[:-1] + bytes([data[-1] ^ 0xFF])
                self._answer(200, data)

            def do_HEAD(self):
                server.requests.append(f"HEAD {self.path}")
                if self._stall():
                    return
                self._answer(200 if self.path in server.entries else 404, head=True)

            def do_PUT(self):
                server.requests.append(f"PUT {self.path}")
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self._stall():
                    return
                if server.fault == "refuse_writes":
                    return self._answer(403)
                server.entries[self.path] = body
                self._answer(201)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/kiln"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
