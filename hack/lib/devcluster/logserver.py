"""The node agent's tiny kubelet API: enough for `kubectl logs` (and -f).

kube-apiserver serves `pods/log` by calling the kubelet at the Node's
InternalIP and `daemonEndpoints.kubeletEndpoint.Port`:
GET /containerLogs/<namespace>/<pod>/<container>?tailLines=&follow=&limitBytes=
This server answers that from the container's log file. It requires a client
certificate signed by the cluster CA (the apiserver has one, see pki.py), so
other local processes cannot read pod logs through it.
"""

from __future__ import annotations

import http.server
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path

# (namespace, pod, container) -> log file, or None if no such container here.
LogLookup = Callable[[str, str, str], Path | None]


def _tail(data: bytes, lines: int) -> bytes:
    if lines <= 0:
        return b""
    parts = data.splitlines(keepends=True)
    return b"".join(parts[-lines:])


class _Handler(http.server.BaseHTTPRequestHandler):
    lookup: LogLookup
    still_running: Callable[[str, str], bool]

    def log_message(self, fmt: str, *args: object) -> None:  # keep the agent log quiet
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        url = urllib.parse.urlsplit(self.path)
        parts = url.path.strip("/").split("/")
        if url.path == "/healthz":
            return self._reply(200, b"ok")
        if len(parts) != 4 or parts[0] != "containerLogs":
            return self._reply(
                404, b"only /containerLogs/<ns>/<pod>/<container> is served by the kvpilot node agent\n"
            )
        ns, pod, container = parts[1:]
        q = urllib.parse.parse_qs(url.query)
        path = self.lookup(ns, pod, container)
        if path is None:
            return self._reply(404, f"container {container} of pod {ns}/{pod} is not running here\n".encode())
        data = path.read_bytes() if path.exists() else b""
        if "tailLines" in q:
            data = _tail(data, int(q["tailLines"][0]))
        limit = int(q["limitBytes"][0]) if "limitBytes" in q else None
        if limit is not None:
            data = data[:limit]
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(data)
        if q.get("follow", ["false"])[0] != "true":
            return
        offset = path.stat().st_size if path.exists() else 0
        try:  # follow until the client goes away or the pod stops
            while self.still_running(ns, pod):
                time.sleep(0.2)
                size = path.stat().st_size if path.exists() else 0
                if size > offset:
                    with open(path, "rb") as f:
                        f.seek(offset)
                        chunk = f.read(size - offset)
                    offset = size
                    self.wfile.write(chunk)
                    self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _reply(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class LogServer:
    """HTTPS on (ip, free port), client certs checked against the cluster CA."""

    def __init__(
        self,
        ip: str,
        cert: Path,
        key: Path,
        client_ca: str,
        lookup: LogLookup,
        running: Callable[[str, str], bool],
    ) -> None:
        handler = type(
            "Handler", (_Handler,), {"lookup": staticmethod(lookup), "still_running": staticmethod(running)}
        )
        self.httpd = http.server.ThreadingHTTPServer((ip, 0), handler)
        self.httpd.daemon_threads = True
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        ctx.load_verify_locations(cafile=client_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
        self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="logserver", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
