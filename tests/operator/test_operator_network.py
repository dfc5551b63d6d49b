"""Who may reach a fleet's daemons: its NetworkPolicy (spec.networkPolicy, on by default) and its KV event keys
(a Secret of CURVE key pairs, each side mounting only its part). The builders as pure functions, then the
operator (with exactly rbac.RULES) against the dev cluster's real kube-apiserver: the dev cluster enforces no
NetworkPolicy, so the objects themselves are checked; CURVE itself is tested for real in
tests/router/test_kv_privacy.py and end to end in test_operator_router.py."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpilot.kv import sockets as kv_sockets
from kvpilot.operator.fleets import builders, router_objects
from kvpilot.operator.fleets.network_policy import OperatorPeer, network_policy
from kvpilot.operator.specs import FleetSpec
from support.cluster import Cluster
from support.operator import OP_NS, OperatorProcess, apply_ns, fleet, infd
from support.procs import wait_for

ROUTED = {"port": 8000, "router": {"enabled": True}, "engine": {"dataParallelSize": 2}}
PEER = OperatorPeer(
    "kvpilot-system", {"app.kubernetes.io/name": "kvpilot", "app.kubernetes.io/component": "operator"}
)


def router_peer(name: str) -> dict:
    return {"podSelector": {"matchLabels": {"kvpilot.io/router": name}}}


def test_policy_lets_the_router_operator_and_listed_namespaces_in() -> None:
    spec = {**ROUTED, "networkPolicy": {"allowFromNamespaces": ["monitoring"]}}
    pol = network_policy("llm", FleetSpec.parse(spec), PEER)
    assert pol["spec"]["podSelector"] == {"matchLabels": {"kvpilot.io/inference-deployment": "llm"}}
    assert pol["spec"]["policyTypes"] == ["Ingress"]
    http, events = pol["spec"]["ingress"]
    assert http["ports"] == [{"protocol": "TCP", "port": 8000}]
    assert http["from"] == [
        router_peer("llm"),
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kvpilot-system"}},
            "podSelector": {"matchLabels": PEER.labels},
        },
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}},
    ]
    # Every rank's events and replay port, from the router only.
    assert events == {
        "from": [router_peer("llm")],
        "ports": [{"protocol": "TCP", "port": p} for p in (5557, 5559, 5558, 5560)],
    }


def test_policy_without_a_router_or_peers() -> None:
    # No router: no router peer, no KV event ports; an operator outside the cluster is named by nothing.
    pol = network_policy(
        "llm", FleetSpec.parse({"networkPolicy": {"allowFromNamespaces": ["app"]}}), OperatorPeer()
    )
    assert pol["spec"]["ingress"] == [
        {
            "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "app"}}}],
            "ports": [{"protocol": "TCP", "port": 8000}],
        }
    ]
    # Nobody listed at all: no rule (an empty `from` would let everyone in).
    nobody = network_policy("llm", FleetSpec.parse({}), OperatorPeer())["spec"]
    assert nobody["policyTypes"] == ["Ingress"] and "ingress" not in nobody


def test_each_side_mounts_only_its_keys() -> None:
    pod = builders.workload("llm", FleetSpec.parse(ROUTED))["spec"]["template"]["spec"]
    (vol,) = [v for v in pod["volumes"] if v["name"] == builders.KV_KEYS_VOLUME]
    assert vol["secret"]["secretName"] == "llm-kv-events-curve"
    assert [i["key"] for i in vol["secret"]["items"]] == ["server.key_secret", "client.key"]
    c = pod["containers"][0]
    assert {"name": builders.KV_KEYS_VOLUME, "mountPath": builders.KV_KEYS_DIR, "readOnly": True} in c[
        "volumeMounts"
    ]
    assert c["args"][c["args"].index("--kv-events-curve-dir") + 1] == builders.KV_KEYS_DIR
    rpod = router_objects.deployment("llm", FleetSpec.parse(ROUTED))["spec"]["template"]["spec"]
    (rvol,) = rpod["volumes"]
    assert [i["key"] for i in rvol["secret"]["items"]] == ["client.key_secret", "server.key"]
    rc = rpod["containers"][0]
    assert rc["volumeMounts"][-1]["readOnly"] and "--kv-events-curve-dir" in rc["args"]
    # No KV events, no keys: a least-load router, or none.
    for spec in ({"router": {"enabled": True, "policy": "least-load"}}, {}):
        pod = builders.workload("llm", FleetSpec.parse(spec))["spec"]["template"]["spec"]
        assert "volumes" not in pod and "--kv-events-curve-dir" not in pod["containers"][0]["args"]


# ---- through the real API server ------------------------------------------------------------------
def _secret_files(cluster: Cluster, ns: str, name: str) -> dict[str, str]:
    s = cluster.kubectl_json("get", "secret", name, "-n", ns)
    return {k: base64.b64decode(v).decode() for k, v in s["data"].items()}


def _exists(cluster: Cluster, kind: str, ns: str, name: str) -> bool:
    return cluster.kubectl("get", kind, name, "-n", ns, check=False).returncode == 0


@pytest.fixture
def peer_operator(operator: OperatorProcess) -> Iterator[OperatorProcess]:
    """The session's operator, told where its pods are (as the chart tells it), and back as it was after."""
    operator.restart("--operator-namespace", OP_NS, "--operator-pod-labels", "app=kvpilot-op,tier=control")
    yield operator
    operator.restart()


