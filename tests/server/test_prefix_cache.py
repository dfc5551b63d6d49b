"""Prefix cache over HTTP: cached_tokens, resets, epochs, stats and metrics."""

from __future__ import annotations

import pytest

from support.servers import Server

pytestmark = pytest.mark.timeout(300)

LONG_PROMPT = "Prefix cache probe. " + "The quick brown fox jumps over the lazy dog. " * 6

DAEMON_METRICS = [
    "kvpilot_prefix_cache_queries_total",
    "kvpilot_prefix_cache_hits_total",
    "kvpilot_prefix_cache_resets_total",
    "kvpilot_prefix_cache_epoch",
    "kvpilot_prefix_cache_last_reset_timestamp_seconds",
    "kvpilot_kv_cache_blocks",
    "kvpilot_kv_cache_usage_ratio",
    "kvpilot_num_requests_running",
    "kvpilot_num_requests_waiting",
    "kvpilot_num_preemptions_total",
    "kvpilot_prompt_tokens_total",
    "kvpilot_prompt_tokens_cached_total",
    "kvpilot_generation_tokens_total",
    "kvpilot_time_to_first_token_seconds",
    "kvpilot_inter_token_latency_seconds",
    "kvpilot_e2e_request_latency_seconds",
]


def cached_tokens(server: Server, prompt: str = LONG_PROMPT) -> int:
    r = server.request("POST", "/v1/completions", {"prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert r.status == 200, r.body
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_cached_tokens_then_reset(quiet: Server) -> None:
    server = quiet
    before = server.metrics()
    first = server.reset()
    assert first["success"] is True and first["ranks"][0]["rank"] == 0 and first["ranks"][0]["success"]
    assert cached_tokens(server) == 0
    hit = cached_tokens(server)
    assert hit > 0 and hit % 16 == 0

    second = server.reset()
    assert second["epoch"] == first["epoch"] + 1
    assert second["evicted_blocks"] >= hit // 16
    assert second["in_flight_requests"] == 0 and second["preempted_requests"] == 0
    assert second["duration_ms"] >= 0
    assert cached_tokens(server) == 0  # right after the reset nothing is found
    assert cached_tokens(server) == hit  # and the cache refills

    third = server.reset(reset_running_requests="true")
    assert third["epoch"] == second["epoch"] + 1

    stats = server.cache()
    assert stats["epoch"] == third["epoch"] and stats["resets"] >= 3
    assert stats["blocks_used"] == 0 and stats["blocks_cached"] == 0
    assert stats["blocks_free"] + stats["blocks_cached"] + stats["blocks_used"] == stats["blocks_total"]
    assert stats["last_reset_time"] > 0

    after = server.metrics()
    assert after['kvpilot_prefix_cache_resets_total{result="success"}'] == (
        before['kvpilot_prefix_cache_resets_total{result="success"}'] + 3
    )
    assert after["kvpilot_prefix_cache_epoch"] == third["epoch"]
    assert after["kvpilot_prefix_cache_hits_total"] >= before["kvpilot_prefix_cache_hits_total"] + 2 * hit
    assert after["kvpilot_prefix_cache_queries_total"] > before["kvpilot_prefix_cache_queries_total"]
    assert (
        after["kvpilot_prompt_tokens_cached_total"] >= before["kvpilot_prompt_tokens_cached_total"] + 2 * hit
    )
    assert after["kvpilot_generation_tokens_total"] >= before["kvpilot_generation_tokens_total"] + 8
    assert after["kvpilot_time_to_first_token_seconds_count"] == (
        before["kvpilot_time_to_first_token_seconds_count"] + 4
    )
    assert after["kvpilot_prefix_cache_last_reset_timestamp_seconds"] == pytest.approx(
        stats["last_reset_time"]
    )
    assert after['kvpilot_kv_cache_blocks{state="used"}'] == 0


def test_reset_flag_in_json_body_and_bad_values(server: Server) -> None:
    r = server.request("POST", "/reset_prefix_cache", {"reset_running_requests": True}, server.admin())
    assert r.status == 200 and r.json()["success"] is True
    for path, body, param in [
        ("/reset_prefix_cache?reset_running_requests=maybe", None, "reset_running_requests"),
        ("/reset_prefix_cache", {"reset_running_requests": "yes"}, "reset_running_requests"),
        ("/reset_prefix_cache", b"{not json", None),
    ]:
        r = server.request("POST", path, body, server.admin())
        assert r.status == 400, (path, body, r.body)
        assert r.json()["error"]["param"] == param


def test_metrics_expose_every_contract_name_with_help(server: Server) -> None:
    r = server.request("GET", "/metrics")
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
    text = r.body.decode()
    for name in DAEMON_METRICS:
        base = name.removesuffix("_total")
        assert f"# HELP {base}" in text or f"# HELP {name}" in text, name
    for state in ("free", "cached", "used"):
        assert f'kvpilot_kv_cache_blocks{{state="{state}"}}' in text
    assert 'kvpilot_time_to_first_token_seconds_bucket{le="0.1"}' in text


def test_every_exposed_metric_is_documented_with_its_unit(server: Server) -> None:
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "metrics.md").read_text()
    daemon = doc.split("## Daemon", 1)[1].split("\n## ", 1)[0]
    rows = {
        line.split("`")[1].split("{")[0]: line
        for line in daemon.splitlines()
        if line.startswith("| `kvpilot_")
    }
    # prometheus-client's *_created companions are timestamps of the series above, not metrics of their own
    exposed = {
        line.split()[2]
        for line in server.request("GET", "/metrics").body.decode().splitlines()
        if line.startswith("# TYPE kvpilot_") and not line.split()[2].endswith("_created")
    }
    for name in exposed:
        documented = name if name in rows else f"{name}_total"
        assert documented in rows, name
        assert rows[documented].count("|") >= 5, rows[documented]  # metric, type, unit, meaning
    assert set(DAEMON_METRICS) <= set(rows)


def test_health_and_stats_shape(server: Server) -> None:
    assert server.request("GET", "/health").json()["status"] == "ok"
    stats = server.cache()
    for key in (
        "epoch",
        "blocks_total",
        "blocks_free",
        "blocks_cached",
        "blocks_used",
        "query_tokens",
        "hit_tokens",
        "hit_rate",
        "last_reset_time",
        "engine_steps",
    ):
        assert key in stats
    assert stats["blocks_total"] == 256
