"""The chart on a dev cluster of its own, a node of the real kubelet and containerd running the project's image
(the chart's default image, tagged on the node), in the order a user meets it (one install shared by the module):
every rendered object passes the API server's dry run; `helm install --wait` runs the operator in the cluster;
it runs an InferenceDeployment of 2 real daemons and a router, and resets them (no operator process outside
the cluster); a real Prometheus, configured from the installed PodMonitors, ServiceMonitor and PrometheusRule,
scrapes them, answers every daemon and operator dashboard query (the router's variables and labels too) and
loads every alert; `helm test`; namespace edit/view users get
kvpilot's resources; `helm upgrade` rolls the operator; a wrong value is refused; `helm uninstall` leaves
only the CRDs. kopf's peering object is the operator's, never the release's: upgrade and uninstall leave it as
it is, and `helm install` after an operator run by hand (the README's order), which made it, succeeds.

Timings (install -> Ready, reset -> Complete) are printed and written to $KVPILOT_CHART_TIMINGS if set."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from monitoring.dashboards import (
    DASHBOARDS,
    DISAGGREGATION_ROW,
    ROUTER_DASHBOARD,
    load,
    row_panels,
    substitute,
    variable_queries,
)
from monitoring.operator_config import (
    discovery_token,
    generate,
    outside_pod,
    prometheus_resource,
    prometheus_version,
)
from monitoring.prometheus import Prometheus

from chart.tools import CHART, Helm, apply_monitoring_crds, tool
from support import ROOT
from support.cluster import Cluster, kubelet_cluster, needs_kubelet_node
from support.procs import free_port, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900), needs_kubelet_node]

RELEASE, RELEASE_NS, FLEET_NS = "kvpilot", "kvpilot-system", "chart-fleet"
OPERATOR = "kvpilot-operator"
# The Prometheus a kube-prometheus-stack release of this name runs, and the label its selectors ask for.
PROMETHEUS_RELEASE, PROMETHEUS_NS = "kube-prometheus-stack", "monitoring"
MONITORING = [
    "--set",
    "monitoring.podMonitor.enabled=true",
    "--set",
    "monitoring.podMonitor.interval=2s",
    "--set",
    "monitoring.serviceMonitor.enabled=true",
    "--set",
    "monitoring.serviceMonitor.interval=2s",
    "--set",
    "monitoring.prometheusRule.enabled=true",
    "--set",
    "monitoring.dashboards.enabled=true",
    "--set",
    f"monitoring.labels.release={PROMETHEUS_RELEASE}",
]
PROMPT = (
    "Chart test: a prompt whose prefix the second request finds cached. " + "Lorem ipsum dolor sit amet. " * 8
)
INSTALL_WAIT = ("--create-namespace", "--wait", "--timeout=5m")
TIMINGS: dict[str, float] = {}
INSTALL: dict[str, str] = {}  # helm install's output (NOTES.txt)


def http(
    method: str, url: str, body: dict | None = None, token: str | None = None, timeout: float = 120
) -> dict:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode() if body is not None else None,
        method=method,
        headers={"Content-Type": "application/json"},
    )
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def helm_chart(
    kube_helm: Helm, verb: str, release: str, *args: str, check: bool = True, timeout: float = 300
) -> subprocess.CompletedProcess:
    """`helm VERB RELEASE charts/kvpilot -n kvpilot-system ARGS`."""
    return kube_helm(verb, release, str(CHART), "-n", RELEASE_NS, *args, check=check, timeout=timeout)


def warm(fleet: dict[str, str]) -> None:
    """Two completions of PROMPT on each daemon, on the base model and on its LoRA adapter `sql`: the second
    finds the prefix the first cached."""
    for ip in fleet.values():
        for model in (None, None, "sql", "sql"):
            http(
                "POST",
                f"http://{ip}:8000/v1/completions",
                {"prompt": PROMPT, "max_tokens": 4, "temperature": 0} | ({"model": model} if model else {}),
            )


@pytest.fixture(scope="module")
def cluster(project_image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """This module's own cluster (not the session's): the operator, the daemons and the router run as
    containers of the image users deploy, under `helm install` with the chart's defaults."""
    workdir = tmp_path_factory.mktemp("chart-cluster")
    # "dev": a user of no rights but the namespaces' edit and view roles bound to it here
    with kubelet_cluster(workdir, images=(project_image,), extra_users={"dev": ()}) as c:
        yield c


