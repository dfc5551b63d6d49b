"""`kvpilot serve --data-parallel-size 2` on loopback with the embedded model: two engine-core processes
behind one server, driven with the official openai client; a reset every rank answers; a rank killed
with SIGKILL makes /health 503 and fails its requests at once."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.fanout import ResetSettings, Target, run_fanout
from kvpilot.operator.resets.status import pod_entry
from support.servers import (
    ADMIN_TOKEN,
    MODEL,
    Server,
    read_until_decoding,
    send_completion,
    start_server,
    stop_server,
    wait_idle,
)

pytestmark = pytest.mark.timeout(600)

LONG = dict(max_tokens=400, temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory: pytest.TempPathFactory) -> Server:
    srv = start_server(tmp_path_factory.mktemp("dp"), "--data-parallel-size", "2", token=ADMIN_TOKEN)
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def client(dp_server: Server):  # noqa: ANN201
    import openai

    return openai.OpenAI(base_url=dp_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def rank_pids(server: Server) -> dict[int, int]:
    return {int(r): int(p) for r, p in re.findall(r"rank (\d+) ready \(pid (\d+)", server.log())}


def test_two_ranks_serve_openai_requests(dp_server: Server, client) -> None:  # noqa: ANN001
    assert dp_server.request("GET", "/health").status == 200
    assert len(rank_pids(dp_server)) == 2
    prompts = [f"Write a short list of {thing}:" for thing in ("fruits", "rivers", "planets", "colours")]
    texts: dict[str, str] = {}

    def ask(p: str) -> None:
        texts[p] = (
            client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0).choices[0].text
        )

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(texts.get(p) for p in prompts), texts
    # Greedy decoding gives the same text whichever rank serves it (round robin moves it to the other).
    again = [
        client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=12, temperature=0)
        for _ in range(2)
    ]
    assert [a.choices[0].text for a in again] == [texts[prompts[0]]] * 2
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi!"}], max_tokens=8, temperature=0
    )
    assert chat.choices[0].message.content
    ranks = dp_server.cache()["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["query_tokens"] > 0 for r in ranks), ranks  # both ranks did work


def test_reset_reaches_every_rank(dp_server: Server) -> None:
    before = {r["rank"]: r["epoch"] for r in dp_server.cache()["ranks"]}
    reply = dp_server.reset()
    assert reply["success"] is True
    assert [(r["rank"], r["success"]) for r in reply["ranks"]] == [(0, True), (1, True)]
    for r in reply["ranks"]:
        assert r["epoch"] == before[r["rank"]] + 1
        assert {"evicted_blocks", "in_flight_requests", "preempted_requests", "duration_ms"} <= r.keys()
    after = dp_server.cache()
    assert [r["epoch"] for r in after["ranks"]] == [r["epoch"] for r in reply["ranks"]]
    assert after["epoch"] == reply["epoch"] == min(r["epoch"] for r in reply["ranks"])
    assert after["blocks_total"] == sum(r["blocks_total"] for r in after["ranks"]) == 512
    metrics = dp_server.metrics()
    for r in reply["ranks"]:
        assert metrics[f'kvpilot_prefix_cache_epoch{{rank="{r["rank"]}"}}'] == r["epoch"]
        assert f'kvpilot_kv_cache_blocks{{rank="{r["rank"]}",state="free"}}' in metrics
    unauthorized = dp_server.request("POST", "/reset_prefix_cache")
    assert unauthorized.status == 401


def test_fleet_fanout_records_every_rank(dp_server: Server) -> None:
    """The operator's (and router's) fan-out keeps each rank's answer in the pod's record."""
    before = dp_server.cache()["ranks"]
    [rec] = asyncio.run(
        run_fanout([Target("dp-pod", url=dp_server.url)], ResetSettings(token=ADMIN_TOKEN, timeout_s=60))
    )
    assert rec.result == "Succeeded", rec
    assert [r.rank for r in rec.ranks] == [0, 1] and all(r.success for r in rec.ranks)
    assert [r.epoch for r in rec.ranks] == [b["epoch"] + 1 for b in before]
    assert pod_entry(rec)["ranks"] == [
        {"rank": r.rank, "success": r.success, "epoch": r.epoch, "evictedBlocks": r.evicted_blocks}
        for r in rec.ranks
    ]


def test_verification_sends_a_canary_to_every_rank(dp_server: Server) -> None:
    """A verified reset of a DP pod proves each rank cold: the canary reaches every rank (by vLLM's
    X-data-parallel-rank header), is served from each rank's cache before the reset, and from none after."""
    before = dp_server.cache()["ranks"]
    settings = ResetSettings(token=ADMIN_TOKEN, timeout_s=120, verify=True)
    [rec] = asyncio.run(run_fanout([Target("dp-pod", url=dp_server.url)], settings))
    after = dp_server.cache()["ranks"]
    assert rec.result == "Succeeded" and rec.verified == "cold", rec
    assert "on all 2 ranks" in rec.verify_message and rec.cleared == ["pool"], rec
    for b, a in zip(before, after, strict=True):
        # three canaries per rank (48 words, three of its 16-token blocks): fill, hit (before the reset),
        # check (after it, cold)
        assert a["query_tokens"] - b["query_tokens"] >= 3 * 48, (b, a)
        assert a["hit_tokens"] - b["hit_tokens"] >= 48, (b, a)