@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_operator_makes_the_keys_and_the_policy_and_removes_it_when_off(
    cluster: Cluster, namespace: str, peer_operator: OperatorProcess, tmp_path: Path
) -> None:
    ns = namespace
    spec = {
        "replicas": 0,
        "router": {"enabled": True, "replicas": 0},
        "engine": {"dataParallelSize": 2},
        "networkPolicy": {"allowFromNamespaces": ["monitoring", "clients"]},
    }
    apply_ns(cluster, ns, fleet("llm", spec))
    wait_for(
        lambda: (infd(cluster, ns, "llm").get("status") or {}).get("networkPolicy") == "llm", 90, "policy"
    )
    uid = infd(cluster, ns, "llm")["metadata"]["uid"]

    pol = cluster.kubectl_json("get", "networkpolicy", "llm", "-n", ns)
    assert [(r["kind"], r["uid"], r.get("controller")) for r in pol["metadata"]["ownerReferences"]] == [
        ("InferenceDeployment", uid, True)
    ]
    assert pol["spec"]["podSelector"] == {"matchLabels": {"kvpilot.io/inference-deployment": "llm"}}
    http, events = pol["spec"]["ingress"]
    assert http["ports"] == [{"protocol": "TCP", "port": 8000}]
    assert http["from"] == [
        router_peer("llm"),
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": OP_NS}},
            "podSelector": {"matchLabels": {"app": "kvpilot-op", "tier": "control"}},
        },
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}},
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "clients"}}},
    ]
    assert events["from"] == [router_peer("llm")]
    assert sorted(p["port"] for p in events["ports"]) == [5557, 5558, 5559, 5560]
    # The router's pods carry the label the policy names; the daemons' the one it selects.
    router_pod = cluster.kubectl_json("get", "deployment", "llm-router", "-n", ns)["spec"]["template"]
    assert router_pod["metadata"]["labels"]["kvpilot.io/router"] == "llm"

    # The keys: owned by the fleet, a working CURVE pair for each side (the router's key is the one allowed).
    secret = cluster.kubectl_json("get", "secret", "llm-kv-events-curve", "-n", ns)
    assert [r["uid"] for r in secret["metadata"]["ownerReferences"]] == [uid]
    files = _secret_files(cluster, ns, "llm-kv-events-curve")
    assert sorted(files) == ["client.key", "client.key_secret", "server.key", "server.key_secret"]
    for f, text in files.items():
        (tmp_path / f).write_text(text)
    server, client = kv_sockets.load_server_keys(tmp_path), kv_sockets.load_client_keys(tmp_path)
    assert server.allowed == {client.public} and client.server == server.public

    # Reapplied by every reconcile, it is never rewritten (no apply-watch loop).
    cluster.kubectl("annotate", "infd/llm", "-n", ns, "poke=1")
    time.sleep(5)
    rv = cluster.kubectl_json("get", "networkpolicy", "llm", "-n", ns)["metadata"]["resourceVersion"]
    assert rv == pol["metadata"]["resourceVersion"]

    # Switched off: the policy goes, status says so; the keys stay (the daemons still use them).
    cluster.kubectl(
        "patch", "infd", "llm", "-n", ns, "--type=merge", "-p", '{"spec":{"networkPolicy":{"enabled":false}}}'
    )
    wait_for(lambda: not _exists(cluster, "networkpolicy", ns, "llm"), 90, "the policy to be deleted")
    wait_for(lambda: "networkPolicy" not in (infd(cluster, ns, "llm").get("status") or {}), 60, "status")
    assert _exists(cluster, "secret", ns, "llm-kv-events-curve")