@pytest.fixture(scope="module")
def kube_helm(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Helm:
    return Helm(tmp_path_factory.mktemp("helm-cluster"), kubeconfig=cluster.kubeconfig)


@pytest.fixture(scope="module")
def release(cluster: Cluster, kube_helm: Helm) -> Iterator[None]:
    """`helm install --wait` with every monitoring toggle on; the time to a Ready operator is recorded."""
    apply_monitoring_crds(cluster)
    t0 = time.monotonic()
    r = helm_chart(kube_helm, "install", RELEASE, *INSTALL_WAIT, *MONITORING, timeout=400)
    INSTALL["notes"] = r.stdout
    TIMINGS["helm_install_to_ready_operator_s"] = round(time.monotonic() - t0, 2)
    yield
    kube_helm("uninstall", RELEASE, "-n", RELEASE_NS, "--wait", check=False)
    print(f"chart timings: {TIMINGS}", file=sys.stderr)
    if os.environ.get("KVPILOT_CHART_TIMINGS"):
        Path(os.environ["KVPILOT_CHART_TIMINGS"]).write_text(json.dumps(TIMINGS, indent=2) + "\n")


def operator_pod(cluster: Cluster, release: str = RELEASE) -> dict:
    pods = cluster.kubectl_json(
        "get",
        "pods",
        "-n",
        RELEASE_NS,
        "-l",
        f"app.kubernetes.io/component=operator,app.kubernetes.io/instance={release}",
    )
    live = [p for p in pods["items"] if not p["metadata"].get("deletionTimestamp")]
    assert len(live) == 1, [p["metadata"]["name"] for p in live]
    return live[0]


def is_ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))


def peering(cluster: Cluster) -> dict:
    """kopf's ClusterKopfPeering kvpilot; its status has an entry per live operator (user@host/...)."""
    return cluster.kubectl_json("get", "clusterkopfpeering", "kvpilot")


def peers(cluster: Cluster) -> list[str]:
    return list(peering(cluster).get("status") or {})


@pytest.fixture(scope="module")
def prometheus(
    cluster: Cluster, release: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Prometheus]:
    """A real Prometheus run as the Prometheus Operator of a kube-prometheus-stack release would run it: its
    configuration and rule files generated by the operator's own code from the PodMonitors, ServiceMonitor,
    PrometheusRule and Namespaces in the cluster, its targets found by Kubernetes service discovery through
    the API server with a service account of that release's rights (monitoring/operator_config.py)."""
    kinds = ("podmonitors", "servicemonitors", "prometheusrules")
    monitors = {k: cluster.kubectl_json("get", k, "-A")["items"] for k in kinds}
    # Two PodMonitors (daemons, routers), the operator's ServiceMonitor, the alerts.
    assert [len(v) for v in monitors.values()] == [2, 1, 1], {k: len(v) for k, v in monitors.items()}
    namespaces = cluster.kubectl_json("get", "namespaces")["items"]
    workdir = tmp_path_factory.mktemp("prometheus")
    binary = tool("prometheus")
    resource = prometheus_resource(
        f"{PROMETHEUS_RELEASE}-prometheus",
        PROMETHEUS_NS,
        PROMETHEUS_RELEASE,
        prometheus_version(binary),
        "2s",
    )
    gen = generate(resource, [*namespaces, *(o for v in monitors.values() for o in v)], workdir)
    assert "1 ServiceMonitors, 2 PodMonitors, 1 rule files selected" in gen.log, gen.log
    token = discovery_token(cluster, PROMETHEUS_NS, "prometheus", workdir)
    prom = Prometheus(binary, workdir, outside_pod(gen, cluster.cp.url, cluster.cp.ca_cert, token))
    try:
        wait_for(prom.ready, 60, "prometheus /-/ready")
        yield prom
    finally:
        prom.stop()


