"""A real Prometheus (`make tools`) for the tests, on a loopback port: with a plain configuration
(`static_config`) or the one the Prometheus Operator generates from the chart's monitors
(monitoring/operator_config.py)."""

from __future__ import annotations

import json
import math
import time
import urllib.parse
import urllib.request
from collections.abc import Collection
from pathlib import Path
from typing import Any

import yaml

from monitoring.dashboards import load, queries, substitute, variable_queries
from support.procs import free_port, spawn, stop


def static_config(
    workdir: Path, scrape_configs: list[dict], rule_groups: list[dict], interval: str = "2s"
) -> dict[str, Any]:
    """A plain configuration: these scrape configs, and the rule groups written to a rule file in `workdir`."""
    (workdir / "rules.yaml").write_text(yaml.safe_dump({"groups": rule_groups}))
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": [str(workdir / "rules.yaml")],
        "scrape_configs": scrape_configs,
    }


class Prometheus:
    """`prometheus` on a loopback port with the given configuration, in `workdir`."""

    def __init__(self, binary: str, workdir: Path, config: dict[str, Any]) -> None:
        self.workdir, self.port = workdir, free_port()
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
        self.log = workdir / "prometheus.log"
        argv = [
            binary,
            f"--config.file={workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ]
        self.proc = spawn(argv, log_path=self.log)

    def api(self, path: str, **params: str) -> Any:
        if self.proc.poll() is not None:
            raise RuntimeError(f"prometheus exited: {self.log.read_text()[-2000:]}")
        url = f"http://127.0.0.1:{self.port}{path}" + ("?" + urllib.parse.urlencode(params) if params else "")
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.log.read_text()[-2000:]}") from None
            return False

    def query(self, expr: str) -> list[dict]:
        return self.api("/api/v1/query", query=expr, time=str(time.time()))["result"]

    def targets(self) -> list[dict]:
        return self.api("/api/v1/targets", state="active")["activeTargets"]

    def unanswered(
        self,
        dashboard: Path,
        variables: dict[str, str],
        rate_interval: str,
        range_: str,
        skip: Collection[str] = (),
    ) -> tuple[int, list[str]]:
        """Every panel, annotation and variable query of `dashboard` but those of the panels titled in `skip`,
        sent as Grafana would: how many ran, and those that returned no series or only NaN."""
        board, checked, bad = load(dashboard), 0, []
        asked = [(w, e) for w, e in queries(board) if not any(w.startswith(f"panel {t!r} ") for t in skip)]
        for where, expr in [*asked, *variable_queries(board)]:
            result = self.query(substitute(expr, rate_interval, range_, variables))
            checked += 1
            if not result:
                bad.append(f"{dashboard.stem}: {where}: no data: {expr}")
            elif all(math.isnan(float(s["value"][1])) for s in result):
                bad.append(f"{dashboard.stem}: {where}: only NaN: {expr}")
        return checked, bad

    def evaluated_alerts(self) -> list[dict]:
        """The alerting rules once each has been evaluated at least once (until then, [])."""
        rules = [
            r for g in self.api("/api/v1/rules")["groups"] for r in g["rules"] if r["type"] == "alerting"
        ]
        return rules if rules and all(r.get("lastEvaluation", "").startswith("20") for r in rules) else []

    def stop(self) -> None:
        stop(self.proc, grace=20)
