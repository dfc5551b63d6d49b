"""The alert rules (charts/kvpilot/alerts/kvpilot-alerts.yaml) with the real promtool: they load, and each
alert's unit tests (alerts_test.yaml) pass, covering both a firing and a silent case per alert."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml
from chart.tools import tool

from monitoring.dashboards import ALERTS, alert_rules

HERE = Path(__file__).resolve().parent
UNIT_TESTS = HERE / "alerts_test.yaml"


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([tool("promtool"), *args], cwd=HERE, capture_output=True, text=True, timeout=120)


def test_rules_load_in_promtool() -> None:
    r = promtool("check", "rules", str(ALERTS))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in r.stdout


def test_alert_unit_tests_pass() -> None:
    r = promtool("test", "rules", str(UNIT_TESTS))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_every_alert_has_a_firing_and_a_silent_case() -> None:
    firing: set[str] = set()
    silent: set[str] = set()
    for case in yaml.safe_load(UNIT_TESTS.read_text())["tests"]:
        for t in case.get("alert_rule_test", []):
            (firing if t["exp_alerts"] else silent).add(t["alertname"])
    names = {r["alert"] for r in alert_rules()}
    assert names - firing == set(), "alerts never tested firing"
    assert names - silent == set(), "alerts never tested silent"


def test_a_broken_expectation_fails(tmp_path: Path) -> None:
    """The unit tests can fail: the same file, expecting the daemon alert 2 minutes early, is refused."""
    doc = yaml.safe_load(UNIT_TESTS.read_text())
    doc["rule_files"] = [str(ALERTS)]
    for case in doc["tests"]:
        for t in case.get("alert_rule_test", []):
            if t["alertname"] == "KvpilotDaemonDown" and t["exp_alerts"]:
                t["eval_time"] = "10m"
    broken = tmp_path / "broken_test.yaml"
    broken.write_text(yaml.safe_dump(doc))
    r = promtool("test", "rules", str(broken))
    assert r.returncode != 0 and "KvpilotDaemonDown" in r.stdout + r.stderr, r.stdout + r.stderr
