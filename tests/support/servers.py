"""Real `kvpilot serve` and `kvpilot router` processes on loopback, each in its own process group, and
the `fleet` fixture: two daemons publishing KV events with a router in front of them (tests/router and
tests/monitoring share it)."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from benchkit import samples
from support.procs import free_port, settled, spawn, stop, wait_for, wait_ready

ADMIN_TOKEN = "test-admin-token-4d1f"
MODEL = "SmolLM2-135M-Instruct"


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
        return samples(self.request("GET", "/metrics").body.decode())

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


class RouterProc(Server):
    """A `kvpilot router` process: the daemon test helpers (request, admin, metrics, log) apply as is."""

    def health(self) -> dict:
        return self.request("GET", "/health").json()

    def pod(self, name: str) -> dict:
        return next(p for p in self.health()["pods"] if p["pod"] == name)

    def indexed(self) -> dict[str, int]:
        """Each pod's indexed blocks, settled: a baseline taken before a request (`wait_indexed`'s), which
        the events of an earlier request, published on another socket than its reply, may still change."""
        return settled(
            lambda: {p["pod"]: p["indexed_blocks"] for p in self.health()["pods"]}, "indexed blocks"
        )

    def wait_indexed(self, pod: str, before: dict[str, int], timeout: float = 30) -> None:
        """Until the index holds more of `pod`'s blocks than `before` (a pod of a shared fleet may hold
        blocks of an earlier test: more than zero would not mean this request's events came). For a pod
        whose pool has room: one that evicts a block for each it stores keeps its count."""
        floor = before.get(pod, 0)
        wait_for(
            lambda: self.pod(pod)["indexed_blocks"] > floor,
            timeout,
            f"the router to index more than {floor} blocks of {pod}",
            interval=0.05,
        )


S = TypeVar("S", bound=Server)


def _launch(
    kind: type[S],
    tmp: Path,
    command: str,
    args: list[str],
    token: str | None,
    env: dict | None,
    ready: Callable[[S], object],
    timeout: float,
) -> S:
    """`python -m kvpilot COMMAND --host 127.0.0.1 --port FREE ARGS` in its own process group, with
    `token` as its admin token file and without the caller's $KVPILOT_ADMIN_TOKEN; returns once
    `ready(process)` holds."""
    port = free_port()
    argv = [sys.executable, "-m", "kvpilot", command, "--host", "127.0.0.1", "--port", str(port), *args]
    if token is not None:
        token_file = tmp / f"{command}-token-{port}"
        token_file.write_text(token + "\n")
        argv += ["--admin-token-file", str(token_file)]
    proc_env = {k: v for k, v in os.environ.items() if k != "KVPILOT_ADMIN_TOKEN"} | (env or {})
    log_path = tmp / f"{command}-{port}.log"
    process = kind(spawn(argv, log_path=log_path, env=proc_env), port, log_path, token)
    wait_ready(process.proc, lambda: ready(process), timeout, f"kvpilot {command}", log_path, interval=0.3)
    return process


def start_server(tmp: Path, *extra: str, token: str | None = None, env: dict | None = None) -> Server:
    args = ["--num-gpu-blocks-override", "256", "--max-model-len", "512", *extra]

    def ready(server: Server) -> bool:
        return server.request("GET", "/health", timeout=5).status == 200

    return _launch(Server, tmp, "serve", args, token, env, ready, timeout=300)


def stop_server(server: Server) -> None:
    """SIGTERM the daemon (or router) as Kubernetes would; its whole group is killed after 60 s."""
    stop(server.proc, grace=60, leader_only=True)


def start_daemon(tmp: Path, *extra: str, token: str | None = ADMIN_TOKEN, host: str = "127.0.0.1") -> Server:
    """A daemon publishing KV events (PUB and replay on free ports); `extra`: more `kvpilot serve` flags."""
    return start_server(
        tmp,
        "--host",
        host,
        "--kv-events-endpoint",
        f"tcp://{host}:{free_port()}",
        "--kv-events-replay-endpoint",
        f"tcp://{host}:{free_port()}",
        *extra,
        token=token,
    )


def transfer_config(role: str, port: int = 0) -> str:
    """`--kv-transfer-config` of a daemon in `role` (a producer serves pulls on `port`)."""
    extra = {"port": port} if role != "kv_consumer" else {}
    return json.dumps(
        {"kv_connector": "KvpilotConnector", "kv_role": role, "kv_connector_extra_config": extra}
    )


def start_pd_pair(tmp: Path) -> tuple[Server, Server]:
    """A prefill daemon (kv_producer, its transfer port free) and a decode daemon (kv_consumer), both
    publishing KV events (docs/disaggregation.md)."""
    prefill = start_daemon(tmp, "--kv-transfer-config", transfer_config("kv_producer", free_port()))
    decode = start_daemon(tmp, "--kv-transfer-config", transfer_config("kv_consumer"))
    return prefill, decode


def start_router(
    tmp: Path,
    endpoints: list[str] | None,
    *extra: str,
    token: str | None = ADMIN_TOKEN,
    all_pods: bool = True,
    env: dict | None = None,
    no_pod: bool = False,
) -> RouterProc:
    """Start a router; return once every pod is ready and its KV events synced (or, with `all_pods`
    false, once the router serves at all; with `no_pod`, once it answers /health, no pod ready)."""
    args = [*extra, *(["--endpoints", ",".join(endpoints)] if endpoints is not None else [])]

    def ready(router: RouterProc) -> bool:
        h = router.health()
        pods = h["pods"]
        return (
            bool(pods and all(p["ready"] and p["synced"] for p in pods))
            or (not all_pods and h["status"] == "ok")
            or no_pod
        )

    return _launch(RouterProc, tmp, "router", args, token, env, ready, timeout=120)


def stop_router(router: RouterProc) -> None:
    stop_server(router)
    assert "Traceback" not in router.log(), router.log()[-4000:]


def stop_fleet(router: RouterProc | None, daemons: list[Server]) -> None:
    """Stop the router (which raises on a traceback in its log) and, whatever it raised, the daemons."""
    try:
        if router is not None:
            stop_router(router)
    finally:
        for d in daemons:
            stop_server(d)


def greedy_chat(srv: Server, text: str) -> tuple[str, int]:
    """One greedy 16-token chat of a user message: its text and its cached prompt tokens."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 16,
        "temperature": 0,
    }
    r = srv.request("POST", "/v1/chat/completions", body, timeout=300)
    assert r.status == 200, r.body
    doc = r.json()
    return doc["choices"][0]["message"]["content"], doc["usage"]["prompt_tokens_details"]["cached_tokens"]


