"""Which pods belong to an InferenceDeployment's fleet, decided from objects as the API returns them (plain
dicts): the fleet controls its workload (the Deployment or DaemonSet of its name), and a member pod is
controlled by that workload (a DaemonSet's pods) or by one of the ReplicaSets it controls (a Deployment's).
A pod that only wears the fleet's labels, or an address in an EndpointSlice someone wrote by hand, is not a
member. The operator's reset path and the router's `--fleet` both decide it here, so the fleet's token and
its users' prompts go to the same pods.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

FLEET_LABEL = "kvpilot.io/inference-deployment"  # on a fleet's pods and ReplicaSets; value: the fleet's name
# A fleet with spec.disaggregation runs one workload per role, NAME-prefill and NAME-decode, whose pods carry
# ROLE_LABEL (value: the role); a colocated fleet runs one workload, NAME, whose pods carry no role.
ROLE_LABEL = "kvpilot.io/role"
ROLES = ("prefill", "decode")


def workload_names(name: str, disaggregated: bool) -> tuple[str, ...]:
    """The names of the workloads that run fleet `name`'s pods."""
    return tuple(f"{name}-{role}" for role in ROLES) if disaggregated else (name,)


def is_disaggregated(fleet: dict[str, Any]) -> bool:
    """Whether the InferenceDeployment (as read) runs prefill and decode pods (spec.disaggregation)."""
    return bool((fleet.get("spec") or {}).get("disaggregation"))


def pod_role(pod: dict[str, Any], disaggregated: bool) -> str | None:
    """A member pod's role: in a disaggregated fleet its ROLE_LABEL (None where that names no role); a
    colocated fleet's pods have none, whatever labels they wear (a user's own label of that name on a
    colocated fleet's template must not split it into pools)."""
    if not disaggregated:
        return None
    role = (pod["metadata"].get("labels") or {}).get(ROLE_LABEL)
    return role if role in ROLES else None


def controller_ref(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The owner reference that controls the object (controller: true), if any."""
    return next((r for r in obj["metadata"].get("ownerReferences") or [] if r.get("controller")), None)


def controlled_by(obj: dict[str, Any], uid: str) -> bool:
    """Whether the object `uid` controls the object."""
    return (controller_ref(obj) or {}).get("uid") == uid


def workload_controllers(
    fleet_uid: str, workload: dict[str, Any] | None, replicasets: Iterable[dict[str, Any]]
) -> frozenset[str]:
    """uids of the objects that directly control the fleet's pods: its DaemonSet, or the ReplicaSets of its
    Deployment; none when the workload is missing or not the fleet's."""
    if workload is None or not controlled_by(workload, fleet_uid):
        return frozenset()
    uid = workload["metadata"]["uid"]
    if workload.get("kind") == "DaemonSet":
        return frozenset({uid})
    return frozenset(rs["metadata"]["uid"] for rs in replicasets if controlled_by(rs, uid))


def is_member(pod: dict[str, Any], controllers: frozenset[str]) -> bool:
    """Whether the pod is run by the fleet's workload (`controllers`, from workload_controllers)."""
    return (controller_ref(pod) or {}).get("uid") in controllers


def pod_ips(pod: dict[str, Any]) -> set[str]:
    """The pod's addresses (status.podIP and status.podIPs)."""
    st = pod.get("status") or {}
    ips = {p.get("ip") for p in st.get("podIPs") or []} | {st.get("podIP")}
    return {ip for ip in ips if ip}
