"""The chart without a cluster: the real helm lints and renders it; each toggle adds or removes exactly its
objects; the RBAC and CRDs equal their sources (operator/rbac.py, crds/); the schema refuses wrong values
naming the field."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from chart.tools import CHART, Helm, kinds
from kvpilot.operator import rbac
from kvpilot.operator.fleets.router_objects import router_labels
from support import ROOT

MONITORING_API = ("--api-versions", "monitoring.coreos.com/v1")
TOGGLES = {
    "monitoring.podMonitor.enabled": "PodMonitor",
    "monitoring.serviceMonitor.enabled": "ServiceMonitor",
    "monitoring.prometheusRule.enabled": "PrometheusRule",
}


def triples(rules: list[dict]) -> set[tuple[str, str, str]]:
    return {
        (g, r, v)
        for rule in rules
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }


def test_chart_equals_its_sources() -> None:
    """hack/chart/sync.py --check: chart CRDs are byte copies of crds/, files/rbac-rules.yaml is rbac.py's."""
    r = subprocess.run(
        [sys.executable, str(ROOT / "hack" / "chart" / "sync.py"), "--check"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    for src in (ROOT / "crds").glob("*.yaml"):
        assert (CHART / "crds" / src.name).read_bytes() == src.read_bytes()


def test_sync_check_notices_drift(tmp_path: Path) -> None:
    """The check can fail: in a copy of the sources with one chart CRD edited, it names the stale file."""
    for part in ("hack/chart", "crds", "charts/kvpilot"):
        shutil.copytree(ROOT / part, tmp_path / part)
    stale = tmp_path / "charts" / "kvpilot" / "crds" / "prefixcachereset.yaml"
    stale.write_bytes(stale.read_bytes() + b"# drift\n")
    r = subprocess.run(
        [sys.executable, str(tmp_path / "hack" / "chart" / "sync.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1 and "charts/kvpilot/crds/prefixcachereset.yaml" in r.stderr, r.stderr


@pytest.mark.parametrize(
    "values",
    [
        [],
        [
            "--set",
            "monitoring.force=true",
            "--set",
            "monitoring.podMonitor.enabled=true",
            "--set",
            "monitoring.serviceMonitor.enabled=true",
            "--set",
            "monitoring.prometheusRule.enabled=true",
            "--set",
            "monitoring.dashboards.enabled=true",
            "--set",
            "operator.watchNamespaces={a,b}",
        ],
    ],
    ids=["defaults", "everything-on"],
)
def test_lint_strict(helm: Helm, values: list[str]) -> None:
    r = helm("lint", "--strict", str(CHART), *values)
    assert "1 chart(s) linted, 0 chart(s) failed" in r.stdout, r.stdout


def test_defaults(helm: Helm) -> None:
    objs = kinds(helm.template())
    assert set(objs) == {
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Deployment",
        "Service",
        "Role",
        "RoleBinding",
        "ConfigMap",
        "Pod",
    }
    # The Role/RoleBinding/ConfigMap/Pod/second ServiceAccount are the `helm test` hook's, nothing else.
    hooks = [o for k in ("Role", "RoleBinding", "ConfigMap", "Pod") for o in objs[k]]
    assert all(o["metadata"]["annotations"]["helm.sh/hook"] == "test" for o in hooks)

    edit, operator_role, router_role, view = sorted(objs["ClusterRole"], key=lambda o: o["metadata"]["name"])
    assert operator_role["metadata"]["name"] == "kvpilot-operator"
    # Rendered from operator/rbac.py, rule for rule; the one role the operator may bind is the release's.
    assert operator_role["rules"] == rbac.operator_rules(True, "kvpilot-router")[0]
    assert router_role["metadata"]["name"] == "kvpilot-router" and router_role["rules"] == rbac.ROUTER_RULES
    assert (
        "--router-cluster-role=kvpilot-router"
        in objs["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]["args"]
    )
    # Bound to the operator alone; the routers get it through the operator's RoleBindings.
    assert [b["roleRef"]["name"] for b in objs["ClusterRoleBinding"]] == ["kvpilot-operator"]
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    assert {v for r in view["rules"] for v in r["verbs"]} == {"get", "list", "watch"}

    (dep,) = objs["Deployment"]
    spec = dep["spec"]
    pod = spec["template"]["spec"]
    (c,) = pod["containers"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    assert c["command"] == ["kvpilot"] and "operator" in c["args"] and "--peering=kvpilot" in c["args"]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"health": 8080, "metrics": 9090}
    assert pod["securityContext"]["runAsNonRoot"] and c["securityContext"]["readOnlyRootFilesystem"]
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    # Longer than a reset call's default timeout (requestTimeoutSeconds 10) plus the final status write.
    assert pod["terminationGracePeriodSeconds"] > 10
    assert c["image"] == "ghcr.io/kvpilot/kvpilot:0.1.0" and c["imagePullPolicy"] == "IfNotPresent"
    (svc,) = objs["Service"]
    assert (
        svc["spec"]["ports"][0]["name"] == "metrics"
        and svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    )


@pytest.mark.parametrize("value", TOGGLES)
def test_monitor_toggles(helm: Helm, value: str) -> None:
    kind = TOGGLES[value]
    assert kind not in kinds(helm.template(*MONITORING_API)), "off by default"
    assert kind in kinds(helm.template("--set", f"{value}=true", *MONITORING_API))
    # Enabled, but the cluster does not serve monitoring.coreos.com/v1: nothing, unless forced.
    assert kind not in kinds(helm.template("--set", f"{value}=true"))
    assert kind in kinds(helm.template("--set", f"{value}=true", "--set", "monitoring.force=true"))
    others = set(TOGGLES.values()) - {kind}
    assert not others & set(kinds(helm.template("--set", f"{value}=true", *MONITORING_API)))


def notes(helm: Helm, tmp_path: Path, *args: str) -> str:
    """NOTES.txt as `helm install` prints it. `helm template` never renders NOTES.txt, so a copy of the chart
    renders it with `tpl` into one more object: the same values and capabilities, no cluster."""
    chart = tmp_path / "kvpilot"
    shutil.copytree(CHART, chart)
    shutil.copy(chart / "templates" / "NOTES.txt", chart / "notes.txt")
    (chart / "templates" / "notes.yaml").write_text('notes: {{ tpl (.Files.Get "notes.txt") . | toJson }}\n')
    out = helm(
        "template",
        "kvpilot",
        str(chart),
        "--namespace",
        "kvpilot-system",
        "--show-only",
        "templates/notes.yaml",
        *args,
    ).stdout
    return yaml.safe_load(out)["notes"]


def test_notes_say_how_to_get_the_monitoring_api(helm: Helm, tmp_path: Path) -> None:
    """Monitors enabled on a cluster without the Prometheus Operator's CRDs: the notes say none was created and
    give the commands that apply the CRDs (as README's Monitoring block does); with the API served, no word."""
    on = ("--set", "monitoring.podMonitor.enabled=true")
    text = notes(helm, tmp_path, *on)
    assert "does not serve\nmonitoring.coreos.com/v1" in text and "none was created" in text, text
    assert 'kubectl apply --server-side -f "$(make -s tools-bindir)/../crds"' in text, text
    assert "helm upgrade again" in text and "monitoring.force=true" in text, text
    shutil.rmtree(tmp_path / "kvpilot")
    assert "WARNING" not in notes(helm, tmp_path, *on, *MONITORING_API)


def test_monitors_select_the_daemons_routers_and_operator(helm: Helm) -> None:
    objs = kinds(
        helm.template(
            "--set",
            "monitoring.podMonitor.enabled=true",
            "--set",
            "monitoring.serviceMonitor.enabled=true",
            "--set",
            "monitoring.labels.release=prom",
            *MONITORING_API,
        )
    )
    pm, routers = objs["PodMonitor"]
    (sm,) = objs["ServiceMonitor"]
    assert {o["metadata"]["labels"]["release"] for o in (pm, routers, sm)} == {"prom"}
    assert pm["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/component": "inference",
        "app.kubernetes.io/managed-by": "kvpilot-operator",
    }
    assert pm["spec"]["namespaceSelector"] == {"any": True}
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "http"
    # The operator's router pods (router_objects.router_labels), with their `pod` label (the daemon) kept.
    assert routers["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/component": "router",
        "app.kubernetes.io/managed-by": "kvpilot-operator",
    }
    assert routers["spec"]["selector"]["matchLabels"].items() <= router_labels("llm").items()
    (ep,) = routers["spec"]["podMetricsEndpoints"]
    assert ep["port"] == "http" and ep["honorLabels"] is True
    assert {"targetLabel": "job", "replacement": "kvpilot-router"} in ep["relabelings"]
    (svc,) = objs["Service"]
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] == "metrics" and sm["spec"]["endpoints"][0]["honorLabels"]


def test_prometheus_rule_carries_the_alert_file(helm: Helm) -> None:
    (rule,) = kinds(helm.template("--set", "monitoring.prometheusRule.enabled=true", *MONITORING_API))[
        "PrometheusRule"
    ]
    assert rule["spec"] == yaml.safe_load((CHART / "alerts" / "kvpilot-alerts.yaml").read_text())
    assert "{{ $labels.namespace }}" in json.dumps(rule["spec"]), (
        "Prometheus templates pass through helm untouched"
    )


def test_dashboards_toggle(helm: Helm) -> None:
    assert not [
        c
        for c in kinds(helm.template()).get("ConfigMap", [])
        if "grafana_dashboard" in c["metadata"]["labels"]
    ]
    maps = [
        c
        for c in kinds(
            helm.template(
                "--set",
                "monitoring.dashboards.enabled=true",
                "--set",
                "monitoring.dashboards.namespace=grafana",
            )
        )["ConfigMap"]
        if c["metadata"]["labels"].get("grafana_dashboard") == "1"
    ]
    files = {p.name: json.loads(p.read_text()) for p in (CHART / "dashboards").glob("*.json")}
    assert {k: json.loads(v) for c in maps for k, v in c["data"].items()} == files
    assert {c["metadata"]["namespace"] for c in maps} == {"grafana"}


def test_watch_namespaces(helm: Helm) -> None:
    objs = kinds(helm.template("--set", "operator.watchNamespaces={team-a,team-b}"))
    cluster_rules, role_rules = rbac.operator_rules(False, "kvpilot-router")
    (dep,) = objs["Deployment"]
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args
    roles = [r for r in objs["Role"] if "helm.sh/hook" not in (r["metadata"].get("annotations") or {})]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    bindings = [
        b for b in objs["RoleBinding"] if "helm.sh/hook" not in (b["metadata"].get("annotations") or {})
    ]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    (cluster_role,) = [r for r in objs["ClusterRole"] if r["metadata"]["name"] == "kvpilot-operator"]
    # Cluster-wide only what cannot be namespaced (kopf's discovery); no Secret, no workload beyond the
    # watched namespaces. Rendered from operator/rbac.py, rule for rule.
    assert {r for _, r, _ in triples(cluster_role["rules"])} == {"customresourcedefinitions", "namespaces"}
    assert cluster_role["rules"] == cluster_rules
    assert all(r["rules"] == role_rules for r in roles)
    assert ("", "secrets", "get") in triples(role_rules)


@pytest.mark.parametrize(
    "values", [[], ["--set", "operator.watchNamespaces={team-a,team-b}"]], ids=["cluster-wide", "namespaced"]
)
def test_peering_object_is_the_operators_not_the_charts(helm: Helm, values: list[str]) -> None:
    """The operator makes its peering object when missing (it may exist already, made by an operator run by hand
    or shared with another release): the chart renders none, only names it and lets the operator create it."""
    objs = kinds(helm.template("--set", "peering.name=team", *values))
    assert "ClusterKopfPeering" not in objs and "KopfPeering" not in objs
    assert "--peering=team" in objs["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]["args"]
    # ... which its rights allow: in each watched namespace, or cluster-wide.
    if values:
        roles = [r for r in objs["Role"] if "helm.sh/hook" not in (r["metadata"].get("annotations") or {})]
        assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
        assert all(("kopf.dev", "kopfpeerings", "create") in triples(r["rules"]) for r in roles)
    else:
        (role,) = [r for r in objs["ClusterRole"] if r["metadata"]["name"] == "kvpilot-operator"]
        assert ("kopf.dev", "clusterkopfpeerings", "create") in triples(role["rules"])
        assert ("kopf.dev", "kopfpeerings", "create") not in triples(role["rules"])


def test_values_reach_the_deployment(helm: Helm) -> None:
    (dep,) = kinds(
        helm.template(
            "--set",
            "image.repository=registry.local/kvpilot",
            "--set",
            "image.tag=dev",
            "--set",
            "image.pullPolicy=Always",
            "--set",
            "operator.logLevel=DEBUG",
            "--set",
            "operator.replicas=0",
        )
    )["Deployment"]
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["image"] == "registry.local/kvpilot:dev" and c["imagePullPolicy"] == "Always"
    assert "--log-level=DEBUG" in c["args"] and dep["spec"]["replicas"] == 0


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["--set", "operator.replica=2"], "replica"),  # a typo of replicas
        (["--set", "operator.replicas=2"], "replicas"),  # two peers of equal priority would both pause
        (["--set", "operator.replicas=one"], "replicas"),
        (["--set", "image.pullPolicy=Sometimes"], "pullPolicy"),
        (["--set", "operator.logLevel=LOUD"], "logLevel"),
        (["--set", "operator.watchNamespaces={Not_A_Namespace}"], "watchNamespaces"),
        (["--set", "monitoring.podMonitor.enabled=yes please"], "enabled"),
        (["--set", "monitoring.grafana=true"], "grafana"),
        (["--set", "operator.resources.requests.cpu=lots"], "cpu"),
        (["--set", "operator.terminationGracePeriodSeconds=5"], "terminationGracePeriodSeconds"),
        (["--set", "peering.install=false"], "install"),  # chart 0.1.0's; the operator owns the object now
    ],
)
def test_schema_refuses_wrong_values(helm: Helm, args: list[str], field: str) -> None:
    r = helm("template", "kvpilot", str(CHART), *args, check=False)
    assert r.returncode != 0, r.stdout[:500]
    assert "values don't meet the specifications of the schema" in r.stderr and field in r.stderr, r.stderr
