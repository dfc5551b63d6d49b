"""The Grafana dashboards (charts/kvpilot/dashboards/*.json) without a cluster: the variables the issue asks
for, every query valid PromQL once Grafana's variables are substituted (checked by the real promtool), and
every metric they or the alerts use really exposed by the daemon, the operator or a running router.
tests/chart/test_chart_cluster.py runs the daemon and operator queries against a live Prometheus,
test_router_prometheus.py the router's."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from chart.tools import tool

from monitoring.dashboards import (
    DASHBOARDS,
    METRIC_NAME,
    ROUTER_DASHBOARD,
    alert_rules,
    load,
    panels,
    queries,
    substitute,
    variable_queries,
)
from monitoring.exposed import daemon_metric_names, operator_metric_names, served_metric_names
from support.servers import Fleet

ALL = {"namespace": ".*", "deployment": ".*", "pod": ".*"}


def test_three_dashboards_with_unique_uids() -> None:
    boards = [load(p) for p in DASHBOARDS]
    assert {b["title"] for b in boards} == {"kvpilot / Fleet cache", "kvpilot / Resets", "kvpilot / Router"}
    assert len({b["uid"] for b in boards}) == len(boards)


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_variables_and_datasource(path: Path) -> None:
    board = load(path)
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    for name in ("namespace", "deployment", "pod"):
        assert variables[name]["type"] == "query" and variables[name]["includeAll"]
    for p in panels(board):
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", p["title"]


def test_fleet_cache_panels() -> None:
    titles = {p["title"] for p in panels(load(DASHBOARDS[0].with_name("fleet-cache.json")))}
    assert titles >= {
        "Prefix cache hit rate",
        "Prompt tokens served from cache",
        "KV cache usage",
        "KV cache blocks by state",
        "Prefix cache epoch",
        "Time since last reset",
        "Offload tier bytes vs capacity",
        "Offload tier blocks by pod",
        "Prefix cache hits by tier",
        "Offload tier blocks stored and loaded",
        "Requests per second by adapter",
        "Prefix cache hit rate by adapter",
        "Time to first token p50 / p95 / p99",
        "Inter-token latency p50 / p95 / p99",
        "Tokens per second",
        "Requests running and waiting",
        "Preemptions",
        "KV transfer blocks per second",
        "KV transfer bytes per second",
        "KV transfer failures by reason",
    }


def test_hit_rate_is_windowed_and_guarded() -> None:
    """vLLM's form: a ratio of rates over the window, with the denominator `> 0` (no traffic: no value)."""
    board = load(DASHBOARDS[0].with_name("fleet-cache.json"))
    (panel,) = [p for p in panels(board) if p["title"] == "Prefix cache hit rate"]
    for t in panel["targets"]:
        assert "rate(kvpilot_prefix_cache_hits_total" in t["expr"] and "[$__rate_interval]" in t["expr"]
        assert t["expr"].rstrip().endswith("> 0)"), t["expr"]


def test_every_query_is_valid_promql(tmp_path: Path) -> None:
    """promtool parses each substituted query as the expression of a recording rule."""
    rules = []
    for path in DASHBOARDS:
        board = load(path)
        for where, expr in [*queries(board), *variable_queries(board)]:
            rules.append(
                {
                    "record": f"check:{len(rules)}",
                    "expr": substitute(expr, "1m", "1h", ALL),
                    "labels": {"where": f"{path.stem}: {where}"},
                }
            )
    f = tmp_path / "queries.yaml"
    f.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    r = subprocess.run([tool("promtool"), "check", "rules", str(f)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(rules)} rules found" in r.stdout


def test_router_panels() -> None:
    titles = {p["title"] for p in panels(load(ROUTER_DASHBOARD))}
    assert titles >= {
        "Requests per pod",
        "Routing decisions by pod, policy and reason",
        "Predicted vs reported cached tokens",
        "Prediction error per pod",
        "Stale predictions",
        "KV event batches by result",
        "KV event batches missed",
        "Pods ready and listed per router",
        "Fleet resets by result",
        "Pod answers other than 2xx",
    }


def test_only_exposed_metrics_are_used(fleet: Fleet) -> None:
    """Every metric a panel, annotation, variable or alert names is one the daemon or operator exposes, or
    one a real `kvpilot router` serves on /metrics (`up` is Prometheus' own)."""
    router = served_metric_names(fleet.router.request("GET", "/metrics").body.decode())
    assert "kvpilot_router_requests_total" in router, router
    exposed = daemon_metric_names() | operator_metric_names() | router | {"up"}
    used: dict[str, str] = {}
    for path in DASHBOARDS:
        board = load(path)
        for where, expr in [*queries(board), *variable_queries(board)]:
            for name in METRIC_NAME.findall(expr):
                used.setdefault(name, f"{path.stem}: {where}")
    for rule in alert_rules():
        for name in METRIC_NAME.findall(rule["expr"]):
            used.setdefault(name, f"alert {rule['alert']}")
    missing = {name: where for name, where in used.items() if name not in exposed}
    assert not missing, f"metrics used but not exposed: {missing}"
