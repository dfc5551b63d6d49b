"""A real `kvpilot serve` subprocess on loopback with the embedded model, shared by the server tests."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ADMIN_TOKEN = "test-admin-token-4d1f"
MODEL = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Response:
    status: int
    headers: dict
    body: bytes

    def json(self) -> dict:
        return json.loads(self.body)


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log_path: Path
    token: str | None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def request(
        self,
        method: str,
        path: str,
        body: bytes | dict | list | None = None,
        headers: dict | None = None,
        timeout: float = 120.0,
    ) -> Response:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            raw = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
            hdrs = {"Content-Type": "application/json", **(headers or {})}
            conn.request(method, path, body=raw, headers=hdrs)
            resp = conn.getresponse()
            return Response(resp.status, dict(resp.getheaders()), resp.read())
        finally:
            conn.close()

    def admin(self) -> dict:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def reset(self, **query: str) -> dict:
        qs = "&".join(f"{k}={v}" for k, v in query.items())
        r = self.request("POST", "/reset_prefix_cache" + (f"?{qs}" if qs else ""), headers=self.admin())
        assert r.status == 200, r.body
        return r.json()

    def cache(self) -> dict:
        r = self.request("GET", "/prefix_cache")
        assert r.status == 200, r.body
        return r.json()

    def metrics(self) -> dict[str, float]:
        """Samples of /metrics as {'name{labels}': value}."""
        text = self.request("GET", "/metrics").body.decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_server(tmp: Path, *extra: str, token: str | None = None, env: dict | None = None) -> Server:
    port = free_port()
    log_path = tmp / f"serve-{port}.log"
    args = [sys.executable, "-m", "kvpilot", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--num-gpu-blocks-override", "256", "--max-model-len", "512", *extra]  # fmt: skip
    if token is not None:
        token_file = tmp / f"token-{port}"
        token_file.write_text(token + "\n")
        args += ["--admin-token-file", str(token_file)]
    proc_env = {**os.environ, **(env or {})}
    proc_env.pop("KVPILOT_ADMIN_TOKEN", None)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=proc_env)
    server = Server(proc, port, log_path, token)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvpilot serve exited with {proc.returncode}:\n{server.log()}")
        try:
            if server.request("GET", "/health", timeout=5).status == 200:
                return server
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"kvpilot serve did not become healthy:\n{server.log()}")


def stop_server(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(60)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Server:
    srv = start_server(tmp_path_factory.mktemp("serve"), token=ADMIN_TOKEN)
    yield srv
    stop_server(srv)
    assert "Traceback" not in srv.log(), srv.log()[-4000:]


@pytest.fixture
def quiet(server: Server) -> Server:
    """The shared server, checked idle: no request left running by an earlier test."""
    deadline = time.monotonic() + 60
    while (c := server.cache())["num_running"] or c["num_waiting"]:
        assert time.monotonic() < deadline, c
        time.sleep(0.2)
    return server


@pytest.fixture(scope="module")
def client(server: Server):  # noqa: ANN201
    """The official openai client on the shared server."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