def test_gaie_gauges_have_one_series_per_rank(dp_server: Server) -> None:
    """vllm:* gauges (GAIE's model-server protocol) carry vLLM's `engine` label per rank, each equal to the
    kvpilot_* gauge's `rank` series of the same scrape, while a request decodes on one rank."""
    sock = send_completion(dp_server.port, 400, stream=True)
    try:
        read_until_decoding(sock)
        text = dp_server.request("GET", "/metrics").body.decode()
    finally:
        sock.close()
        wait_idle(dp_server)  # the hang-up aborts the request; the next tests start from an idle server
    families = {f.name: f.samples for f in text_string_to_metric_families(text)}
    for vllm, ours in [
        ("vllm:num_requests_waiting", "kvpilot_num_requests_waiting"),
        ("vllm:num_requests_running", "kvpilot_num_requests_running"),
        ("vllm:kv_cache_usage_perc", "kvpilot_kv_cache_usage_ratio"),
    ]:
        by_engine = {s.labels["engine"]: s for s in families[vllm]}
        assert sorted(by_engine) == ["0", "1"], families[vllm]
        assert all(s.labels["model_name"] == MODEL for s in by_engine.values())
        assert {s.labels["rank"]: s.value for s in families[ours]} == {
            e: s.value for e, s in by_engine.items()
        }
    assert sum(s.value for s in families["vllm:num_requests_running"]) == 1
    assert sum(s.value > 0 for s in families["vllm:kv_cache_usage_perc"]) == 1  # the rank that decodes


def test_killed_rank_fails_its_requests_and_health(dp_server: Server, client) -> None:  # noqa: ANN001
    """Last in this module: it leaves the server with a dead rank."""
    errors: dict[int, BaseException | None] = {}
    started = [threading.Event(), threading.Event()]

    def stream(i: int) -> None:
        try:
            for _ in client.completions.create(model=MODEL, prompt=f"Story number {i}:", stream=True, **LONG):
                started[i].set()
            errors[i] = None
        except Exception as exc:  # noqa: BLE001 - what the client saw is the result under test
            errors[i] = exc
        finally:
            started[i].set()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    assert all(e.wait(120) for e in started)
    busy = [r["rank"] for r in dp_server.cache()["ranks"] if r["num_running"]]
    assert busy == [0, 1]  # one stream on each rank
    killed_at = time.monotonic()
    os.kill(rank_pids(dp_server)[1], signal.SIGKILL)

    deadline = time.monotonic() + 10
    while dp_server.request("GET", "/health").status != 503:
        assert time.monotonic() < deadline, "health still 200 after a rank died"
        time.sleep(0.1)
    health = dp_server.request("GET", "/health").json()
    assert "rank 1" in health["reason"]
    for t in threads:
        t.join(timeout=max(1.0, 30 - (time.monotonic() - killed_at)))
    # The stream on the dead rank ended with an error promptly; the other kept going to its end or
    # errs as well: no client is left hanging on a dead rank.
    assert sum(isinstance(e, Exception) for e in errors.values()) >= 1, errors
    failed = dp_server.request("POST", "/reset_prefix_cache", headers=dp_server.admin())
    assert failed.status == 500
    body = failed.json()
    assert body["success"] is False and "rank 1" in body["error"]["message"]
    assert [(r["rank"], r["success"]) for r in body["ranks"]] == [(0, True), (1, False)]
    refused = dp_server.request("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert refused.status == 503


def test_bad_data_parallel_size_is_refused(tmp_path: Path) -> None:
    with pytest.raises(
        RuntimeError, match="data-parallel-size and --tensor-parallel-size must be at least 1"
    ):
        start_server(tmp_path, "--data-parallel-size", "0")