def wait_idle(*servers: Server) -> None:
    """Wait until no request an earlier test started is running or waiting on any of `servers`."""
    deadline = time.monotonic() + 60
    for s in servers:
        while (c := s.cache())["num_running"] or c["num_waiting"]:
            assert time.monotonic() < deadline, c
            time.sleep(0.2)


def probe_health(server: Server, stop: threading.Event, out: list[float]) -> None:
    """GET /health on one kept-alive connection until `stop`, each answer's latency appended to `out`
    (run it in a thread while the server is busy)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    while not stop.is_set():
        start = time.perf_counter()
        conn.request("GET", "/health")
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 200
        out.append(time.perf_counter() - start)
        # Often enough for several probes while the work is done: on a quiet machine that takes only tens
        # of milliseconds.
        time.sleep(0.002)
    conn.close()


def send_completion(port: int, max_tokens: int, stream: bool, host: str = "127.0.0.1") -> socket.socket:
    """POST a greedy /v1/completions that ignores eos on a raw socket, so that the test can hang up."""
    body = json.dumps(
        {
            "model": MODEL,
            "prompt": "Count slowly: one, two,",
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": stream,
        }
    ).encode()
    sock = socket.create_connection((host, port), timeout=60)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return sock


def read_until_decoding(sock: socket.socket) -> bytes:
    """Read a streamed reply until its first two tokens came in (the request is decoding); returns what
    was read, the response head included."""
    received = b""
    while received.count(b"data: ") < 2:
        chunk = sock.recv(65536)
        assert chunk, received
        received += chunk
    return received


def stream_with_usage(create: Callable, **kw: object) -> list:
    """A greedy streamed request of 8 tokens whose last chunk carries the usage, as a list of chunks;
    `create` is an openai client's `completions.create` or `chat.completions.create`."""
    return list(
        create(
            model=MODEL,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            **kw,
        )
    )


