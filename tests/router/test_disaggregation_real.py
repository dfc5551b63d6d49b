"""Prefill/decode disaggregation through real parts: a kvpilot daemon of each role (`--kv-transfer-config`
kv_producer, kv_consumer), with `kvpilot router --prefill A --decode B` in front of them, and the real
vllm-router 0.1.17 (`make vllm-router`) with `--vllm-pd-disaggregation` in front of the same two. Each
answers a greedy chat token for token as one daemon alone does, the decode pod serving the prompt from the
KV it pulled (its usage's cached_tokens). The daemons are shared by the module: on a 2-core machine each
takes 20-40 s to start."""

from __future__ import annotations

import http.client
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.procs import free_port, spawn, stop, wait_ready
from support.servers import (
    ADMIN_TOKEN,
    MODEL,
    RouterProc,
    Server,
    start_daemon,
    start_router,
    stop_router,
    stop_server,
)
from support.vllm_client import tools_bin

pytestmark = pytest.mark.timeout(600)

BLOCK = 16
RECEIVED = 'kvpilot_kv_transfer_blocks_total{direction="received"}'  # blocks a decode pod pulled


def kv_transfer(role: str) -> str:
    extra = {"host": "127.0.0.1", "port": free_port()}
    return json.dumps(
        {"kv_connector": "KvpilotConnector", "kv_role": role, "kv_connector_extra_config": extra}
    )


@dataclass
class Pair:
    prefill: Server
    decode: Server
    tmp: Path


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    tmp = tmp_path_factory.mktemp("pd")
    started: list[Server] = []
    try:
        started.append(start_daemon(tmp, "--kv-transfer-config", kv_transfer("kv_producer")))
        started.append(start_daemon(tmp, "--kv-transfer-config", kv_transfer("kv_consumer")))
        yield Pair(*started, tmp)
    finally:
        for d in started:
            stop_server(d)
    for d in started:
        assert "Traceback" not in d.log(), d.log()[-4000:]


@pytest.fixture(scope="module")
def router(pair: Pair) -> Iterator[RouterProc]:
    r = start_router(pair.tmp, None, "--prefill", pair.prefill.url, "--decode", pair.decode.url)
    try:
        yield r
    finally:
        stop_router(r)


def fresh_chat(stream: bool = False) -> dict:
    """A greedy chat no pod has seen: about 8 full blocks of a system prompt unique to the call."""
    system = (
        f"Logbook {uuid.uuid4().hex}: the keeper writes down every ship that passes the cape at night. " * 4
    )
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "Which ships passed?"},
        ],
        "max_tokens": 12,
        "temperature": 0,
    }
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


def post(port: int, path: str, body: dict) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request(
            "POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def answer(status: int, raw: bytes) -> tuple[str, dict]:
    """A chat reply's text and usage, streamed (server-sent events) or not."""
    assert status == 200, raw
    if not raw.startswith(b"data: "):
        doc = json.loads(raw)
        return doc["choices"][0]["message"]["content"], doc["usage"]
    text, usage = "", None
    for line in raw.decode().splitlines():
        if line.startswith("data: {"):
            event = json.loads(line[6:])
            text += "".join(c["delta"].get("content") or "" for c in event["choices"])
            usage = event.get("usage") or usage
    assert usage is not None, raw
    return text, usage


def alone(pair: Pair, body: dict) -> tuple[str, dict]:
    """The chat answered by one daemon on its own (the producer, as a plain request)."""
    plain = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    return answer(*post(pair.prefill.port, "/v1/chat/completions", plain))


def counter(server: Server, sample: str) -> float:
    return server.metrics().get(sample, 0.0)


@pytest.mark.parametrize("stream", [False, True])
def test_the_router_answers_as_one_daemon_with_the_prompt_pulled_from_the_prefill_pod(
    pair: Pair, router: RouterProc, stream: bool
) -> None:
    body = fresh_chat(stream)
    transferred = router.metrics()['kvpilot_router_pd_requests_total{outcome="transferred"}']
    received = counter(pair.decode, RECEIVED)
    text, usage = answer(*post(router.port, "/v1/chat/completions", body))
    expected, expected_usage = alone(pair, body)
    assert text == expected and usage["completion_tokens"] == expected_usage["completion_tokens"], (
        text,
        expected,
    )
    # the decode pod had never seen the prompt: what it did not compute came from the prefill pod
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 4 * BLOCK, usage
    assert counter(pair.decode, RECEIVED) >= received + 4
    assert router.metrics()['kvpilot_router_pd_requests_total{outcome="transferred"}'] == transferred + 1


def test_a_router_reset_reaches_both_pools(pair: Pair, router: RouterProc) -> None:
    epochs = [d.cache()["epoch"] for d in (pair.prefill, pair.decode)]
    r = router.request("POST", "/reset_prefix_cache", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert r.status == 200, r.body
    pods = {p["pod"]: p for p in r.json()["pods"]}
    for daemon, role in ((pair.prefill, "prefill"), (pair.decode, "decode")):
        entry = pods[f"127.0.0.1:{daemon.port}"]
        assert entry["role"] == role and entry["success"] and entry["verified"] == "cold", entry
    assert [d.cache()["epoch"] for d in (pair.prefill, pair.decode)] == [e + 1 for e in epochs]
    assert {p["pod"]: p["role"] for p in router.health()["pods"]} == {
        f"127.0.0.1:{pair.prefill.port}": "prefill",
        f"127.0.0.1:{pair.decode.port}": "decode",
    }


@pytest.fixture(scope="module")
def vllm_router(pair: Pair) -> Iterator[int]:
    binary = tools_bin("vllm-router")
    port = free_port()
    argv = [binary, "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port())]
    argv += ["--vllm-pd-disaggregation", "--prefill", pair.prefill.url, "--decode", pair.decode.url]
    argv += ["--policy", "round_robin"]
    log_path = pair.tmp / "vllm-router.log"
    proc = spawn(argv, log_path=log_path, cwd=pair.tmp)  # outside the checkout, as a user runs it

    def ready() -> bool:
        try:
            return post(port, "/v1/chat/completions", {**fresh_chat(), "max_tokens": 1})[0] == 200
        except OSError:
            return False

    try:
        wait_ready(proc, ready, 120, "vllm-router", log_path)
        yield port
    finally:
        stop(proc, grace=10)


@pytest.mark.parametrize("stream", [False, True])
def test_vllm_routers_pd_mode_drives_kvpilot_pods(pair: Pair, vllm_router: int, stream: bool) -> None:
    body = fresh_chat(stream)
    received = counter(pair.decode, RECEIVED)
    text, _ = answer(*post(vllm_router, "/v1/chat/completions", body))
    expected, _ = alone(pair, body)
    assert text == expected, (text, expected)
    # The decode pod pulled the prompt's blocks. (The usage vllm-router answers with is not the decode pod's:
    # it says 0 cached tokens where the decode pod's own, through kvpilot's router, says the pulled ones.)
    assert counter(pair.decode, RECEIVED) >= received + 4
