"""The Prometheus configuration a Prometheus Operator generates from PodMonitors, ServiceMonitors and
PrometheusRules, made by the operator's own generator (`prometheus-config`, hack/tools/prometheus-config,
built by `make tools`) for a Prometheus resource like the one kube-prometheus-stack installs; and the one
change Prometheus needs to run it outside a pod (`outside_pod`)."""

from __future__ import annotations

import copy
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from chart.tools import tool

if TYPE_CHECKING:
    from support.cluster import Cluster

# Where the operator's StatefulSet mounts the rule ConfigMaps (pkg/prometheus RulesDir).
RULES_DIR = "/etc/prometheus/rules"

# What kube-prometheus-stack's Prometheus ClusterRole grants its service account, for discovery and scrapes.
DISCOVERY_RULES = [
    {
        "apiGroups": [""],
        "resources": ["nodes", "nodes/metrics", "services", "endpoints", "pods"],
        "verbs": ["get", "list", "watch"],
    },
    {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": ["networking.k8s.io"], "resources": ["ingresses"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"]},
    {"nonResourceURLs": ["/metrics", "/metrics/cadvisor"], "verbs": ["get"]},
]


def prometheus_version(binary: str) -> str:
    """`prometheus --version`'s version, as a Prometheus resource's spec.version names it (v3.16.0)."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"version (\d+\.\d+\.\d+)", out)
    assert m, out
    return "v" + m.group(1)


def prometheus_resource(name: str, namespace: str, release: str, version: str, interval: str) -> dict:
    """A Prometheus resource as kube-prometheus-stack makes it: monitors and rules of every namespace that
    carry its `release` label."""
    selector = {"matchLabels": {"release": release}}
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "Prometheus",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "version": version,
            "scrapeInterval": interval,
            "evaluationInterval": interval,
            "serviceMonitorSelector": selector,
            "serviceMonitorNamespaceSelector": {},
            "podMonitorSelector": selector,
            "podMonitorNamespaceSelector": {},
            "ruleSelector": selector,
            "ruleNamespaceSelector": {},
        },
    }


@dataclass
class Generated:
    config: dict[str, Any]  # prometheus.env.yaml: what the config-reloader hands Prometheus in the pod
    rules: Path  # the rule ConfigMaps' files, one folder per ConfigMap (mounted under RULES_DIR in the pod)
    log: str  # the generator's stderr (its selection summary, the operator's warnings)


def generate(prometheus: dict, objects: list[dict], workdir: Path) -> Generated:
    """Runs the operator's generator on `objects` (PodMonitors, ServiceMonitors, PrometheusRules,
    Namespaces) for the Prometheus resource `prometheus`."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "prometheus-resource.yaml").write_text(yaml.safe_dump(prometheus))
    (workdir / "objects.yaml").write_text(yaml.safe_dump_all(objects))
    out = workdir / "generated"
    argv = [tool("prometheus-config"), "-prometheus", str(workdir / "prometheus-resource.yaml")]
    r = subprocess.run(
        [*argv, "-out", str(out), str(workdir / "objects.yaml")], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    config = yaml.safe_load((out / "prometheus.env.yaml").read_text())
    return Generated(config, out / "rules", r.stderr)


def outside_pod(gen: Generated, api_server: str, ca_file: Path, token_file: Path) -> dict[str, Any]:
    """The generated configuration for a Prometheus process on the host instead of in a pod. In the pod,
    Kubernetes discovery finds the API server, its CA and the service account's token where a kubelet puts
    them (in-cluster config); here each kubernetes_sd_config names the same three, and the rule files are
    read from where the generator wrote the ConfigMaps instead of where the pod mounts them. Nothing else
    changes."""
    config = copy.deepcopy(gen.config)
    for job in config.get("scrape_configs", []):
        for sd in job.get("kubernetes_sd_configs", []):
            assert not {"api_server", "kubeconfig_file", "authorization", "tls_config"} & sd.keys(), sd
            sd["api_server"] = api_server
            sd["tls_config"] = {"ca_file": str(ca_file)}
            sd["authorization"] = {"credentials_file": str(token_file)}
    rule_files = []
    for pattern in config.get("rule_files", []):
        assert pattern.startswith(RULES_DIR + "/"), pattern
        rule_files.append(str(gen.rules) + pattern.removeprefix(RULES_DIR))
    config["rule_files"] = rule_files
    return config


def discovery_token(cluster: Cluster, namespace: str, name: str, workdir: Path) -> Path:
    """A service account `name` in `namespace` with kube-prometheus-stack's Prometheus ClusterRole, and a
    file holding a token of it (what a kubelet gives the Prometheus pod)."""
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": f"{namespace}-{name}"},
        "rules": DISCOVERY_RULES,
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": f"{namespace}-{name}"},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": f"{namespace}-{name}",
        },
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
    }
    ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
    sa = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name, "namespace": namespace}}
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([ns, sa, role, binding]))
    token = cluster.kubectl("create", "token", name, "-n", namespace, "--duration=2h").stdout.strip()
    path = workdir / "token"
    path.write_text(token)
    path.chmod(0o600)
    return path