@dataclass
class Fleet:
    daemons: list[Server]
    router: RouterProc

    def by_name(self, name: str) -> Server:
        return next(d for d in self.daemons if f"127.0.0.1:{d.port}" == name)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Two daemons and their router, per module: its three users are each in a group of their own (so on any
    worker), and a session's fleet stayed up (~3 GB) on each worker until the run ended."""
    tmp = tmp_path_factory.mktemp("fleet")
    daemons = [start_daemon(tmp), start_daemon(tmp)]
    router = None
    try:
        router = start_router(tmp, [d.url for d in daemons])
        yield Fleet(daemons, router)
    finally:
        stop_fleet(router, daemons)
    for d in daemons:
        assert "Traceback" not in d.log(), d.log()[-4000:]


@pytest.fixture
def quiet_fleet(fleet: Fleet) -> Fleet:
    """The shared fleet with no request left running on any pod by an earlier test."""
    wait_idle(*fleet.daemons)
    return fleet


def check_repeats_stick_to_one_pod(
    client: Any, daemons: list[Server], subject: str, questions: tuple[str, ...]
) -> None:
    """Chats sharing a long system prompt about `subject`, sent through a text-tree router (sglang-router's
    and smg's `cache_aware`), all go to one pod, which serves the shared prefix from its cache: each
    daemon's own /prefix_cache says one looked up every prompt and hit, the other saw none."""
    before = [d.cache() for d in daemons]
    system = f"Conversation {uuid.uuid4().hex}: you are a terse assistant of {subject}. " * 4
    cached = []
    for question in questions:
        c = client.chat.completions.create(
            model=MODEL,
            max_tokens=2,
            temperature=0,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        )
        cached.append(c.usage.prompt_tokens_details.cached_tokens)
    after = [d.cache() for d in daemons]
    queried = [a["query_tokens"] - b["query_tokens"] for a, b in zip(after, before, strict=True)]
    hits = [a["hit_tokens"] - b["hit_tokens"] for a, b in zip(after, before, strict=True)]
    assert sorted(q > 0 for q in queried) == [False, True], (queried, hits, cached)
    assert max(hits) == sum(cached) and min(hits) == 0, (hits, cached)
    assert cached[0] == 0 and all(n >= 48 for n in cached[1:]), cached  # the shared prefix, cached


@contextmanager
def router_in_front(
    argv: list[str], tmp: Path, daemons: list[Server], ready: Callable[[], bool], name: str, **spawn_args: Any
) -> Iterator[Path]:
    """A third-party router (`argv`) in front of `daemons`, run from `tmp`, outside the checkout, as a user
    runs it; yields its log's path once `ready()`. Afterwards the router and the daemons are stopped, and
    no daemon may have logged a traceback."""
    log_path = tmp / f"{name}.log"
    proc = spawn(argv, log_path=log_path, cwd=tmp, **spawn_args)
    try:
        wait_ready(proc, ready, 120, name, log_path)
        yield log_path
    finally:
        stop(proc, grace=10)
        for d in daemons:
            stop_server(d)
    for d in daemons:
        assert "Traceback" not in d.log(), d.log()[-4000:]
