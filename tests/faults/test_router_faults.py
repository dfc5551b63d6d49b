"""The router under faults of its pods and of itself, with real `kvpilot serve` daemons (the embedded model,
real ZeroMQ KV events) on loopback: a daemon killed while the router streams from it, and the router
restarted under load. Nothing is lost: the client gets a clean end, the index forgets a dead pod, and a
restarted router rebuilds its index from the daemons' replay sockets while every request that had not
started is served."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest
from fault_figures import record

from support.procs import spawn, wait_for, wait_ready
from support.servers import (
    MODEL,
    RouterProc,
    Server,
    start_daemon,
    start_router,
    stop_fleet,
    stop_server,
    wait_idle,
)

pytestmark = [pytest.mark.timeout(600)]

# Long enough to fill several KV blocks, so the router indexes something for the pod that serves it.
PROMPT = "A fault test's prompt, long enough to fill a few blocks of the prefix cache. " * 8


@pytest.fixture
def pods(tmp_path) -> Iterator[list[Server]]:
    daemons = [start_daemon(tmp_path), start_daemon(tmp_path)]
    yield daemons
    for d in daemons:
        if d.proc.poll() is None:
            stop_server(d)


def completion(prompt: str, max_tokens: int, stream: bool) -> bytes:
    return json.dumps(
        {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": stream,
        }
    ).encode()


def indexed(router: RouterProc, pod: str) -> int:
    return router.pod(pod)["indexed_blocks"]


def test_daemon_killed_mid_stream(tmp_path, pods: list[Server]) -> None:
    """SIGKILL of the daemon a streamed completion runs on: the client's stream ends with an OpenAI-shaped
    error event and a proper end of the chunked body; the router marks the pod not ready and forgets its
    index entries within seconds."""
    router = start_router(tmp_path, [d.url for d in pods])
    try:
        conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=120)
        conn.request(
            "POST", "/v1/completions", completion(PROMPT, 300, True), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        assert resp.status == 200
        victim = resp.getheader("X-Kvpilot-Pod")
        daemon = next(d for d in pods if f"127.0.0.1:{d.port}" == victim)
        got = b""
        while b"data: " not in got:  # read1 keeps http.client's chunked decoding in step
            chunk = resp.read1(65536)
            assert chunk, got
            got += chunk
        wait_for(lambda: indexed(router, victim) > 0, 30, "the prompt's blocks indexed for the pod")
        os.killpg(daemon.proc.pid, signal.SIGKILL)
        t_kill = time.monotonic()
        rest = resp.read()  # http.client undoes the chunking; raises IncompleteRead on a torn body
        t_eof = time.monotonic()
        events = [ln[6:] for ln in rest.split(b"\n") if ln.startswith(b"data: ")]
        last = json.loads(events[-1])
        assert last["error"]["code"] == "bad_gateway" and victim in last["error"]["message"], last
        wait_for(lambda: not router.pod(victim)["ready"], 30, "the router to mark the killed pod not ready")
        t_unready = time.monotonic()
        blocks_left = indexed(router, victim)
        wait_for(lambda: indexed(router, victim) == 0, 30, "the killed pod's index entries dropped")
        t_dropped = time.monotonic()
        record(
            "daemon_killed_mid_stream",
            stream_ended_after_kill_s=round(t_eof - t_kill, 2),
            pod_unready_after_kill_s=round(t_unready - t_kill, 2),
            index_dropped_after_kill_s=round(t_dropped - t_kill, 2),
            blocks_indexed_at_unready=blocks_left,
        )
    finally:
        stop_fleet(router, [])


class Load:
    """Clients sending short completions through the router in a loop. A refused connection never reached
    the router (nothing started) and is retried; anything else is counted as it came."""

    def __init__(self, port: int, clients: int = 3) -> None:
        self.port, self.stop = port, threading.Event()
        self.ok = self.refused = 0
        self.failed: list[str] = []  # requests that had started (sent) and did not get a 200
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)

    def _client(self, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            body = completion(f"Client {i} asks question {n % 5}: " + PROMPT, 4, False)
            while True:
                try:
                    status = self._send(body)
                except ConnectionRefusedError:
                    with self.lock:
                        self.refused += 1
                    time.sleep(0.1)
                    continue
                except OSError as exc:
                    status = f"{type(exc).__name__}: {exc}"
                break
            with self.lock:
                if status == 200:
                    self.ok += 1
                else:
                    self.failed.append(str(status))

    def _send(self, body: bytes) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        try:
            conn.connect()  # a refusal here raises ConnectionRefusedError: nothing was sent
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            resp.read()
            return resp.status
        finally:
            conn.close()


def restart(router: RouterProc) -> tuple[RouterProc, float]:
    """SIGTERM the router as Kubernetes would, start it again with the same argv on the same port; returns
    the new one and the seconds until every pod was ready and synced (its index rebuilt from replay)."""
    argv, env = router.proc.args, {k: v for k, v in os.environ.items() if k != "KVPILOT_ADMIN_TOKEN"}
    t0 = time.monotonic()
    stop_server(router)
    assert "Traceback" not in router.log(), router.log()[-4000:]
    new = RouterProc(
        spawn(argv, log_path=router.log_path, env=env), router.port, router.log_path, router.token
    )

    def synced() -> bool:
        pods = new.health()["pods"]
        return bool(pods) and all(p["ready"] and p["synced"] for p in pods)

    wait_ready(new.proc, synced, 120, "the restarted router", router.log_path, interval=0.2)
    return new, time.monotonic() - t0


def test_router_restarted_under_load(tmp_path, pods: list[Server]) -> None:
    router = start_router(tmp_path, [d.url for d in pods])
    try:
        with Load(router.port) as load:
            wait_for(lambda: load.ok >= 6, 120, "requests served before the restart")
            router, took_under_load = restart(router)
            served_before = load.ok
            wait_for(lambda: load.ok >= served_before + 6, 120, "requests served after the restart")
        # A request on a connection the stopping router closed: cut off while sent (BrokenPipeError) or read
        # (reset, disconnected), never answered with an error of the router's.
        cut = ("RemoteDisconnected", "ConnectionResetError", "BrokenPipeError")
        assert not [f for f in load.failed if not f.startswith(cut)], load.failed
        assert len(load.failed) <= len(load.threads), load.failed  # at most the ones in flight at SIGTERM
        wait_idle(*pods)
        before = router.indexed()
        assert sum(before.values()) > 0, before
        router, took_idle = restart(router)
        after = router.indexed()
        assert after == before, (before, after)  # the index rebuilt from the daemons' replay alone
        record(
            "router_restarted_under_load",
            clients=len(load.threads),
            served=load.ok,
            refused_then_retried=load.refused,
            in_flight_lost=len(load.failed),
            ready_and_synced_after_sigterm_under_load_s=round(took_under_load, 2),
            ready_and_synced_after_sigterm_idle_s=round(took_idle, 2),
            blocks_rebuilt_from_replay=after,
        )
    finally:
        stop_fleet(router, [])
