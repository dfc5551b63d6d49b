"""Reconcile an InferenceDeployment's router (`spec.router`): apply its objects (router_objects), report its
state, and remove it when it is turned off. Only objects this fleet owns are ever written or deleted."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import kopf

from kvpilot.operator.fleets import builders, router_objects
from kvpilot.operator.fleets.status import FleetStatus, RouterStatus
from kvpilot.operator.kube.api import ApiException, Kube, namespace_terminating
from kvpilot.operator.kube.owners import as_body, holder, owned_by
from kvpilot.operator.rbac import ROUTER_CLUSTER_ROLE
from kvpilot.operator.specs import FleetSpec


@dataclass(frozen=True, slots=True)
class RouterState:
    status: RouterStatus | None  # status.router; None: no router
    ready: bool = True  # every wanted router pod is ready and runs the current spec
    reason: str = ""  # why not (a CamelCase reason for the Ready condition)
    message: str = ""
    retry: bool = False  # a problem that a later reconcile may solve (an API error, a name taken)
    retry_delay_s: float = 60.0

    @property
    def problem(self) -> tuple[str, str] | None:
        """(reason, message) for the fleet's Ready condition, or None."""
        return None if self.ready else (self.reason, self.message)


def deployment_state(name: str, desired: int, dep: dict[str, Any] | None) -> RouterState:
    st = (dep or {}).get("status") or {}
    ready, updated = st.get("readyReplicas", 0), st.get("updatedReplicas", 0)
    status: RouterStatus = {
        "replicas": st.get("replicas", 0),
        "readyReplicas": ready,
        "updatedReplicas": updated,
        "service": router_objects.router_name(name),
    }
    current = dep is not None and st.get("observedGeneration") == dep["metadata"].get("generation")
    if current and ready >= desired and updated >= desired:
        return RouterState(status)
    return RouterState(status, False, "RouterNotReady", f"router {ready}/{desired} ready, {updated} updated")


async def reconcile_router(
    kube: Kube,
    owner: dict[str, Any],
    spec: FleetSpec,
    status: FleetStatus,
    logger: kopf.Logger,
    router_role: str = ROUTER_CLUSTER_ROLE,
) -> RouterState:
    meta = owner["metadata"]
    ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
    rname = router_objects.router_name(name)
    wanted = builders.router_spec(spec)
    if not wanted:
        # Removal reads four objects, so it runs only when there may be something to remove: status says a
        # router ran, or the spec just changed (a router that never reached status, e.g. after a crash).
        if status.get("router") or meta.get("generation") != status.get("observedGeneration"):
            if stopping := await _remove(kube, ns, name, uid, logger):
                # status.router stays until they are gone, so the next reconcile removes the rest
                msg = f"router {rname} is stopping: its RoleBinding goes once its {stopping} pods are gone"
                left: RouterStatus = {"replicas": stopping, "readyReplicas": 0}
                return RouterState(left, message=msg, retry=True, retry_delay_s=5.0)
        return RouterState(None)
    objs = router_objects.objects(name, ns, spec, router_role)
    try:
        # Every name must be free or ours before anything is written: never adopt a user's ServiceAccount,
        # RoleBinding or Service, nor half-build a router next to another fleet's.
        for obj in objs:
            live = await kube.read(obj["kind"], ns, rname)
            if live is not None and not owned_by(live, uid):
                msg = (
                    f"{obj['kind']} {rname} already exists and belongs to {holder(live)}: rename one of them"
                )
                kopf.event(as_body(owner), type="Warning", reason="RouterNameConflict", message=msg)
                return RouterState(None, False, "RouterNameConflict", msg, retry=True)
            if live is not None and live.get("roleRef", obj.get("roleRef")) != obj.get("roleRef"):
                # A binding's roleRef cannot change: ours from an older operator (to a Role of its own) or
                # another router ClusterRole name goes, and is made again below.
                await kube.delete(obj["kind"], ns, rname, live["metadata"]["uid"])
        applied = []
        for obj in objs:
            kopf.adopt(obj, owner=as_body(owner))
            applied.append(await kube.apply(ns, obj))
    except ApiException as exc:
        if namespace_terminating(exc):
            return RouterState(None)
        msg = f"applying the router's objects failed: HTTP {exc.status} {exc.reason}"
        kopf.event(as_body(owner), type="Warning", reason="RouterFailed", message=msg)
        return RouterState(status.get("router"), False, "RouterFailed", msg, retry=True)
    dep = next(o for o in applied if o["kind"] == "Deployment")
    return deployment_state(name, wanted.replicas, dep)


async def _remove(kube: Kube, ns: str, name: str, uid: str, logger: kopf.Logger) -> int:
    """Remove the fleet's router objects; the router pods still running (0: all is gone). Its RoleBinding and ServiceAccount stay
    while a router pod still runs (it shuts down for up to its --shutdown-timeout and may still read its
    EndpointSlices and the fleet's pods meanwhile: without them those reads would be refused)."""
    rname = router_objects.router_name(name)
    workload = [k for k in router_objects.KINDS if k not in ("RoleBinding", "ServiceAccount")]
    removed = [kind for kind in workload if await kube.delete_owned(kind, ns, rname, uid)]
    pods: list[dict[str, Any]]
    pods, _ = await kube.list_pods(
        ns, builders.label_selector({"matchLabels": router_objects.router_selector(name)})
    )
    if not pods:
        removed += [
            k for k in ("RoleBinding", "ServiceAccount") if await kube.delete_owned(k, ns, rname, uid)
        ]
    if removed:
        logger.info("router %s/%s removed (%s): spec.router.enabled is false", ns, rname, ", ".join(removed))
    return len(pods)