@pytest.fixture(scope="module")
def fleet(cluster: Cluster, release: None, lora_adapters: dict[str, Path]) -> Iterator[dict[str, str]]:
    """An InferenceDeployment of 2 real daemons (the embedded model and a LoRA adapter, so the dashboards'
    adapter panels have series) with an admin token and a fleet router; daemon pod name -> IP."""
    adapter = lora_adapters["every-layer"]  # readable by the image's user (support.lora)
    cluster.kubectl("create", "namespace", FLEET_NS)
    wait_for(
        lambda: cluster.kubectl("get", "sa", "default", "-n", FLEET_NS, check=False).returncode == 0, 30, "sa"
    )
    cluster.kubectl(
        "create", "secret", "generic", "admin", "-n", FLEET_NS, "--from-literal=token=chart-admin"
    )
    cluster.kubectl("label", "secret", "admin", "-n", FLEET_NS, "kvpilot.io/admin-token=true")
    infd = {
        "apiVersion": "kvpilot.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": "llm", "namespace": FLEET_NS},
        "spec": {
            "replicas": 2,
            "adminTokenSecretRef": {"name": "admin"},
            "router": {"enabled": True},
            # a host offload tier of ~14 blocks: the dashboards' offload panels have series to answer
            "engine": {
                "kvCacheBlocks": 256,
                "maxNumSeqs": 4,
                "maxModelLen": 512,
                "kvOffloadingSize": 0.01,
                "lora": {"modules": [{"name": "sql", "path": "/adapters/sql"}]},
            },
            # the folder itself: its parents (pytest's) are root's alone (support.cluster.readable_by_pods)
            "volumes": [{"name": "sql", "hostPath": {"path": str(adapter)}}],
            "volumeMounts": [{"name": "sql", "mountPath": "/adapters/sql", "readOnly": True}],
        },
    }
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(infd))
    cluster.kubectl("wait", "--for=condition=Ready", "infd/llm", "-n", FLEET_NS, "--timeout=300s")

    def ready_pods() -> dict[str, str]:
        pods = cluster.kubectl_json(
            "get", "pods", "-n", FLEET_NS, "-l", "kvpilot.io/inference-deployment=llm"
        )
        ready = {p["metadata"]["name"]: p["status"]["podIP"] for p in pods["items"] if is_ready(p)}
        return ready if len(ready) == 2 else {}

    yield wait_for(ready_pods, 300, "2 ready daemon pods", interval=1)  # type: ignore[misc]
    # While the operator still runs (the release outlives this fixture): the Continuous warm-up's finalizer is
    # the operator's to remove; left behind, a later operator in this session's cluster would take it up.
    cluster.kubectl("delete", "pcw", "--all", "-n", FLEET_NS, "--timeout=60s", check=False)


def wait_scraped(cluster: Cluster, prometheus: Prometheus, fleet: dict[str, str]) -> None:
    def all_scraped() -> bool:
        up = [t["labels"] for t in prometheus.targets() if t["health"] == "up"]
        pods = {t.get("pod") for t in up}
        return (
            set(fleet) <= pods
            and operator_pod(cluster)["metadata"]["name"] in pods
            and any(t["job"] == "kvpilot-router" for t in up)
        )

    wait_for(all_scraped, 60, "prometheus scraping both daemons, the router and the operator")


def test_every_rendered_object_passes_server_dry_run(
    cluster: Cluster, kube_helm: Helm, release: None
) -> None:
    """With each toggle on and off (a second release name, so nothing clashes with the installed one). A Pod
    (the `helm test` hook's) is admitted only when its ServiceAccount exists, which a dry run never creates:
    that one ServiceAccount is created for real first."""
    cluster.kubectl("create", "namespace", "team-a", check=False)
    cluster.kubectl("create", "serviceaccount", "dryrun-kvpilot-test", "-n", RELEASE_NS)
    variants = {
        "defaults": [],
        "monitoring": [*MONITORING, "--set", "monitoring.force=true"],
        "namespaced": ["--set", "operator.watchNamespaces={team-a}"],
    }
    for name, values in variants.items():
        out = helm_chart(kube_helm, "template", "dryrun", *values).stdout
        objs = [d for d in yaml.safe_load_all(out) if d]
        r = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=out, check=False)
        assert r.returncode == 0, f"{name}: {r.stderr}"
        assert r.stdout.count("(server dry run)") == len(objs), f"{name}: {r.stdout}"
    cluster.kubectl("delete", "serviceaccount", "dryrun-kvpilot-test", "-n", RELEASE_NS)


