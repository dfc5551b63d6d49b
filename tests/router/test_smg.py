"""The real `smg` 1.13 (a Rust gateway from PyPI: `make smg`) in front of two kvpilot daemons with its
`cache_aware` policy (a tree of request texts: it reads no KV events from HTTP workers): chats and
streams come through, and a repeated conversation prefix sticks to the pod that cached it."""

from __future__ import annotations

import http.client
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

pytestmark = pytest.mark.timeout(300)

HEADER = "x-kvpilot-ignored-fields"


@dataclass
class SmgFleet:
    daemons: list[Server]
    url: str
    log_path: Path

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _ready(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/readiness")
        resp = conn.getresponse()
        resp.read()
        return resp.status == 200
    finally:
        conn.close()


@pytest.fixture(scope="module")
def smg_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SmgFleet]:
    binary = tools_bin("smg")
    tmp = tmp_path_factory.mktemp("smg")
    daemons = [start_server(tmp), start_server(tmp)]
    port = free_port()
    argv = [binary, "launch", "--host", "127.0.0.1", "--port", str(port), "--policy", "cache_aware"]
    argv += ["--worker-urls", *(d.url for d in daemons)]
    argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    with router_in_front(argv, tmp, daemons, lambda: _ready(port), "smg") as log_path:
        yield SmgFleet(daemons, f"http://127.0.0.1:{port}", log_path)


def test_chat_through_smg(smg_fleet: SmgFleet) -> None:
    raw = smg_fleet.client().chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=4, temperature=0
    )
    c = raw.parse()
    assert c.choices[0].message.content and 1 <= c.usage.completion_tokens <= 4, c
    assert HEADER not in raw.headers, raw.headers  # every field smg sends is one kvpilot knows


def test_streams_through_smg(smg_fleet: SmgFleet) -> None:
    chunks = list(
        smg_fleet.client().chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4, chunks[-1]


def test_cache_aware_policy_sends_repeats_to_one_pod(smg_fleet: SmgFleet) -> None:
    questions = ("When is the first ferry?", "Can I bring a bike?", "Is there a café?", "Any dogs?")
    check_repeats_stick_to_one_pod(smg_fleet.client(), smg_fleet.daemons, "a ferry company", questions)
