"""The chart's monitors through the Prometheus Operator's own configuration generator (`prometheus-config`,
no cluster): the scrape configs use Kubernetes service discovery with the operator's relabeling and the
monitors' own, the rule file is the PrometheusRule's groups, a monitor without the label the Prometheus
selects on is left out, and promtool accepts the configuration as the tests run it outside a pod."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from chart.tools import Helm, tool

from monitoring.operator_config import (
    RULES_DIR,
    Generated,
    generate,
    outside_pod,
    prometheus_resource,
    prometheus_version,
)

NS, RELEASE = "kvpilot-system", "kube-prometheus-stack"
MONITORS = [
    *("--set", "monitoring.force=true"),
    *("--set", "monitoring.podMonitor.enabled=true"),
    *("--set", "monitoring.serviceMonitor.enabled=true"),
    *("--set", "monitoring.prometheusRule.enabled=true"),
]


def generated(tmp_path: Path, helm: Helm, *values: str, release: str = RELEASE) -> Generated:
    resource = prometheus_resource(
        "k8s", "monitoring", release, prometheus_version(tool("prometheus")), interval="30s"
    )
    return generate(resource, helm.template(*MONITORS, *values), tmp_path)


@pytest.fixture(scope="module")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    return Helm(tmp_path_factory.mktemp("helm"))


def by_name(config: dict) -> dict[str, dict]:
    return {j["job_name"]: j for j in config["scrape_configs"]}


def test_the_operator_generates_kubernetes_sd_scrape_configs(tmp_path: Path, helm: Helm) -> None:
    gen = generated(tmp_path, helm, "--set", f"monitoring.labels.release={RELEASE}")
    jobs = by_name(gen.config)
    daemons, routers = jobs[f"podMonitor/{NS}/kvpilot-daemons/0"], jobs[f"podMonitor/{NS}/kvpilot-routers/0"]
    operator = jobs[f"serviceMonitor/{NS}/kvpilot-operator/0"]
    assert len(jobs) == 3, list(jobs)
    # Every namespace for the PodMonitors (namespaceSelector any), the release's for the ServiceMonitor.
    assert daemons["kubernetes_sd_configs"] == routers["kubernetes_sd_configs"] == [{"role": "pod"}]
    assert operator["kubernetes_sd_configs"] == [{"role": "endpoints", "namespaces": {"names": [NS]}}]
    assert not any("http_sd_configs" in j or "static_configs" in j for j in jobs.values())
    assert [daemons["honor_labels"], routers["honor_labels"], operator["honor_labels"]] == [False, True, True]

    relabel = daemons["relabel_configs"]
    assert {
        "action": "keep",
        "source_labels": [
            "__meta_kubernetes_pod_label_app_kubernetes_io_component",
            "__meta_kubernetes_pod_labelpresent_app_kubernetes_io_component",
        ],
        "regex": "(inference);true",
    } in relabel
    assert {
        "action": "keep",
        "source_labels": ["__meta_kubernetes_pod_container_port_name"],
        "regex": "http",
    } in relabel
    # The PodMonitor's own relabelings come after the operator's job label, so job="kvpilot-daemon" wins.
    targets = [r.get("target_label") for r in relabel]
    assert targets.index("deployment") > targets.index("job")
    assert {"target_label": "job", "replacement": "kvpilot-daemon"} in relabel
    assert {"target_label": "job", "replacement": "kvpilot-operator"} in operator["relabel_configs"]
    # The config-reloader's variables are expanded, as in the pod.
    assert "$(" not in yaml.safe_dump(gen.config)
    assert gen.config["global"]["external_labels"]["prometheus_replica"] == "prometheus-k8s-0"

    # The rule file (the operator's ConfigMap) is the PrometheusRule's groups.
    assert gen.config["rule_files"] == [f"{RULES_DIR}/prometheus-k8s-rulefiles-0/*.yaml"]
    (rule_file,) = (gen.rules / "prometheus-k8s-rulefiles-0").glob("*.yaml")
    (rule,) = [o for o in helm.template(*MONITORS) if o["kind"] == "PrometheusRule"]
    assert yaml.safe_load(rule_file.read_text()) == rule["spec"]


def test_monitors_without_the_selected_label_are_left_out(tmp_path: Path, helm: Helm) -> None:
    gen = generated(tmp_path, helm, "--set", "monitoring.labels.release=other")
    assert not gen.config.get("scrape_configs") and not gen.config.get("rule_files"), gen.config
    assert "0 ServiceMonitors, 0 PodMonitors, 0 rule files selected" in gen.log, gen.log


def test_promtool_accepts_the_configuration_as_run_outside_a_pod(tmp_path: Path, helm: Helm) -> None:
    gen = generated(tmp_path / "gen", helm, "--set", f"monitoring.labels.release={RELEASE}")
    (tmp_path / "ca.crt").write_text("")
    (tmp_path / "token").write_text("token")
    config = outside_pod(gen, "https://127.0.0.1:6443", tmp_path / "ca.crt", tmp_path / "token")
    for job in config["scrape_configs"]:
        for sd in job["kubernetes_sd_configs"]:
            assert sd["api_server"] == "https://127.0.0.1:6443"
            assert sd["authorization"] == {"credentials_file": str(tmp_path / "token")}
    # Only those keys were added: dropped again, the configuration is the generated one.
    stripped = yaml.safe_load(yaml.safe_dump(config))
    for job in stripped["scrape_configs"]:
        for sd in job["kubernetes_sd_configs"]:
            for key in ("api_server", "tls_config", "authorization"):
                del sd[key]
    stripped["rule_files"] = gen.config["rule_files"]
    assert stripped == gen.config
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    r = subprocess.run(
        [tool("promtool"), "check", "config", str(tmp_path / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 1 rule files found" in r.stdout, r.stdout