def test_install_runs_the_operator_in_the_cluster(cluster: Cluster, release: None) -> None:
    pod = operator_pod(cluster)
    assert is_ready(pod)
    assert pod["spec"]["serviceAccountName"] == OPERATOR
    dep = cluster.kubectl_json("get", "deployment", OPERATOR, "-n", RELEASE_NS)
    assert dep["status"]["readyReplicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    # The operator made its peering object (helm did not: no ownership metadata) and peers in it.
    meta = peering(cluster)["metadata"]
    assert "meta.helm.sh/release-name" not in (meta.get("annotations") or {}), meta
    assert "app.kubernetes.io/managed-by" not in (meta.get("labels") or {}), meta
    wait_for(
        lambda: any(f"@{pod['metadata']['name']}/" in p for p in peers(cluster)),
        30,
        "the operator's peer entry",
    )
    notes = INSTALL["notes"]  # the next commands, and no warning: the monitoring API is served
    assert "kind: InferenceDeployment" in notes and "kind: PrefixCacheReset" in notes, notes
    assert "kubectl wait --for=condition=Complete" in notes and "WARNING" not in notes, notes
    assert "It peers in ClusterKopfPeering kvpilot, which it makes when missing" in notes, notes
    assert '{"spec": {"router": {"enabled": true}}}' in notes and "{.status.endpoint}" in notes, notes
    print(f"helm install -> Ready operator: {TIMINGS['helm_install_to_ready_operator_s']} s")


def test_reset_by_the_in_cluster_operator(
    cluster: Cluster, prometheus: Prometheus, fleet: dict[str, str]
) -> None:
    """Traffic warms both caches, a PrefixCacheReset ends Complete 2/2, and the operator pod did it.
    Prometheus scrapes everything first, so the counters' increases from here on are in its samples."""
    assert len(fleet) == 2
    wait_scraped(cluster, prometheus, fleet)
    warm(fleet)
    # One refused reset (wrong token): the daemons count it as unauthorized.
    with pytest.raises(urllib.error.HTTPError) as e:
        http("POST", f"http://{next(iter(fleet.values()))}:8000/reset_prefix_cache", token="wrong")
    assert e.value.code == 401

    # Warm-ups, so the operator dashboard's warm-up panels have series: one Once (it finishes), one Continuous
    # (it watches: the reset and the weight update below re-warm the fleet).
    for name, mode in (("prime", "Once"), ("keep", "Continuous")):
        pcw = {
            "apiVersion": "kvpilot.io/v1alpha1",
            "kind": "PrefixCacheWarmup",
            "metadata": {"name": name, "namespace": FLEET_NS},
            "spec": {"targetRef": {"name": "llm"}, "prompts": [{"prompt": PROMPT}], "mode": mode},
        }
        cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(pcw))
        cluster.kubectl("wait", "--for=condition=Warm", f"pcw/{name}", "-n", FLEET_NS, "--timeout=120s")

    reset = {
        "apiVersion": "kvpilot.io/v1alpha1",
        "kind": "PrefixCacheReset",
        "metadata": {"name": "flush", "namespace": FLEET_NS},
        "spec": {"targetRef": {"name": "llm"}},
    }
    t0 = time.monotonic()
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(reset))
    cluster.kubectl("wait", "--for=condition=Complete", "pcr/flush", "-n", FLEET_NS, "--timeout=120s")
    TIMINGS["reset_apply_to_complete_s"] = round(time.monotonic() - t0, 2)
    st = cluster.kubectl_json("get", "pcr", "flush", "-n", FLEET_NS)["status"]
    assert (st["phase"], st["progress"], st["succeeded"], st["failed"]) == ("Succeeded", "2/2", 2, 0)
    assert {p["name"] for p in st["pods"]} == set(fleet)
    warm(fleet)  # post-reset traffic: misses, then hits again
    # A WeightUpdate to the weights they serve under a new version name (the embedded model's own directory, as
    # the image has it): the weight panels and metrics have data.
    where = "from kvpilot.default_model import ensure_default_model as m; print(m())"
    model_path = cluster.kubectl("exec", "deploy/llm", "-n", FLEET_NS, "--", "python3", "-c", where).stdout
    wu = {
        "apiVersion": "kvpilot.io/v1alpha1",
        "kind": "WeightUpdate",
        "metadata": {"name": "rename", "namespace": FLEET_NS},
        "spec": {"targetRef": {"name": "llm"}, "modelPath": model_path.strip(), "version": "v2"},
    }
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(wu))
    cluster.kubectl("wait", "--for=condition=Complete", "wu/rename", "-n", FLEET_NS, "--timeout=300s")
    log = cluster.kubectl("logs", f"deployment/{OPERATOR}", "-n", RELEASE_NS).stdout
    assert "flush" in log, "the in-cluster operator's log should show the reset"
    # The fleet's NetworkPolicy lets exactly this operator pod reach the daemons: the chart tells the operator
    # its namespace and labels.
    pod = operator_pod(cluster)
    policy = cluster.kubectl_json("get", "networkpolicy", "llm", "-n", FLEET_NS)
    (peer,) = [
        p
        for rule in policy["spec"]["ingress"]
        for p in rule["from"]
        if {"namespaceSelector", "podSelector"} <= set(p)
    ]
    assert peer["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": pod["metadata"]["namespace"]
    }
    assert peer["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items(), peer
    print(
        f"PrefixCacheReset apply -> Complete (in-cluster operator): {TIMINGS['reset_apply_to_complete_s']} s"
    )


def test_prometheus_answers_every_dashboard_query_and_loads_every_alert(
    cluster: Cluster,
    fleet: dict[str, str],
    prometheus: Prometheus,
) -> None:
    """After the traffic and the reset above: every target up, every panel, annotation and variable query of
    the daemon and operator dashboards returns data (Grafana's variables substituted), every alert rule loaded
    and evaluated."""

    wait_scraped(cluster, prometheus, fleet)
    targets = prometheus.targets()
    jobs = {t["labels"]["job"] for t in targets}
    assert jobs == {"kvpilot-daemon", "kvpilot-operator", "kvpilot-router"}, jobs
    # Each found by the operator's scrape config of its monitor, through Kubernetes discovery.
    pools = {t["scrapePool"] for t in targets}
    assert pools == {
        f"podMonitor/{RELEASE_NS}/kvpilot-daemons/0",
        f"podMonitor/{RELEASE_NS}/kvpilot-routers/0",
        f"serviceMonitor/{RELEASE_NS}/{OPERATOR}/0",
    }, pools
    assert all(t["discoveredLabels"].get("__meta_kubernetes_pod_name") for t in targets), targets
    # ... as the configuration Prometheus loaded says: Kubernetes discovery only, no other source of targets.
    loaded = yaml.safe_load(prometheus.api("/api/v1/status/config")["yaml"])["scrape_configs"]
    sources = [sorted(k for k in job if k.endswith(("_sd_configs", "static_configs"))) for job in loaded]
    assert sources == [["kubernetes_sd_configs"]] * 3, sources
    # The reset and the last traffic must be in the samples: the operator has recorded it.
    wait_for(
        lambda: prometheus.query(f'kvpilot_operator_reset_pods{{namespace="{FLEET_NS}",reset="flush"}}'),
        30,
        "the reset in prometheus",
    )
    time.sleep(6)  # three more scrapes, so every rate() has two samples after the last request

    variables = {"namespace": FLEET_NS, "deployment": "llm", "pod": ".*", "datasource": "prometheus"}
    # The router gets no traffic here: its dashboard's panels are checked in tests/monitoring/
    # test_router_prometheus.py; here, that its PodMonitor labels it as the dashboard expects.
    checked, unanswered = 0, []
    for path in [p for p in DASHBOARDS if p != ROUTER_DASHBOARD]:
        # This fleet is colocated: the disaggregation row's metrics are checked on the pods that serve them
        # by tests/operator/test_operator_disaggregation.py.
        skip = [p["title"] for p in row_panels(load(path), DISAGGREGATION_ROW)]
        n, bad = prometheus.unanswered(path, variables, "2m", "15m", skip)
        checked, unanswered = checked + n, unanswered + bad
    TIMINGS["dashboard_queries_verified"] = checked
    router_board = load(ROUTER_DASHBOARD)
    for name, expr in variable_queries(router_board):
        assert prometheus.query(substitute(expr, "2m", "15m", variables)), f"router dashboard variable {name}"
    ready = prometheus.query(
        f'kvpilot_router_pod_ready{{job="kvpilot-router",namespace="{FLEET_NS}",deployment="llm"}}'
    )
    # honorLabels: `pod` is each daemon the router routes to, not the router pod.
    assert {s["metric"]["pod"]: s["value"][1] for s in ready} == dict.fromkeys(fleet, "1"), ready

    rules = wait_for(prometheus.evaluated_alerts, 30, "every alert rule evaluated")
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
    TIMINGS["alerts_loaded"] = len(rules)
    assert not unanswered, "\n".join(unanswered)
    firing = {a["labels"]["alertname"] for a in prometheus.api("/api/v1/alerts")["alerts"]}
    assert not firing & {"KvpilotOperatorDown", "KvpilotDaemonDown", "KvpilotRouterNoReadyPod"}, firing
    print(f"verified against the live Prometheus: {checked} dashboard queries, {len(rules)} alert rules")


def test_helm_test_passes(kube_helm: Helm, release: None) -> None:
    r = kube_helm("test", RELEASE, "-n", RELEASE_NS, "--timeout=3m", timeout=240)
    assert "Phase:          Succeeded" in r.stdout or "Succeeded" in r.stdout, r.stdout


def test_namespace_edit_and_view_users_get_kvpilot_resources(cluster: Cluster, release: None) -> None:
    dev = cluster.cp.users["dev"].token
    for ns, role in (("team-edit", "edit"), ("team-view", "view")):
        cluster.kubectl("create", "namespace", ns, check=False)
        cluster.kubectl(
            "create", "rolebinding", f"dev-{role}", f"--clusterrole={role}", "--user=dev", "-n", ns
        )

    def can(verb: str, resource: str, ns: str) -> bool:
        r = cluster.kubectl("auth", "can-i", verb, resource, "-n", ns, token=dev, check=False)
        return r.stdout.strip() == "yes"

    wait_for(
        lambda: can("create", "inferencedeployments.kvpilot.io", "team-edit"), 30, "aggregation into edit"
    )
    assert can("delete", "prefixcacheresets.kvpilot.io", "team-edit")
    assert can("create", "weightupdates.kvpilot.io", "team-edit")
    assert can("patch", "inferencedeployments.kvpilot.io/scale", "team-edit")
    wait_for(lambda: can("list", "prefixcacheresets.kvpilot.io", "team-view"), 30, "aggregation into view")
    assert not can("create", "prefixcacheresets.kvpilot.io", "team-view")
    assert not can("get", "inferencedeployments.kvpilot.io", "default"), (
        "no rights outside the bound namespaces"
    )


def test_wrong_value_is_refused_naming_the_field(kube_helm: Helm, release: None) -> None:
    r = helm_chart(
        kube_helm, "upgrade", RELEASE, "--reuse-values", "--set", "operator.logLevl=DEBUG", check=False
    )
    assert r.returncode != 0 and "logLevl" in r.stderr, r.stderr
    history = json.loads(kube_helm("history", RELEASE, "-n", RELEASE_NS, "-o", "json").stdout)
    assert len(history) == 1, "a refused upgrade must not make a revision"


def test_upgrade_with_a_changed_value_rolls_the_operator(
    cluster: Cluster, kube_helm: Helm, release: None
) -> None:
    before = operator_pod(cluster)["metadata"]["uid"]
    peering_uid = peering(cluster)["metadata"]["uid"]
    helm_chart(
        kube_helm,
        "upgrade",
        RELEASE,
        "--reuse-values",
        "--set",
        "operator.logLevel=DEBUG",
        "--wait",
        "--timeout=5m",
        timeout=400,
    )
    pod = wait_for(
        lambda: (p := operator_pod(cluster))["metadata"]["uid"] != before and is_ready(p) and p,
        120,
        "a new Ready operator pod",
    )
    assert "--log-level=DEBUG" in pod["spec"]["containers"][0]["args"]
    assert peering(cluster)["metadata"]["uid"] == peering_uid, (
        "the upgrade must leave the peering object alone"
    )
    assert (
        json.loads(kube_helm("history", RELEASE, "-n", RELEASE_NS, "-o", "json").stdout)[-1]["revision"] == 2
    )


def test_uninstall_leaves_only_the_crds(cluster: Cluster, kube_helm: Helm, release: None) -> None:
    # Resets and warm-ups first, while the operator runs: a running reset and a Continuous warm-up have a
    # finalizer, the operator's to remove.
    cluster.kubectl("delete", "pcr,pcw,infd", "--all", "-n", FLEET_NS, "--timeout=120s")
    peering_uid = peering(cluster)["metadata"]["uid"]
    kube_helm("uninstall", RELEASE, "-n", RELEASE_NS, "--wait", "--timeout=3m", timeout=240)
    selector = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/managed-by=Helm"
    namespaced = "deploy,rs,pods,svc,sa,cm,role,rolebinding,podmonitors,servicemonitors,prometheusrules"

    def leftovers() -> list[str]:
        names = cluster.kubectl("get", namespaced, "-A", "-l", selector, "-o", "name").stdout.split()
        cluster_scoped = "clusterrole,clusterrolebinding,clusterkopfpeerings"
        return names + cluster.kubectl("get", cluster_scoped, "-l", selector, "-o", "name").stdout.split()

    # The operator pod takes up to its grace period to stop; the garbage collector removes its ReplicaSet.
    wait_for(lambda: not leftovers(), 90, "every object of the release to be gone")
    crds = cluster.kubectl("get", "crd", "-o", "name").stdout.split()
    for crd in (
        "inferencedeployments.kvpilot.io",
        "prefixcacheresets.kvpilot.io",
        "clusterkopfpeerings.kopf.dev",
    ):
        assert f"customresourcedefinition.apiextensions.k8s.io/{crd}" in crds
    # The peering object is not the release's: other operators may peer in it.
    assert peering(cluster)["metadata"]["uid"] == peering_uid


def test_namespaced_install_works_with_roles_only(cluster: Cluster, kube_helm: Helm) -> None:
    """With operator.watchNamespaces the operator has Roles in the watched namespace and a ClusterRole with
    only kopf's discovery rules, and still completes `helm test`'s PrefixCacheReset there."""
    name = "kvpilot-ns"
    helm_chart(
        kube_helm,
        "install",
        name,
        *INSTALL_WAIT,
        "--set",
        f"operator.watchNamespaces={{{RELEASE_NS}}}",
        timeout=400,
    )
    try:
        role = cluster.kubectl_json("get", "clusterrole", f"{name}-operator")
        assert {r for rule in role["rules"] for r in rule["resources"]} == {
            "customresourcedefinitions",
            "namespaces",
        }
        assert cluster.kubectl_json("get", "kopfpeering", "kvpilot", "-n", RELEASE_NS)
        kube_helm("test", name, "-n", RELEASE_NS, "--timeout=3m", timeout=240)
    finally:
        kube_helm("uninstall", name, "-n", RELEASE_NS, "--wait", check=False)


def test_install_after_an_operator_run_by_hand(cluster: Cluster, kube_helm: Helm, tmp_path: Path) -> None:
    """The README's order: `kubectl apply -f crds/` and `.venv/bin/kvpilot operator` first, which makes the
    peering object (helm does not own it); then `helm install` succeeds, its operator peers in that same object
    and completes `helm test`'s PrefixCacheReset; `helm uninstall` leaves the object."""
    cluster.kubectl("apply", "-f", str(ROOT / "crds"))
    cluster.kubectl(
        "wait", "--for=condition=Established", "crd/clusterkopfpeerings.kopf.dev", "--timeout=60s"
    )
    cluster.kubectl(
        "delete", "clusterkopfpeering", "kvpilot", "--ignore-not-found"
    )  # e.g. the release's above
    log = tmp_path / "operator.log"
    kvpilot = Path(sys.executable).parent / "kvpilot"  # the checkout's .venv/bin/kvpilot
    op = subprocess.Popen(
        [
            kvpilot,
            "operator",
            "--bind",
            "127.0.0.1",
            "--liveness-port",
            str(free_port()),
            "--metrics-port",
            str(free_port()),
        ],
        env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig)},
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_for(lambda: "created the peering object kvpilot" in log.read_text(), 60, "the peering object")
        wait_for(lambda: peers(cluster), 30, "the operator run by hand to peer")
    finally:
        os.killpg(op.pid, signal.SIGTERM)  # a graceful stop: it leaves the peering, the object stays
        op.wait(30)
    wait_for(lambda: not peers(cluster), 30, "the operator run by hand to leave the peering")
    uid = peering(cluster)["metadata"]["uid"]

    name = "kvpilot-after"
    r = helm_chart(kube_helm, "install", name, *INSTALL_WAIT, check=False, timeout=400)
    try:
        assert r.returncode == 0, r.stderr
        pod = operator_pod(cluster, name)["metadata"]["name"]
        wait_for(lambda: any(f"@{pod}/" in p for p in peers(cluster)), 30, "the chart's operator to peer")
        assert peering(cluster)["metadata"]["uid"] == uid, "the peering object must not be made again"
        kube_helm("test", name, "-n", RELEASE_NS, "--timeout=3m", timeout=240)
    finally:
        kube_helm("uninstall", name, "-n", RELEASE_NS, "--wait", check=False)
    assert peering(cluster)["metadata"]["uid"] == uid
