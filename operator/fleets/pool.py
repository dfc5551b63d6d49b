"""Reconcile a fleet's InferencePool (`spec.router.endpointPicker`, inference_pool.py): applied where the
Gateway API Inference Extension's CRD is served, deleted when the picker is turned off. Only a pool this
fleet owns is ever written or deleted. Where the CRD is not served the fleet runs as before (its router and
picker included) and its InferencePoolReady condition says how to get the pool; the operator looks again when
that CRD is installed (handlers.pool_crd_changed)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import kopf

from kvpilot.operator.fleets import inference_pool as ip
from kvpilot.operator.fleets.router_objects import router_name
from kvpilot.operator.fleets.status import FleetStatus
from kvpilot.operator.kube.api import ApiException, Kube, namespace_terminating
from kvpilot.operator.kube.owners import as_body, holder, owned_by
from kvpilot.operator.specs import FleetSpec


@dataclass(frozen=True, slots=True)
class PoolState:
    name: str | None  # status.inferencePool: the pool applied, None when there is none
    condition: tuple[bool, str, str] | None = None  # InferencePoolReady (status, reason, message); None: off
    retry: bool = False  # a problem a later reconcile may solve (a name freed, the API back)


async def reconcile_pool(
    kube: Kube, owner: dict[str, Any], spec: FleetSpec, status: FleetStatus
) -> PoolState:
    meta = owner["metadata"]
    ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
    pname = ip.pool_name(name)
    picker = ip.endpoint_picker(spec)
    if picker is None:
        # Removed only when there may be one: status names it, or the spec just changed (a pool made before a
        # crash, not yet in status), and only where the CRD is served (discovery first: no request for a
        # resource the cluster does not have).
        if status.get("inferencePool") or meta.get("generation") != status.get("observedGeneration"):
            if await kube.serves(ip.GROUP, ip.VERSION, ip.PLURAL):
                await kube.delete_owned("InferencePool", ns, pname, uid)
        return PoolState(None)
    if not await kube.serves(ip.GROUP, ip.VERSION, ip.PLURAL):
        return PoolState(None, (False, "CRDNotInstalled", f"{ip.CRD_NAME} is not served: {ip.INSTALL_HINT}"))
    try:
        live = await kube.read("InferencePool", ns, pname)
        if live is not None and not owned_by(live, uid):
            msg = f"InferencePool {pname} already exists and belongs to {holder(live)}: rename one of them"
            kopf.event(as_body(owner), type="Warning", reason="InferencePoolNameConflict", message=msg)
            return PoolState(None, (False, "InferencePoolNameConflict", msg), retry=True)
        body = ip.inference_pool(name, spec)
        kopf.adopt(body, owner=as_body(owner))
        await kube.apply(ns, body)
    except ApiException as exc:
        if namespace_terminating(exc):
            return PoolState(None)
        msg = f"applying the InferencePool failed: HTTP {exc.status} {exc.reason}"
        kopf.event(as_body(owner), type="Warning", reason="InferencePoolFailed", message=msg)
        return PoolState(status.get("inferencePool"), (False, "InferencePoolFailed", msg), retry=True)
    msg = (
        f"InferencePool {pname}: the fleet's pods on port {spec.port}, endpoint picker Service "
        f"{router_name(name)} port {picker.port}"
    )
    return PoolState(pname, (True, "Applied", msg))
