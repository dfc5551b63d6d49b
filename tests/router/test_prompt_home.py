"""The prefix-aware router sends a prompt cached nowhere back to the rank it was last sent to, through the real
router and bench/stub_pods.py's pods (each an LRU pool of 24 blocks publishing its KV events with the daemon's
own publisher): a system prompt goes to pod X; X evicts it for prompts sent to it directly, behind the
router's back (X full, the other pod empty); sent again, the prompt goes back to X, where a prompt never sent
goes to the emptier pod."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import benchkit
from support import ROOT
from support.procs import stop, wait_for
from support.servers import MODEL, start_router, stop_router

STUB_PODS = benchkit.bench_module(ROOT / "bench" / "stub_pods.py")  # its start_stub_pods

BLOCKS = 24  # each stub pod's pool, blocks of 16 tokens
KV_BATCHES, DECISIONS = "kvpilot_router_kv_event_batches_total", "kvpilot_router_routing_decisions_total"


def _chat(url: str, system: str, user: str) -> tuple[str | None, dict]:
    """(the pod the router named, the reply) of a chat to `url`."""
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 4,
    }
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.headers.get("X-Kvpilot-Pod"), json.loads(r.read())


def _system(topic: str) -> str:
    return (
        f"You answer questions about {topic} for the shop, in one short sentence each time. " * 5
    )  # ~6 blocks


def test_a_prompt_evicted_everywhere_goes_back_to_its_pod(tmp_path: Path) -> None:
    pods, urls = STUB_PODS.start_stub_pods(2, tmp_path, kv_events=True, blocks=BLOCKS)
    router = None
    try:
        router = start_router(tmp_path, urls)
        x, first = _chat(router.url, _system("bicycles"), "Do you fix brakes?")
        assert x is not None and first["usage"]["prompt_tokens"] > 80, first
        x_url = next(u for u in urls if u.endswith(":" + x.rpartition(":")[2]))

        def indexed() -> dict[str, int]:
            return {p["pod"]: p["indexed_blocks"] for p in router.health()["pods"]}

        wait_for(lambda: indexed()[x] > 0, 30, "the first prompt's blocks indexed on its pod")

        def batches() -> float:  # KV event batches from x the router applied (the stub sends one a request)
            m = router.metrics()
            return sum(m.get(f'{KV_BATCHES}{{pod="{x}",result="{r}"}}', 0) for r in ("received", "replayed"))

        def cold_picks() -> float:
            m = router.metrics()
            return m.get(f'{DECISIONS}{{pod="{x}",policy="prefix-aware",reason="load"}}', 0)

        # Behind the router's back, other prompts fill x's pool: its events say the first prompt is gone.
        topics = ("kettles", "lamps", "tents", "skis", "maps")
        applied = batches()
        for topic in topics:
            _chat(x_url, _system(topic), "What do you sell?")
        wait_for(lambda: batches() >= applied + len(topics), 30, f"{x}'s events of the direct chats applied")
        assert indexed()[x] == BLOCKS and sum(indexed().values()) == BLOCKS  # x full, the other pod empty

        picked_cold = cold_picks()
        pod, again = _chat(router.url, _system("bicycles"), "Do you sell bells?")
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, again  # evicted: cold
        assert pod == x, (pod, indexed())  # back where it went, not to the empty pool
        assert cold_picks() == picked_cold + 1  # placed as cached nowhere, not as a stale hit
        pod, never_sent = _chat(router.url, _system("boats"), "Do you sell oars?")
        assert pod != x, (pod, indexed())  # a prompt never sent goes to the emptier pool
    finally:
        if router is not None:
            stop_router(router)
        for p in pods:
            stop(p)
