"""Fencing: a fleet pod that is not on the fleet's weights is taken out of the fleet's Service, and so out of
the fleet router (it routes to the Service's EndpointSlices), through the API server: its kvpilot.io/serving
label is set to "false" (builders.SERVING_LABEL, which the Service selects). A label holds across container
restarts and operator restarts; the pod itself keeps running, its ReplicaSet keeps it, and the operator's
fan-outs still reach it (they list pods by the fleet label), which is how it is brought back (catchup.py)."""

from __future__ import annotations

import logging
from typing import Any

import kopf

from kvpilot.operator.fleets.builders import SERVING_LABEL
from kvpilot.operator.fleets.status import FleetWeights
from kvpilot.operator.kube.api import ApiException, Kube
from kvpilot.operator.kube.owners import as_body
from kvpilot.operator.specs import FleetSpec

log = logging.getLogger(__name__)

# What to do with one pod, given the fleet's committed weights (InferenceDeployment status.weights).
LEAVE = "leave"  # the fleet records no weights: nothing is fenced, nothing caught up
SERVE = "serve"  # on the fleet's weights: serving (un-fenced if it was fenced)
CATCH_UP = "catch-up"  # answers with other weights: fenced, then staged and committed to the fleet's
FENCE = (
    "fence"  # cannot be asked and not Ready (restarting, loading): fenced now, it comes back on old weights
)
WAIT = "wait"  # Ready but did not answer this time: asked again on the next pass


def decide(weights: FleetWeights | None, answer: dict[str, Any] | None, ready: bool) -> str:
    """The fence decision for one pod. `answer`: its /weight_info reply (None when it could not be asked or
    did not answer), `ready`: its Ready condition."""
    if not weights or not weights.get("version"):
        return LEAVE
    if answer is None:
        return WAIT if ready else FENCE
    same_digest = not weights.get("digest") or answer.get("digest") == weights["digest"]
    if answer.get("weight_version") == weights["version"] and same_digest:
        return SERVE
    return CATCH_UP


def recorded_for(weights: FleetWeights, spec: FleetSpec) -> bool:
    """Whether the fleet's recorded weights still apply to its spec: they were committed over the model the
    pods load (`spec.model`, "" for the default). Once spec.model changes, the pods roll out on the new
    model and the weights of an update of the old one must not be forced on them."""
    return str(weights.get("model") or "") == (spec.model or "")


def serving(pod: dict[str, Any]) -> bool:
    """Whether the pod is in its fleet's Service (not fenced)."""
    return ((pod.get("metadata") or {}).get("labels") or {}).get(SERVING_LABEL) != "false"


def is_ready(pod: dict[str, Any]) -> bool:
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


async def set_serving(
    kube: Kube, ns: str, name: str, uid: str, on: bool, why: str, event_on: dict[str, Any] | None = None
) -> bool:
    """Fence (`on` False) or un-fence the pod; an Event on `event_on` (the fleet or the update) and a log line
    say why. False when the pod is gone or replaced (nothing to fence) or the API refused."""
    try:
        await kube.patch_pod_labels(ns, name, uid, {SERVING_LABEL: "true" if on else "false"})
    except ApiException as exc:
        if exc.status not in (404, 409, 422):  # gone, or a new pod of that name (the uid precondition)
            log.warning(
                "pod %s/%s: %s not written: HTTP %s %s", ns, name, SERVING_LABEL, exc.status, exc.reason
            )
        return False
    reason, verb = ("PodUnfenced", "back in the Service") if on else ("PodFenced", "out of the Service")
    message = f"{name}: {verb} ({why})"
    log.info("pod %s/%s %s (%s)", ns, name, verb, why)
    if event_on is not None:
        kopf.event(as_body(event_on), type="Normal" if on else "Warning", reason=reason, message=message)
    return True
