"""A router following pods whose KV event publishers restart again and again under traffic: it lives on,
and follows each restarted stream from its start.

The pods are bench/stub_pods.py's (each port keeps a prefix cache and publishes it with the daemon's own
KVEventPublisher; `POST /stub/restart` closes that publisher and binds a new one on the same endpoints,
as a restarted daemon does, its sequence from 0), so a restart takes milliseconds, not a model load: the
router's subscriber sees its connection drop while batches are in flight. Before the router opened a new
socket on each drop, libzmq aborted its process within a few such restarts ("Assertion failed: !_more
(src/fq.cpp:80)", libzmq 4.3.5)."""

from __future__ import annotations

import concurrent.futures
import json
import urllib.request
from pathlib import Path

import benchkit
from support import ROOT
from support.procs import stop, wait_for
from support.servers import MODEL, start_router, stop_router

STUB_PODS = benchkit.bench_module(ROOT / "bench" / "stub_pods.py")  # its start_stub_pods

SYSTEM = "You are the help desk of a bicycle shop. " * 12  # ~110 tokens: several blocks of 16


def _post(url: str, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else b""
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def _chat(router_url: str, i: int) -> dict:
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": f"{SYSTEM} Desk {i % 4}."},
            {"role": "user", "content": f"Question {i}: do you fix brakes?"},
        ],
        "max_tokens": 4,
    }
    return _post(router_url + "/v1/chat/completions", body)


def test_the_router_outlives_pods_restarting_under_traffic(tmp_path: Path) -> None:
    pods, urls = STUB_PODS.start_stub_pods(2, tmp_path, kv_events=True, blocks=64)
    router = None
    try:
        router = start_router(tmp_path, urls)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            for round_ in range(30):
                chats = [pool.submit(_chat, router.url, round_ * 8 + k) for k in range(8)]
                _post(urls[round_ % 2] + "/stub/restart")
                concurrent.futures.wait(chats, timeout=60)
                assert router.proc.poll() is None, router.log()[-3000:]
                for c in chats:
                    assert c.result()["usage"]["prompt_tokens"] > 0
        assert router.log().count("starting over (connection to the pod dropped)") >= 3, router.log()[-3000:]

        # the restarted streams are followed again from their start (their sequence from 0): once the router
        # has dropped both pods' old entries, a new prompt's blocks are indexed (a router that missed a
        # restart would take the new batches for ones it had applied, and index nothing)
        for url in urls:
            _post(url + "/stub/restart")
        wait_for(
            lambda: all(p["synced"] and p["indexed_blocks"] == 0 for p in router.health()["pods"]),
            30,
            "both streams followed again, the old entries dropped",
        )
        reply = _chat(router.url, 1000)
        assert reply["usage"]["prompt_tokens"] > 100
        wait_for(
            lambda: sum(p["indexed_blocks"] for p in router.health()["pods"]) > 0,
            30,
            "the new prompt's blocks indexed",
        )
    finally:
        if router is not None:
            stop_router(router)
        for p in pods:
            stop(p)
