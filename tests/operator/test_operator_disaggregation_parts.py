"""Pure parts of a disaggregated InferenceDeployment (spec.disaggregation, docs/disaggregation.md): a workload
per role with its --kv-transfer-config, the NetworkPolicy's KV-transfer rule, which workloads go when the
spec changes, and the role each pod's reset result names."""

from __future__ import annotations

import json

from kvpilot.daemon.kv_transfer.config import parse_kv_transfer_config
from kvpilot.fanout import PodResult, Target, initial_results
from kvpilot.kube.fleet_members import ROLE_LABEL, workload_names
from kvpilot.operator.fleets import builders
from kvpilot.operator.fleets.network_policy import OperatorPeer, network_policy
from kvpilot.operator.fleets.reconcile import _stale_workloads
from kvpilot.operator.fleets.targets import Plan, pod_target
from kvpilot.operator.resets.status import pod_entry
from kvpilot.operator.specs import FleetSpec

DISAGG = {"port": 8000, "disaggregation": {"prefill": {"replicas": 2}, "decode": {"replicas": 3}}}


def _arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_each_role_runs_its_own_deployment_with_its_kv_role() -> None:
    spec = FleetSpec.parse(DISAGG)
    prefill, decode = builders.workloads("llm", spec)
    assert [w["metadata"]["name"] for w in (prefill, decode)] == ["llm-prefill", "llm-decode"]
    assert (prefill["spec"]["replicas"], decode["spec"]["replicas"]) == (2, 3)
    for w, role in ((prefill, "prefill"), (decode, "decode")):
        # the two selectors never overlap: neither Deployment claims the other's pods
        want = {"kvpilot.io/inference-deployment": "llm", ROLE_LABEL: role}
        assert w["spec"]["selector"] == {"matchLabels": want}
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert labels.items() >= {**want, "kvpilot.io/serving": "true"}.items()
        assert w["metadata"]["labels"][ROLE_LABEL] == role
    pc = prefill["spec"]["template"]["spec"]["containers"][0]
    dc = decode["spec"]["template"]["spec"]["containers"][0]
    # the daemon's own parser reads what the operator passes; the producer listens on the pod's IP
    produce = parse_kv_transfer_config(
        _arg(pc["args"], "--kv-transfer-config").replace("$(POD_IP)", "10.0.0.7")
    )
    consume = parse_kv_transfer_config(_arg(dc["args"], "--kv-transfer-config"))
    assert produce is not None and consume is not None
    assert (produce.role, produce.host, produce.port) == ("kv_producer", "10.0.0.7", 14579)
    assert consume.role == "kv_consumer"
    assert "kv_connector_extra_config" not in json.loads(_arg(dc["args"], "--kv-transfer-config"))
    # only the producer serves pulls, so only it declares the port
    assert {"name": "kv-transfer", "containerPort": 14579, "protocol": "TCP"} in pc["ports"]
    assert [p["name"] for p in dc["ports"]] == ["http"]


def test_a_colocated_fleet_keeps_its_one_workload_without_a_role() -> None:
    (w,) = builders.workloads("llm", FleetSpec.parse({"replicas": 2}))
    assert w["metadata"]["name"] == "llm" and w["spec"]["replicas"] == 2
    assert w["spec"]["selector"] == {"matchLabels": {"kvpilot.io/inference-deployment": "llm"}}
    assert ROLE_LABEL not in w["spec"]["template"]["metadata"]["labels"]
    assert "--kv-transfer-config" not in w["spec"]["template"]["spec"]["containers"][0]["args"]
    assert workload_names("llm", False) == ("llm",)
    assert workload_names("llm", True) == ("llm-prefill", "llm-decode")


def test_the_router_and_decode_pods_reach_what_they_need_and_only_that() -> None:
    spec = FleetSpec.parse({**DISAGG, "router": {"enabled": True, "policy": "round-robin"}})
    http, transfer = network_policy("llm", spec, OperatorPeer())["spec"]["ingress"]
    assert http["from"] == [{"podSelector": {"matchLabels": {"kvpilot.io/router": "llm"}}}]
    assert transfer == {
        "from": [
            {"podSelector": {"matchLabels": {"kvpilot.io/inference-deployment": "llm", ROLE_LABEL: "decode"}}}
        ],
        "ports": [{"protocol": "TCP", "port": 14579}],
    }
    colocated = network_policy("llm", FleetSpec.parse({"router": {"enabled": True}}), OperatorPeer())
    assert all(14579 not in [p["port"] for p in r["ports"]] for r in colocated["spec"]["ingress"])


def test_a_change_of_shape_removes_the_workloads_the_fleet_no_longer_runs() -> None:
    assert _stale_workloads("llm", FleetSpec.parse({})) == [
        ("Deployment", "llm-prefill"),
        ("Deployment", "llm-decode"),
        ("DaemonSet", "llm"),
        ("DaemonSet", "llm-prefill"),
        ("DaemonSet", "llm-decode"),
    ]
    stale = _stale_workloads("llm", FleetSpec.parse(DISAGG))
    assert ("Deployment", "llm") in stale and ("DaemonSet", "llm") in stale
    assert not {("Deployment", "llm-prefill"), ("Deployment", "llm-decode")} & set(stale)


def _pod(role: str | None) -> dict:
    labels = {"kvpilot.io/inference-deployment": "llm"} | ({ROLE_LABEL: role} if role else {})
    return {
        "metadata": {
            "name": f"llm-{role}-x" if role else "llm-x",
            "uid": "u",
            "labels": labels,
            "ownerReferences": [{"uid": "rs", "controller": True}],
        },
        "spec": {"nodeName": "n"},
        "status": {"podIP": "10.0.0.1", "containerStatuses": [{"name": "kvpilot", "state": {"running": {}}}]},
    }


def test_each_pods_reset_result_names_its_role() -> None:
    fleet = Plan("InferenceDeployment/llm", "x", 8000, None, "kvpilot", frozenset({"rs"}))
    selector = Plan("app=x", "app=x", 8000, None, None, None)
    targets = [
        pod_target(_pod("prefill"), fleet),
        pod_target(_pod("decode"), fleet),
        pod_target(_pod(None), fleet),
    ]
    entries = [pod_entry(r) for r in initial_results(targets)]
    assert [e.get("role") for e in entries] == ["decode", "prefill", None]  # sorted by name
    # a selector's pods have no role the operator vouches for, whatever their labels say
    assert "role" not in pod_entry(initial_results([pod_target(_pod("prefill"), selector)])[0])
    assert "role" not in pod_entry(PodResult("p", target=Target("p")))
