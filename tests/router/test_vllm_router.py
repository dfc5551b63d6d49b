"""The real `vllm-router` (vLLM's router, from PyPI: `make vllm-router`) with its `kv_aware` policy in front
of two kvpilot daemons that publish KV events with token ids (`--kv-events-token-ids`): it reads their
events over ZeroMQ, asks a daemon's `POST /tokenize` for a request's ids, and sends a prompt (and prompts
extending it) to the pod that holds its blocks; after that pod's `POST /reset_prefix_cache` its index
forgets them."""

from __future__ import annotations

import http.client
import json
import os
import re
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.procs import free_port, wait_for
from support.servers import MODEL, Server, router_in_front, start_daemon
from support.vllm_client import tools_bin

pytestmark = pytest.mark.timeout(300)

BLOCK = 16
# About 200 tokens: 12 full blocks, well inside the daemons' 512-token context.
TEXT = "The lighthouse keeper logs the ships that pass the northern cape each night. " * 12


def http_get(port: int, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    finally:
        conn.close()


@dataclass
class VllmFleet:
    daemons: list[Server]
    port: int
    metrics_port: int
    log_path: Path

    def complete(self, prompt: str) -> dict:
        """A completion through the router, with the pod that ran it (the daemon whose prefix cache was
        queried) and the daemon's cached tokens."""
        return self.post("/v1/completions", {"prompt": prompt})

    def chat(self, messages: list[dict]) -> dict:
        return self.post("/v1/chat/completions", {"messages": messages})

    def post(self, path: str, fields: dict) -> dict:
        before = [d.cache()["query_tokens"] for d in self.daemons]
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        try:
            body = json.dumps({"model": MODEL, **fields, "max_tokens": 1, "temperature": 0})
            conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            raw = resp.read()
        finally:
            conn.close()
        assert resp.status == 200, raw
        after = [d.cache()["query_tokens"] for d in self.daemons]
        ran = [i for i, (a, b) in enumerate(zip(after, before, strict=True)) if a > b]
        assert len(ran) == 1, (before, after)
        usage = json.loads(raw)["usage"]
        return {"pod": ran[0], "cached": usage["prompt_tokens_details"]["cached_tokens"]}

    def lookups(self) -> dict[str, float]:
        """vllm-router's `vllm_router_kv_placement_lookups_total` by result."""
        status, text = http_get(self.metrics_port, "/metrics")
        assert status == 200, text
        out: dict[str, float] = {}
        for m in re.finditer(
            r'^vllm_router_kv_placement_lookups_total\{[^}]*result="(\w+)"[^}]*\} (\S+)', text, re.M
        ):
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
        return out

    def applied(self, pod: int) -> int:
        """The KV event batches of `pod` vllm-router has applied to its index (one debug line each)."""
        return self.log().count(f"live sequence advanced source={self.daemons[pod].url} ")

    def log(self) -> str:
        """Its log, colour codes removed (it writes them to a file too, NO_COLOR or not)."""
        return re.sub(r"\x1b\[[0-9;]*m", "", self.log_path.read_text(errors="replace"))


@pytest.fixture(scope="module")
def vllm_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmFleet]:
    binary = tools_bin("vllm-router")
    tmp = tmp_path_factory.mktemp("vllm-router")
    daemons = [start_daemon(tmp, "--kv-events-token-ids"), start_daemon(tmp, "--kv-events-token-ids")]
    port, metrics_port = free_port(), free_port()
    argv = [binary, "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1"]
    argv += ["--prometheus-port", str(metrics_port), "--policy", "kv_aware", "--worker-urls"]
    argv += [d.url for d in daemons]
    for d in daemons:
        where = d.request("GET", "/kv_events").json()
        argv += ["--kv-event-source", f"{d.url}={where['endpoint']}"]
    argv += ["--kv-event-block-size", str(BLOCK), "--kv-event-model", MODEL, "--log-level", "debug"]
    ready = lambda: http_get(port, "/health")[0] == 200  # noqa: E731
    env = {**os.environ, "NO_COLOR": "1"}
    with router_in_front(argv, tmp, daemons, ready, "vllm-router", env=env) as log_path:
        yield VllmFleet(daemons, port, metrics_port, log_path)


