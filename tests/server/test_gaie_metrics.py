"""The gauges the Gateway API Inference Extension's model-server protocol reads (`vllm:num_requests_waiting`,
`vllm:num_requests_running`, `vllm:kv_cache_usage_perc`), scraped from a real `kvpilot serve` and parsed
with prometheus-client's text parser: gauges with vLLM's labels, equal to the `kvpilot_` gauges of the same
scrape, idle and while a request decodes, and listed in docs/metrics.md. promtool reads the exposition with Prometheus' Go text parser, the one GAIE's
endpoint pickers use."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from chart.tools import tool
from prometheus_client.parser import text_string_to_metric_families

from support.servers import MODEL, Server, read_until_decoding, send_completion, start_server, stop_server

pytestmark = pytest.mark.timeout(300)

# vLLM's name -> the kvpilot gauge it repeats
SAME_AS = {
    "vllm:num_requests_waiting": "kvpilot_num_requests_waiting",
    "vllm:num_requests_running": "kvpilot_num_requests_running",
    "vllm:kv_cache_usage_perc": "kvpilot_kv_cache_usage_ratio",
}


def scrape(server: Server) -> dict[str, tuple[str, list]]:
    """One GET /metrics: {family name: (type, samples)}."""
    r = server.request("GET", "/metrics")
    assert r.status == 200, r.body
    return {f.name: (f.type, f.samples) for f in text_string_to_metric_families(r.body.decode())}


def assert_vllm_gauges_repeat_kvpilot_ones(families: dict[str, tuple[str, list]]) -> dict[str, float]:
    """Each vLLM gauge: one sample labelled as vLLM labels it, equal to its kvpilot gauge; returns the values."""
    values = {}
    for name, same in SAME_AS.items():
        assert name in families, sorted(families)
        kind, samples = families[name]
        assert kind == "gauge", (name, kind)
        assert [s.labels for s in samples] == [{"model_name": MODEL, "engine": "0"}], samples
        (ours,) = families[same][1]
        assert samples[0].value == ours.value, (name, samples, ours)
        values[name] = samples[0].value
    return values


def test_idle_daemon_reports_an_empty_queue_and_batch(quiet: Server) -> None:
    values = assert_vllm_gauges_repeat_kvpilot_ones(scrape(quiet))
    assert values["vllm:num_requests_running"] == 0 and values["vllm:num_requests_waiting"] == 0
    assert values["vllm:kv_cache_usage_perc"] == 0  # idle: no block held by a request


def test_a_decoding_request_shows_in_the_running_gauge_and_the_cache_usage(quiet: Server) -> None:
    sock = send_completion(quiet.port, 400, stream=True)  # ~400 steps unless aborted by the hang-up below
    try:
        assert b"200 OK" in read_until_decoding(sock).split(b"\r\n", 1)[0]
        values = assert_vllm_gauges_repeat_kvpilot_ones(scrape(quiet))
        assert values["vllm:num_requests_running"] == 1 and values["vllm:num_requests_waiting"] == 0
        # a fraction of the cache (GAIE reads 0-1 here, not a percent): the request's blocks of 256
        assert 0 < values["vllm:kv_cache_usage_perc"] < 0.5, values
    finally:
        sock.close()
    deadline = time.monotonic() + 30
    while scrape(quiet)["vllm:num_requests_running"][1][0].value:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_served_model_name_is_the_model_name_label(tmp_path: Path) -> None:
    server = start_server(tmp_path, "--served-model-name", "team-model", "alias")
    try:
        for name in SAME_AS:
            _, samples = scrape(server)[name]
            assert [s.labels for s in samples] == [{"model_name": "team-model", "engine": "0"}], samples
    finally:
        stop_server(server)


def test_the_vllm_gauges_are_documented(server: Server) -> None:
    doc = (Path(__file__).parents[2] / "docs" / "metrics.md").read_text()
    daemon = doc.split("## Daemon", 1)[1].split("\n## ", 1)[0]
    rows = {line.split("`")[1]: line for line in daemon.splitlines() if line.startswith("| `vllm:")}
    exposed = {name for name in scrape(server) if name.startswith("vllm:")}
    assert exposed == set(SAME_AS) == set(rows), (exposed, rows)
    for name, row in rows.items():
        assert row.count("|") >= 6 and f"`{SAME_AS[name]}`" in row, row  # metric, type, unit, labels, meaning


def test_prometheus_go_parser_reads_the_exposition(server: Server) -> None:
    """`promtool check metrics` parses the scrape as GAIE's pickers do (Go's expfmt). Its lint flags the `:` of
    vLLM's names (reserved by convention for recording rules) and nothing else: the names are vLLM's, which GAIE
    looks up verbatim."""
    text = server.request("GET", "/metrics").body.decode()
    check = [tool("promtool"), "check", "metrics"]
    # --extended: a table of each family's series count, read by the parser alone
    parsed = subprocess.run(
        [*check, "--lint=none", "--extended"], input=text, capture_output=True, text=True, timeout=60
    )
    assert parsed.returncode == 0, parsed.stdout + parsed.stderr
    series = {line.split()[0]: line.split()[1] for line in parsed.stdout.splitlines()[1:] if line.strip()}
    assert {name: series.get(name) for name in SAME_AS} == dict.fromkeys(SAME_AS, "1"), parsed.stdout
    linted = subprocess.run(check, input=text, capture_output=True, text=True, timeout=60)
    findings = sorted((linted.stdout + linted.stderr).splitlines())
    assert findings == sorted(f"{name} metric names should not contain ':'" for name in SAME_AS), findings
