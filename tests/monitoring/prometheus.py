"""A real Prometheus (`make tools`) for the tests: its scrape configs translated from the chart's PodMonitor
and ServiceMonitor objects the way the Prometheus Operator generates them (Kubernetes service discovery,
the selector as `keep` rules, the standard target labels, then the objects' own relabelings), and its rules
from the PrometheusRule. `via_http_sd` swaps the discovery for kubernetes_sd.KubernetesSD where the binary
lacks `kubernetes_sd_configs` (Debian's build)."""

from __future__ import annotations

import json
import math
import re
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from monitoring.dashboards import load, queries, substitute, variable_queries
from monitoring.kubernetes_sd import KubernetesSD
from support.procs import free_port, spawn, stop

_RELABEL_KEYS = {
    "sourceLabels": "source_labels",
    "separator": "separator",
    "targetLabel": "target_label",
    "regex": "regex",
    "modulus": "modulus",
    "replacement": "replacement",
    "action": "action",
}


def _sanitize(label: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", label)


def _relabel(r: dict[str, Any]) -> dict[str, Any]:
    """A prometheus-operator RelabelConfig (camelCase) as Prometheus' relabel_config."""
    out = {_RELABEL_KEYS[k]: v for k, v in r.items()}
    if "action" in out:
        out["action"] = out["action"].lower()
    return out


def _selector(meta: str, selector: dict[str, Any]) -> list[dict[str, Any]]:
    assert not selector.get("matchExpressions"), "matchExpressions are not translated"
    return [
        {
            "source_labels": [f"{meta}_label_{_sanitize(k)}", f"{meta}_labelpresent_{_sanitize(k)}"],
            "regex": f"({v});true",
            "action": "keep",
        }
        for k, v in selector.get("matchLabels", {}).items()
    ]


def _sd(
    role: str, namespace_selector: dict[str, Any], own_ns: str, api: dict[str, Any] | None
) -> dict[str, Any]:
    """A kubernetes_sd_config; `api`: api_server, tls_config, authorization (none: in-cluster)."""
    sd: dict[str, Any] = {"role": role, **(api or {})}
    if not namespace_selector.get("any"):
        sd["namespaces"] = {"names": namespace_selector.get("matchNames") or [own_ns]}
    return sd


def _endpoint_job(
    kind: str,
    obj: dict[str, Any],
    i: int,
    ep: dict[str, Any],
    sd: dict[str, Any],
    relabels: list[dict[str, Any]],
) -> dict[str, Any]:
    job: dict[str, Any] = {
        "job_name": f"{kind}/{obj['metadata']['namespace']}/{obj['metadata']['name']}/{i}",
        "honor_labels": bool(ep.get("honorLabels", False)),
        "kubernetes_sd_configs": [sd],
        "metrics_path": ep.get("path", "/metrics"),
        "relabel_configs": relabels + [_relabel(r) for r in ep.get("relabelings", [])],
    }
    if ep.get("interval"):
        job["scrape_interval"] = job["scrape_timeout"] = ep["interval"]
    return job


def pod_monitor_jobs(pm: dict[str, Any], api: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    spec, ns = pm["spec"], pm["metadata"]["namespace"]
    jobs = []
    for i, ep in enumerate(spec["podMetricsEndpoints"]):
        m = "__meta_kubernetes_pod"
        relabels = [
            *_selector(m, spec["selector"]),
            {"source_labels": [f"{m}_container_port_name"], "regex": ep["port"], "action": "keep"},
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": [f"{m}_container_name"], "target_label": "container"},
            {"source_labels": [f"{m}_name"], "target_label": "pod"},
            {"target_label": "job", "replacement": f"{ns}/{pm['metadata']['name']}"},
            {"target_label": "endpoint", "replacement": ep["port"]},
        ]
        sd = _sd("pod", spec.get("namespaceSelector", {}), ns, api)
        jobs.append(_endpoint_job("podMonitor", pm, i, ep, sd, relabels))
    return jobs


def service_monitor_jobs(sm: dict[str, Any], api: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    spec, ns = sm["spec"], sm["metadata"]["namespace"]
    jobs = []
    for i, ep in enumerate(spec["endpoints"]):
        relabels = [
            *_selector("__meta_kubernetes_service", spec["selector"]),
            {
                "source_labels": ["__meta_kubernetes_endpointslice_port_name"],
                "regex": ep["port"],
                "action": "keep",
            },
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "service"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
            {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "job"},
            {"target_label": "endpoint", "replacement": ep["port"]},
        ]
        sd = _sd("endpointslice", spec.get("namespaceSelector", {}), ns, api)
        jobs.append(_endpoint_job("serviceMonitor", sm, i, ep, sd, relabels))
    return jobs


def via_http_sd(jobs: list[dict[str, Any]], sd: KubernetesSD) -> list[dict[str, Any]]:
    """The same jobs with each kubernetes_sd_config served by `sd` over http_sd_configs."""
    out = []
    for job in jobs:
        job = dict(job)
        configs = job.pop("kubernetes_sd_configs")
        job["http_sd_configs"] = [
            sd.sd_config(c["role"], (c.get("namespaces") or {}).get("names")) for c in configs
        ]
        out.append(job)
    return out


class Prometheus:
    """`prometheus` on a loopback port with the given scrape configs and rule groups, in `workdir`."""

    def __init__(
        self,
        binary: str,
        workdir: Path,
        scrape_configs: list[dict],
        rule_groups: list[dict],
        interval: str = "2s",
    ) -> None:
        self.workdir, self.port = workdir, free_port()
        (workdir / "rules.yaml").write_text(yaml.safe_dump({"groups": rule_groups}))
        config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": [str(workdir / "rules.yaml")],
            "scrape_configs": scrape_configs,
        }
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
        self, dashboard: Path, variables: dict[str, str], rate_interval: str, range_: str
    ) -> tuple[int, list[str]]:
        """Every panel, annotation and variable query of `dashboard`, sent as Grafana would: how many ran, and
        those that returned no series or only NaN."""
        board, checked, bad = load(dashboard), 0, []
        for where, expr in [*queries(board), *variable_queries(board)]:
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
