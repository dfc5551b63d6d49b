"""The real `sglang-router` (SGLang's router, from PyPI: `make sglang-router`) in front of two kvpilot
daemons: it re-sends every request with its own defaults (`separate_reasoning`, `no_stop_trim`,
`return_hidden_states`, `max_completion_tokens`, ...), and chats, completions and streams come through;
its cache-aware policy sends a repeated prompt to the pod that cached it."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from support.procs import free_port
from support.servers import (
    MODEL,
    Server,
    check_repeats_stick_to_one_pod,
    router_in_front,
    start_server,
)
from support.vllm_client import tools_bin

pytestmark = pytest.mark.timeout(600)

HEADER = "x-kvpilot-ignored-fields"


@pytest.fixture(scope="module")
def sglang_router_bin() -> str:
    return tools_bin("sglang-router")


@dataclass
class SglangFleet:
    daemons: list[Server]
    url: str
    log_path: Path

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _workers_healthy(port: int) -> bool:
    """The router answers and counts both workers healthy (its /readiness)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/readiness")
        resp = conn.getresponse()
        body = resp.read()
        return resp.status == 200 and json.loads(body).get("healthy_workers") == 2
    finally:
        conn.close()


@pytest.fixture(scope="module")
def sglang_fleet(sglang_router_bin: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SglangFleet]:
    tmp = tmp_path_factory.mktemp("sglang")
    daemons = [start_server(tmp), start_server(tmp)]
    port = free_port()
    argv = [
        sglang_router_bin,
        "launch",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *(d.url for d in daemons),
        "--policy",
        "cache_aware",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
    ]
    with router_in_front(argv, tmp, daemons, lambda: _workers_healthy(port), "sglang-router") as log_path:
        yield SglangFleet(daemons, f"http://127.0.0.1:{port}", log_path)


def test_chat_through_sglang_router(sglang_fleet: SglangFleet) -> None:
    raw = sglang_fleet.client().chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=4, temperature=0
    )
    c = raw.parse()
    assert c.choices[0].message.content and 1 <= c.usage.completion_tokens <= 4, c
    # Every field sglang-router adds is one kvpilot knows: none is ignored.
    assert HEADER not in raw.headers, raw.headers


def test_completion_through_sglang_router(sglang_fleet: SglangFleet) -> None:
    c = sglang_fleet.client().completions.create(
        model=MODEL, prompt="The sky is", max_tokens=4, temperature=0
    )
    assert c.choices[0].text and c.usage.completion_tokens == 4, c


def test_streams_through_sglang_router(sglang_fleet: SglangFleet) -> None:
    client = sglang_fleet.client()
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            temperature=0,
            stream=True,
        )
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    pieces = list(
        client.completions.create(
            model=MODEL, prompt="One, two,", max_tokens=4, stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(p.choices[0].text for p in pieces if p.choices)
    assert pieces[-1].usage.completion_tokens == 4


def test_cache_aware_policy_sends_repeats_to_one_pod(sglang_fleet: SglangFleet) -> None:
    questions = ("When do you open?", "How much is a tyre?", "Do you fix brakes?", "Any bells?")
    check_repeats_stick_to_one_pod(sglang_fleet.client(), sglang_fleet.daemons, "a bicycle shop", questions)


def test_flush_cache_through_sglang_router_resets_every_daemon(sglang_fleet: SglangFleet) -> None:
    """sglang-router's /flush_cache sends SGLang's /flush_cache to every worker: each daemon resets (its
    cache epoch moves on), as vLLM's /reset_prefix_cache would."""
    before = [d.request("GET", "/prefix_cache").json()["epoch"] for d in sglang_fleet.daemons]
    conn = http.client.HTTPConnection(sglang_fleet.url.removeprefix("http://"), timeout=60)
    try:
        conn.request("POST", "/flush_cache")
        resp = conn.getresponse()
        body = resp.read()
    finally:
        conn.close()
    assert resp.status == 200, body
    after = [d.request("GET", "/prefix_cache").json()["epoch"] for d in sglang_fleet.daemons]
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1], (before, after, body)
