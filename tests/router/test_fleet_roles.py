"""`kvpilot router --fleet NAME`'s membership and roles, decided from objects as the API returns them (no API
server: FleetMembers reads them from a dict here; tests/router/test_router_fleet.py runs it against a real one,
tests/operator/test_operator_disaggregation.py a disaggregated fleet's router end to end). A disaggregated
fleet's members are the pods of both its workloads, each with its kvpilot.io/role; a colocated fleet's have no
role, whatever they wear."""

from __future__ import annotations

from typing import Any

from kvpilot.kube.endpointslices import Endpoint
from kvpilot.kube.fleet_members import ROLE_LABEL, is_disaggregated, pod_role
from kvpilot.router.fleet.discovery import FleetMembers, vet

FLEET_UID = "fleet-uid"
ROLES = {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}


def owned(kind: str, name: str, uid: str, owner: str, **extra: Any) -> dict[str, Any]:
    meta = {"name": name, "uid": uid, "ownerReferences": [{"uid": owner, "controller": True}]}
    return {"kind": kind, "metadata": {**meta, **extra.pop("meta", {})}, **extra}


def pod(name: str, ip: str, replicaset: str, role: str | None = None) -> dict[str, Any]:
    labels = {"kvpilot.io/inference-deployment": "llm"} | ({ROLE_LABEL: role} if role else {})
    return owned("Pod", name, f"{name}-uid", replicaset, meta={"labels": labels}, status={"podIP": ip})


def endpoint(name: str, ip: str) -> Endpoint:
    return Endpoint(name, f"http://{ip}:8000", ip, name)


class ReadMembers(FleetMembers):
    """FleetMembers whose reads are answered from `objects` ({(kind, name): object}) and whose lists from
    `pods` and `replicasets`; it records the workloads it read."""

    def __init__(
        self, objects: dict[tuple[str, str], dict], pods: list[dict], replicasets: list[dict]
    ) -> None:
        super().__init__(None, "llm", "ns")
        self.objects, self.pods, self.replicasets = objects, pods, replicasets
        self.read: list[tuple[str, str]] = []

    def _get(self, read: Any, *args: Any) -> dict[str, Any] | None:
        kind = {
            "get_namespaced_custom_object": "InferenceDeployment",
            "read_namespaced_deployment": "Deployment",
            "read_namespaced_daemon_set": "DaemonSet",
        }[read.__name__]
        name = args[4] if kind == "InferenceDeployment" else args[0]
        self.read.append((kind, name))
        return self.objects.get((kind, name))

    def _items(self, list_: Any) -> list[dict[str, Any]]:
        return {"list_namespaced_pod": self.pods, "list_namespaced_replica_set": self.replicasets}[
            list_.__name__
        ]


def fleet(spec: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": "llm", "uid": FLEET_UID}, "spec": spec}


def workloads(*names: str) -> dict[tuple[str, str], dict]:
    """Deployments of the fleet, each `NAME` with uid NAME-uid."""
    return {("Deployment", n): owned("Deployment", n, f"{n}-uid", FLEET_UID) for n in names}


def replicasets(*names: str) -> list[dict]:
    """One ReplicaSet of each Deployment `NAME`, with uid NAME-rs."""
    return [owned("ReplicaSet", f"{n}-abc", f"{n}-rs", f"{n}-uid") for n in names]


def test_a_disaggregated_fleets_members_are_both_workloads_pods_each_with_its_role() -> None:
    pods = [
        pod("p", "10.0.0.1", "llm-prefill-rs", "prefill"),
        pod("d", "10.0.0.2", "llm-decode-rs", "decode"),
        # a pod of the fleet's workload whose label names no role: of neither pool
        pod("odd", "10.0.0.3", "llm-decode-rs", "both"),
        # the colocated Deployment's pod, still terminating after the switch: no longer the fleet's
        pod("old", "10.0.0.4", "llm-rs"),
    ]
    objects = {("InferenceDeployment", "llm"): fleet({"disaggregation": ROLES})}
    objects |= workloads("llm", "llm-prefill", "llm-decode")
    members = ReadMembers(objects, pods, replicasets("llm", "llm-prefill", "llm-decode"))
    offered = [endpoint(p["metadata"]["name"], p["status"]["podIP"]) for p in pods]
    got = members.members(offered)
    assert [(e.name, e.role) for e in got] == [("p", "prefill"), ("d", "decode")]
    assert {n for k, n in members.read if k == "Deployment"} == {"llm-prefill", "llm-decode"}
    _, why = vet(offered[2], pods[2], frozenset({"llm-decode-rs"}), True, "llm")
    assert why == "Pod odd of a disaggregated fleet has no kvpilot.io/role label of prefill or decode"


def test_a_colocated_fleets_pods_have_no_role_whatever_they_wear() -> None:
    pods = [
        pod("a", "10.0.0.1", "llm-rs", "prefill"),  # a user's own label of that name on the template
        pod("b", "10.0.0.2", "llm-rs"),
        pod("gone", "10.0.0.3", "llm-decode-rs", "decode"),  # a role Deployment's, after the switch back
    ]
    objects = {("InferenceDeployment", "llm"): fleet({"replicas": 2})}
    objects |= workloads("llm", "llm-decode")
    members = ReadMembers(objects, pods, replicasets("llm", "llm-decode"))
    got = members.members([endpoint(p["metadata"]["name"], p["status"]["podIP"]) for p in pods])
    assert [(e.name, e.role) for e in got] == [("a", None), ("b", None)]
    assert {n for k, n in members.read if k == "Deployment"} == {"llm"}


def test_no_fleet_no_members_and_a_daemonset_fleet_as_before() -> None:
    p = pod("n", "10.0.0.9", "llm-uid")  # a DaemonSet's pod: controlled by the DaemonSet itself
    assert ReadMembers({}, [p], []).members([endpoint("n", "10.0.0.9")]) == []
    objects = {
        ("InferenceDeployment", "llm"): fleet({"placement": "DaemonSet"}),
        ("DaemonSet", "llm"): owned("DaemonSet", "llm", "llm-uid", FLEET_UID),
    }
    got = ReadMembers(objects, [p], []).members([endpoint("n", "10.0.0.9")])
    assert [(e.name, e.role) for e in got] == [("n", None)]


def test_the_role_of_a_pod() -> None:
    assert is_disaggregated(fleet({"disaggregation": ROLES}))
    assert not is_disaggregated(fleet({"replicas": 1})) and not is_disaggregated({"metadata": {}})
    assert pod_role(pod("p", "", "", "prefill"), True) == "prefill"
    assert pod_role(pod("p", "", "", "prefill"), False) is None
    assert pod_role(pod("p", "", "", "Decode"), True) is None
    assert pod_role(pod("p", "", ""), True) is None
