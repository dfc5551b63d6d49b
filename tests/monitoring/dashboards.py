"""The Grafana dashboards and alert rules of charts/kvpilot as data: every PromQL expression they hold, and
how Grafana would substitute its variables before sending one to Prometheus."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import yaml

CHART = Path(__file__).resolve().parents[2] / "charts" / "kvpilot"
DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))
# The router's dashboard: `kvpilot router` metrics (the chart's router PodMonitor scrapes them).
ROUTER_DASHBOARD = CHART / "dashboards" / "router.json"
ALERTS = CHART / "alerts" / "kvpilot-alerts.yaml"
_LABEL_VALUES = re.compile(r"^label_values\((?:(?P<selector>.+),\s*)?(?P<label>\w+)\)$")
METRIC_NAME = re.compile(r"\b(kvpilot_[a-z_]+|up)\b")


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def panels(dashboard: dict) -> Iterator[dict]:
    for p in dashboard["panels"]:
        if p["type"] == "row":
            yield from p.get("panels", [])
        else:
            yield p


# The fleet dashboard's row for disaggregated fleets: its metrics exist only on pods with a KV connector, so
# Prometheus answers those panels only where a fleet runs spec.disaggregation.
DISAGGREGATION_ROW = "Prefill/decode disaggregation"


def row_panels(dashboard: dict, row: str) -> list[dict]:
    """The panels under the (expanded) row titled `row`: those after it, up to the next row."""
    out: list[dict] = []
    inside = False
    for p in dashboard["panels"]:
        if p["type"] == "row":
            inside = p["title"] == row
        elif inside:
            out.append(p)
    return out


def queries(dashboard: dict) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target and annotation; Grafana variables left in."""
    for p in panels(dashboard):
        for t in p["targets"]:
            yield f"panel {p['title']!r} {t['refId']}", t["expr"]
    for a in dashboard["annotations"]["list"]:
        if a.get("expr"):
            yield f"annotation {a['name']!r}", a["expr"]


def variable_queries(dashboard: dict) -> Iterator[tuple[str, str]]:
    """(variable, PromQL) for each query variable: Grafana's label_values(selector, label) as the PromQL it
    stands for, `group by (label) (selector)`."""
    for v in dashboard["templating"]["list"]:
        if v["type"] != "query":
            continue
        m = _LABEL_VALUES.match(v["query"]["query"])
        assert m, f"variable {v['name']}: only label_values(...) queries are used"
        yield v["name"], f"group by ({m['label']}) ({m['selector'] or 'up'})"


def substitute(expr: str, rate_interval: str, range_: str, variables: dict[str, str]) -> str:
    """The query Grafana sends: $__rate_interval, $__range and each $variable (an "All" is `.*`) replaced."""
    expr = expr.replace("$__rate_interval", rate_interval).replace("$__range", range_)
    for name, value in sorted(variables.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(f"${{{name}}}", value).replace(f"${name}", value)
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


def alert_rules() -> list[dict]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"] if "alert" in r]