@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_names_taken_by_others_are_never_used_or_overwritten(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    ns = namespace
    # Someone who may create Secrets and NetworkPolicies, but is not the fleet, got there first.
    theirs = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "llm-kv-events-curve"}}
    theirs["stringData"] = kv_sockets.key_files("server") | kv_sockets.key_files("client")
    apply_ns(cluster, ns, theirs)
    open_policy = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "llm"},
        "spec": {"podSelector": {}, "ingress": [{}]},
    }
    apply_ns(cluster, ns, open_policy)
    before = _secret_files(cluster, ns, "llm-kv-events-curve")
    apply_ns(cluster, ns, fleet("llm", {"replicas": 1, "router": {"enabled": True}}))

    def ready_reason() -> str | None:
        conds = (infd(cluster, ns, "llm").get("status") or {}).get("conditions") or []
        return next((c["reason"] for c in conds if c["type"] == "Ready" and c["status"] == "False"), None)

    wait_for(lambda: ready_reason() == "KVEventsKeysConflict", 90, "Ready False: KVEventsKeysConflict")
    # Nothing mounts their keys: neither daemons nor router were made.
    assert not _exists(cluster, "deployment", ns, "llm") and not _exists(
        cluster, "deployment", ns, "llm-router"
    )
    assert _secret_files(cluster, ns, "llm-kv-events-curve") == before
    secret = cluster.kubectl_json("get", "secret", "llm-kv-events-curve", "-n", ns)
    assert not secret["metadata"].get("ownerReferences")
    pol = cluster.kubectl_json("get", "networkpolicy", "llm", "-n", ns)
    assert pol["spec"]["ingress"] == [{}] and not pol["metadata"].get("ownerReferences")
    events = cluster.kubectl_json("get", "events", "-n", ns)["items"]
    reasons = {e["reason"] for e in events}
    assert {"KVEventsKeysConflict", "NetworkPolicyConflict"} <= reasons, json.dumps(sorted(reasons))


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_a_policy_that_lets_nobody_in_is_applied_once(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    """No router, no namespace listed, an operator outside the cluster: the policy lets nobody in, and
    reapplying it (every reconcile does) writes nothing, so its watch events cannot feed an apply loop."""
    ns = namespace
    apply_ns(cluster, ns, fleet("quiet", {"replicas": 0}))
    wait_for(lambda: _exists(cluster, "networkpolicy", ns, "quiet"), 90, "the policy")
    pol = cluster.kubectl_json("get", "networkpolicy", "quiet", "-n", ns)
    assert pol["spec"]["policyTypes"] == ["Ingress"] and not pol["spec"].get("ingress")
    cluster.kubectl("annotate", "infd/quiet", "-n", ns, "poke=1")  # a reconcile: one more apply, a no-op
    time.sleep(10)
    again = cluster.kubectl_json("get", "networkpolicy", "quiet", "-n", ns)
    assert again["metadata"]["resourceVersion"] == pol["metadata"]["resourceVersion"]