def warm(fleet: VllmFleet, pod: int, path: str, fields: Callable[[str], dict], deadline_s: float = 60) -> str:
    """A fresh prompt run on `pod` directly (not through the router), once vllm-router has applied the
    pod's KV event batch of it: ZeroMQ drops what a subscriber was not there for (the router's
    subscription may start after the first try), so each try is a new prompt. Returns its tag."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        tag = uuid.uuid4().hex
        seen = fleet.applied(pod)
        r = fleet.daemons[pod].request("POST", path, {"model": MODEL, **fields(tag), "max_tokens": 1})
        assert r.status == 200, r.body
        applied_by = time.monotonic() + 5
        while fleet.applied(pod) == seen and time.monotonic() < applied_by:
            time.sleep(0.1)
        if fleet.applied(pod) == seen:
            continue
        time.sleep(0.2)  # a batch published after the one seen (the stores come in the same step's)
        return tag
    raise AssertionError(f"vllm-router never applied a KV event batch of pod {pod}\n{fleet.log()[-4000:]}")


def completion(tag: str) -> dict:
    return {"prompt": f"[{tag}] {TEXT}"}


def chat(tag: str) -> dict:
    messages = [
        {"role": "system", "content": f"[{tag}] {TEXT}"},
        {"role": "user", "content": "Which ships passed?"},
    ]
    return {"messages": messages}


def other_pod(fleet: VllmFleet) -> int:
    """The pod vllm-router does not pick for a prompt no pod holds: warming there, a request that lands
    there was routed by the KV index, not by its fallback."""
    return 1 - fleet.complete(completion(uuid.uuid4().hex)["prompt"])["pod"]


def test_kv_aware_sends_repeats_and_extensions_to_the_pod_holding_them(vllm_fleet: VllmFleet) -> None:
    pod = other_pod(vllm_fleet)
    prompt = completion(warm(vllm_fleet, pod, "/v1/completions", completion))["prompt"]
    before = vllm_fleet.lookups()
    runs = [vllm_fleet.complete(prompt) for _ in range(3)]
    runs += [vllm_fleet.complete(prompt + f" Entry {i}: the ship was late.") for i in range(3)]
    after = vllm_fleet.lookups()
    assert [r["pod"] for r in runs] == [pod] * 6, runs
    # Each was a KV hit in vllm-router's index, and the daemon served the warmed blocks from its cache.
    assert after.get("hit", 0) - before.get("hit", 0) == 6, (before, after)
    assert all(r["cached"] >= 10 * BLOCK for r in runs), runs
    credited = [int(n) for n in re.findall(r"credited_prefix_tokens=(\d+)", vllm_fleet.log())]
    assert len(credited) >= 6 and min(credited[-6:]) >= 10 * BLOCK, credited[-6:]


def test_kv_aware_keys_chats_by_the_daemons_template(vllm_fleet: VllmFleet) -> None:
    """vllm-router tokenizes a chat with the daemon's /tokenize chat form: the ids, and so the block keys,
    match the blocks the daemon stored for the same conversation."""
    pod = other_pod(vllm_fleet)
    messages = chat(warm(vllm_fleet, pod, "/v1/chat/completions", chat))["messages"]
    before = vllm_fleet.lookups()
    runs = [vllm_fleet.chat(messages) for _ in range(2)]
    after = vllm_fleet.lookups()
    assert [r["pod"] for r in runs] == [pod] * 2, runs
    assert after.get("hit", 0) - before.get("hit", 0) == 2, (before, after)
    assert all(r["cached"] >= 10 * BLOCK for r in runs), runs
    # Every field vllm-router sends (`include_reasoning` on chats; /tokenize's) is one kvpilot knows.
    for d in vllm_fleet.daemons:
        assert "ignoring request field" not in d.log(), d.log()[-4000:]


def test_reset_prefix_cache_drops_the_pod_from_the_index(vllm_fleet: VllmFleet) -> None:
    pod = other_pod(vllm_fleet)
    prompt = completion(warm(vllm_fleet, pod, "/v1/completions", completion))["prompt"]
    seen = vllm_fleet.applied(pod)
    vllm_fleet.daemons[pod].reset()  # AllBlocksCleared on its KV events
    wait_for(lambda: vllm_fleet.applied(pod) > seen, 10, "vllm-router to apply the pod's reset")
    before = vllm_fleet.lookups()
    run = vllm_fleet.complete(prompt)
    after = vllm_fleet.lookups()
    # The router's index no longer credits the pod with the prompt, and no pod had it cached.
    assert after.get("hit", 0) == before.get("hit", 0), (before, after)
    assert after.get("miss", 0) == before.get("miss", 0) + 1, (before, after)
    assert run["cached"] == 0, run
